"""``--admin-init profile``: Admin's profiling initialisation (fairseq_admin_pos.profiling and
models/admin_profile.py) in both modes: the pure-torch statistics, the model's omegas
against the independent computations of ``profiling_utils``, determinism, precision, the
wrappers, the flags and the mode kept in the checkpoint. Profile files, fairseq's Trainer,
several ranks and whole ``fairseq-train`` commands: tests/test_profiling_fairseq.py.
"""
import math

import numpy as np
import pytest
import torch

import model_utils
from fairseq_cli_utils import run

from fairseq_admin_pos import profiling
from fairseq_admin_pos.admin import OmegaResidual
from fairseq_admin_pos.models import admin_profile
from profiling_utils import (
    CLINIC,
    DROPOUTS,
    EVAL,
    PROFILE,
    SMALL,
    assert_close,
    clinic_reference,
    first_batches,
    model_omegas,
    reference_omegas,
)


# --------------------------------------------------------------------------------------- #
# pure-torch pieces
# --------------------------------------------------------------------------------------- #
def test_recurrence_by_hand():
    # Var[x_0]=2, Var[f_1]=0.5 -> omega_2 = sqrt(1*2 + 0.5); Var[x_1]=1, Var[f_2]=0.25
    om = profiling.omegas_from_variances([2.0, 1.0, 1.0], [0.5, 0.25, 4.0])
    assert om[0] == 1.0
    assert om[1] == pytest.approx(math.sqrt(2.5))
    assert om[2] == pytest.approx(math.sqrt(2.5 + 0.25))


@pytest.mark.parametrize("include_padding", [False, True])
def test_profiler_moments_match_numpy(include_padding):
    """A toy Post-LN stack of OmegaResidual + LayerNorm: moments -> np.var (ddof=0)."""
    g = torch.Generator().manual_seed(0)
    lin = [torch.nn.Linear(8, 8) for _ in range(3)]
    res = [OmegaResidual(1.0) for _ in range(3)]
    ln = torch.nn.LayerNorm(8)
    x0 = torch.randn(5, 4, 8, generator=g) * 3 + 1
    mask = torch.rand(5, 4, generator=g) > 0.3
    seen = []

    def run():
        x = x0
        for l, r in zip(lin, res):
            f = l(x)
            seen.append((x.double().numpy(), f.double().numpy()))
            x = ln(r(x, f))

    om, moments = profiling.measure_omegas(torch.nn.ModuleList(lin + res), {"s": res},
                                           [({"s": mask}, run)], include_padding=include_padding)
    m = mask.numpy()
    ratio = 1.0
    for i, (x, f) in enumerate(seen):
        sel_x, sel_f = (x.reshape(-1), f.reshape(-1)) if include_padding else (x[m], f[m])
        vx, vf = profiling.variances_from_moments(moments["s"])
        assert vx[i] == pytest.approx(np.var(sel_x), rel=1e-9)
        assert vf[i] == pytest.approx(np.var(sel_f), rel=1e-9)
        assert om["s"][i] == pytest.approx(ratio, rel=1e-9)
        ratio = math.sqrt(ratio ** 2 * np.var(sel_x) + np.var(sel_f))
    # the pass leaves omegas untouched
    assert all(float(r.omega) == 1.0 for r in res)


def _toy_stack(seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = [torch.nn.Linear(8, 8) for _ in range(3)]
    res = [OmegaResidual(1.0) for _ in range(3)]
    drop = torch.nn.Dropout(0.3)
    ln = torch.nn.LayerNorm(8)
    x0 = torch.randn(5, 4, 8, generator=g) * 3 + 1
    return torch.nn.ModuleList(lin + res + [drop, ln]), lin, res, drop, ln, x0


def test_in_pass_profiler_applies_each_omega_as_the_pass_reaches_it():
    """A toy Post-LN stack with dropout, in training mode: Clinic's loop written out (omega
    applied by hand, np.var of x * omega and of the dropped-out f over the whole tensor)."""
    root, lin, res, drop, ln, x0 = _toy_stack()

    def run():
        x = x0
        for l, r in zip(lin, res):
            x = ln(r(x, drop(l(x))))

    torch.manual_seed(3)
    om, _ = profiling.measure_omegas(root, {"s": res}, [({}, run)], mode="clinic")
    assert all(float(r.omega) == 1.0 for r in res)  # the pass leaves the model's omegas
    torch.manual_seed(3)
    with torch.no_grad():
        x, ratio, expected = x0, 1.0, []
        for l in lin:
            f = drop(l(x))
            expected.append(ratio)
            xo = x * ratio
            ratio = math.sqrt(np.var(xo.double().numpy()) + np.var(f.double().numpy()))
            x = ln(xo + f)
    assert om["s"] == pytest.approx(expected, rel=1e-6)
    assert om["s"][1] > 1.0 and om["s"][2] > om["s"][1]


def test_in_pass_profiler_takes_exactly_one_pass_with_padding():
    root, lin, res, drop, ln, x0 = _toy_stack()

    def run():
        x = x0
        for l, r in zip(lin, res):
            x = ln(r(x, drop(l(x))))

    with pytest.raises(ValueError, match="more than one batch"):
        profiling.measure_omegas(root, {"s": res}, [({}, run), ({}, run)], mode="clinic")
    with pytest.raises(ValueError, match="counts padding"):
        profiling.measure_omegas(root, {"s": res}, [({}, run)], mode="clinic",
                                 include_padding=False)
    with pytest.raises(RuntimeError, match="reached 0 of the 3"):  # a pass that misses them
        profiling.measure_omegas(root, {"s": res}, [({}, lambda: None)], mode="clinic")


# --------------------------------------------------------------------------------------- #
# the model: trigger, independent checks, determinism, precision, wrappers
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("omega_form", ["buffer", "parameter"])
@pytest.mark.parametrize("include_padding", [False, True])
def test_eval_mode_sets_reference_omegas(tiny_data, omega_form, include_padding):
    extra = SMALL + EVAL + ["--admin-omega", omega_form, "--dropout", "0.3"]
    if include_padding:
        extra.append("--admin-profile-include-padding")
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", extra, seed=4)
    (n,) = first_batches(task)
    assert bool((n["src_tokens"] == task.source_dictionary.pad()).any())  # padding present
    expected = reference_omegas(model, [n], include_padding)

    assert int(model.admin_profiled) == 0
    assert all(v == 1.0 for vals in model_omegas(model).values() for v in vals)
    model.train()
    model(**n)  # the first training forward profiles, then computes the normal output
    assert model.training and all(m.training for m in model.modules())
    assert int(model.admin_profiled) == 1
    got = model_omegas(model)
    assert_close(got, expected, 1e-5)
    assert len(got["encoder"]) == 4 and len(got["decoder"]) == 6
    assert got["encoder"][0] == 1.0 and got["decoder"][0] == 1.0
    assert all(b > a for vals in got.values() for a, b in zip(vals, vals[1:]))
    if omega_form == "parameter":
        mod = admin_profile.residual_stacks(model)["decoder"][3]
        assert isinstance(mod.omega, torch.nn.Parameter) and mod.omega.shape == (16,)
        assert torch.all(mod.omega == mod.omega[0])
    # a later training forward does not profile again
    before = model_omegas(model)
    model(**first_batches(task, 2)[1])
    assert model_omegas(model) == before


@pytest.mark.parametrize("omega_form", ["buffer", "parameter"])
def test_clinic_mode_is_clinics_in_pass_recurrence_with_the_same_dropout_masks(tiny_data, omega_form):
    extra = SMALL + CLINIC + DROPOUTS + ["--admin-omega", omega_form]
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", extra, seed=4)
    (n,) = first_batches(task)
    assert bool((n["src_tokens"] == task.source_dictionary.pad()).any())  # padding present
    expected = clinic_reference(model, [n], seeds=[21])
    eval_omegas, _ = admin_profile.measure(model, [n], mode="eval")

    torch.manual_seed(21)
    model.train()
    out = model(**n)[0]  # profiles (forked RNG: the masks of this very forward), then trains
    got = model_omegas(model)
    assert_close(got, expected, 1e-6)
    assert int(model.admin_profiled) == 1
    # dropout inflates Var[f] and the in-pass omegas compound: clinic > eval, sub-layer 2 on
    assert all(c > e for k in got for c, e in zip(got[k][1:], eval_omegas[k][1:]))
    # the training forward after profiling drew the masks it would have drawn without it
    torch.manual_seed(21)
    assert torch.equal(model(**n)[0], out)


def test_without_dropout_and_padding_clinic_differs_from_eval_by_the_in_pass_omegas(tiny_data):
    """Without dropout and without padding the clinic pass still differs from eval mode only
    through the in-pass omegas; with one sub-layer per stack that difference vanishes."""
    extra = SMALL[:-4] + ["--encoder-layers", "1", "--decoder-layers", "1", "--dropout", "0",
                          "--attention-dropout", "0", "--activation-dropout", "0"]
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", extra + PROFILE, seed=4)
    src, lengths, prev = model_utils.sample_batch(task, bsz=4, src_len=6, tgt_len=5)
    n = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    clinic, _ = admin_profile.measure(model, [n], mode="clinic")
    eval_, _ = admin_profile.measure(model, [n], mode="eval", include_padding=True)
    # encoder: 2 sub-layers; omega_2 depends only on sub-layer 1's statistics (omega_1 = 1)
    assert clinic["encoder"] == pytest.approx(eval_["encoder"], rel=1e-12)
    # decoder: omega_3 sees omega_2 in clinic mode (in-pass) but omega = 1 in eval mode
    assert clinic["decoder"][:2] == pytest.approx(eval_["decoder"][:2], rel=1e-12)
    assert clinic["decoder"][2] != pytest.approx(eval_["decoder"][2], rel=1e-6)
    assert clinic["decoder"] == pytest.approx(clinic_reference(model, [n], [0])["decoder"], rel=1e-6)


def test_padding_choice_changes_the_omegas(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + EVAL, seed=4)
    (n,) = first_batches(task)
    excl, _ = admin_profile.measure(model, [n], include_padding=False)
    incl, _ = admin_profile.measure(model, [n], include_padding=True)
    assert abs(excl["encoder"][1] - incl["encoder"][1]) > 1e-3


def test_statistics_add_exactly_over_batches(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + EVAL, seed=4)
    b1, b2 = first_batches(task, 2)
    _, m1 = admin_profile.measure(model, [b1])
    _, m2 = admin_profile.measure(model, [b2])
    om12, m12 = admin_profile.measure(model, [b1, b2])
    for k in m12:
        torch.testing.assert_close(m12[k], m1[k] + m2[k], rtol=1e-12, atol=1e-9)
    assert_close(om12, reference_omegas(model, [b1, b2]), 1e-5)


@pytest.mark.parametrize("mode", ["clinic", "eval"])
def test_deterministic_same_seed_same_data(tiny_data, mode):
    runs = []
    for seed in (7, 7, 8):
        model, task, _ = model_utils.build(
            tiny_data, "admin_transformer",
            SMALL + PROFILE + ["--admin-profile-mode", mode], seed=seed)
        model.train()
        model(**first_batches(task)[0])
        runs.append(model_omegas(model))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_bfloat16_model_stats_in_float32(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + EVAL, seed=4)
    (n,) = first_batches(task)
    ref32, _ = admin_profile.measure(model, [n])
    model = model.to(torch.bfloat16)
    assert model.encoder.layers[0].fc1.weight.dtype == torch.bfloat16
    om16, moments = admin_profile.measure(model, [n])
    assert all(m.dtype == torch.float64 for m in moments.values())
    assert_close(om16, ref32, 3e-2)  # the forward itself runs in bf16
    mods = admin_profile.residual_stacks(model)
    dtypes = [m.omega.dtype for v in mods.values() for m in v]
    model.train()
    model(**n)
    # profiling keeps each omega's dtype (bf16, or float32 where the residual keeps it so)
    assert [m.omega.dtype for v in mods.values() for m in v] == dtypes
    assert_close(model_omegas(model), om16, 1e-2)


@pytest.mark.parametrize("mode", ["clinic", "eval"])
def test_checkpoint_activations_wrapper_is_profiled_too(tiny_data, mode):
    extra = SMALL + PROFILE + ["--admin-profile-mode", mode]
    plain, task, _ = model_utils.build(tiny_data, "admin_transformer", extra, seed=4)
    ckpt, _, _ = model_utils.build(tiny_data, "admin_transformer",
                                   extra + ["--checkpoint-activations"], seed=4)
    assert hasattr(ckpt.encoder.layers[0], "precheckpoint_forward")
    (n,) = first_batches(task)
    for m in (plain, ckpt):
        torch.manual_seed(5)
        m.train()
        m(**n)
    assert_close(model_omegas(ckpt), model_omegas(plain), 1e-6)


def test_eval_forward_never_profiles(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=4)
    model.eval()
    model(**first_batches(task)[0])
    assert int(model.admin_profiled) == 0


# --------------------------------------------------------------------------------------- #
# flags, layer counts, the mode in the checkpoint
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("extra, message", [
    (PROFILE + ["--admin-profile-batches", "0"], "--admin-profile-batches"),
    (["--admin-init", "closed-form", "--admin-profile-path", "x.json"], "--admin-profile-path"),
    (["--admin-init", "none", "--admin-profile-include-padding"], "--admin-profile-include-padding"),
    (["--admin-init", "closed-form", "--admin-profile-mode", "eval"], "--admin-profile-mode"),
    (PROFILE + ["--admin-profile-batches", "2"], "--admin-profile-mode eval"),
    (CLINIC + ["--admin-profile-batches", "2"], "--admin-profile-batches 2 cannot be combined"),
    (PROFILE + ["--store-ema"], "--store-ema"),
    (PROFILE + ["--decoder-layers", "0"], "--decoder-layers 0"),
    (["--decoder-layers", "-2"], "--decoder-layers must be a non-negative integer"),
    (["--encoder-layers", "-1", "--admin-init", "none"], "--encoder-layers must be a non-negative"),
    (["--admin-residual", "deepnorm", "--encoder-layers", "0"], "--encoder-layers 0 cannot be"),
])
def test_bad_flags_name_the_flag(tiny_data, extra, message):
    with pytest.raises(ValueError, match=message):
        model_utils.build(tiny_data, "admin_transformer", SMALL[:-4] + extra)


def test_zero_layers_is_fairseqs_embedding_only_stack(tiny_data):
    # the encoder only: a decoder of 0 layers never sees the source and is refused
    # (models/flags.py check_layer_counts; tests/test_flag_errors.py)
    model, task, _ = model_utils.build(
        tiny_data, "admin_transformer", SMALL[:-4] + ["--encoder-layers", "0"])
    assert len(model.encoder.layers) == 0
    src, lengths, prev = model_utils.sample_batch(task)
    assert torch.isfinite(model(src, lengths, prev)[0]).all()


def test_clinic_mode_with_padding_flag_counts_padding(tiny_data):
    # the clinic mode always counts padding: the flag agrees with it and changes nothing
    base, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + CLINIC, seed=4)
    flagged, _, _ = model_utils.build(tiny_data, "admin_transformer",
                                      SMALL + CLINIC + ["--admin-profile-include-padding"], seed=4)
    assert flagged.admin_profile.include_padding and base.admin_profile.include_padding
    (n,) = first_batches(task)
    for m in (base, flagged):
        torch.manual_seed(1)
        m.train()
        m(**n)
    assert model_omegas(base) == model_omegas(flagged)


def test_mode_is_stored_in_the_checkpoint_and_checked_on_load(tiny_data):
    clinic, _, args = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE)
    assert args.admin_profile_mode == "clinic"  # the default, recorded in the saved config
    state = clinic.state_dict()
    assert state["_extra_state"]["admin_profile_mode"] == "clinic"
    other, _, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + EVAL)
    with pytest.raises(ValueError, match="--admin-profile-mode: checkpoint 'clinic', flags 'eval'"):
        other.load_state_dict(state)
    closed, _, _ = model_utils.build(tiny_data, "admin_transformer", SMALL)
    assert closed.state_dict()["_extra_state"]["admin_profile_mode"] is None
