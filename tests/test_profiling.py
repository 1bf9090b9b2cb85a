"""``--admin-init profile``: Admin's profiling initialisation (fairseq_admin_pos.profiling and
models/admin_profile.py), in both modes.

The omegas the model sets are checked against independent computations:

* eval mode: forward hooks on the attention/FFN/LayerNorm modules (not on the residual
  modules the implementation hooks), ``numpy.var`` over the real-token positions and the
  ratio recurrence written out again here;
* clinic mode: Transformer-Clinic's profiling pass written out again as a loop over the
  layers (fairseq's sub-modules in training mode, the same RNG draws in the same order), each
  omega applied by hand as the loop reaches it, ``numpy.var`` of ``x * omega`` and of the
  dropped-out branch over the whole tensor, padding included; several "ranks" run in
  lockstep, each with its own RNG stream, for the data-parallel check.

End-to-end runs go through ``fairseq-train``/``fairseq-generate`` with ``--user-dir``, and
``fairseq_cli.train.main`` in-process for the checks that must stop before training.
"""
import copy
import json
import math
import os
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
import torch

import model_utils
from fairseq_cli_utils import (
    REPO,
    TINY_MODEL,
    TRAIN_COMMON,
    USER_DIR,
    env,
    free_port,
    generate,
    hypotheses,
    load_model_state,
    run,
    train,
    train_losses,
)

from fairseq_admin_pos import profiling
from fairseq_admin_pos.admin import OmegaResidual
from fairseq_admin_pos.models import admin_profile

# fixed omegas (the default with profiling is a trainable vector): training leaves the
# profiled values as they are, so the checks below read them after training too
PROFILE = ["--admin-init", "profile", "--admin-omega", "buffer"]
EVAL = PROFILE + ["--admin-profile-mode", "eval"]
CLINIC = PROFILE + ["--admin-profile-mode", "clinic"]
DROPOUTS = ["--dropout", "0.3", "--attention-dropout", "0.1", "--activation-dropout", "0.1"]


# --------------------------------------------------------------------------------------- #
# helpers: independent computations of the omegas
# --------------------------------------------------------------------------------------- #
def first_batches(task, n=1, max_tokens=200, seed=1):
    """The first n batches of epoch 1, batched like fairseq-train (multiple of 8 sentences)."""
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=max_tokens, seed=seed,
                                  required_batch_size_multiple=8,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=True)
    out = []
    for sample in itr:
        out.append(sample["net_input"])
        if len(out) == n:
            return out
    raise AssertionError("not enough batches")


def reference_omegas(model, net_inputs, include_padding=False):
    """Eval mode. Shortcuts and branches captured from the sub-modules *around* each
    residual call (layer inputs, attention/fc2 outputs, LayerNorm outputs), variances with
    numpy (float64, ddof=0, over real-token positions unless include_padding), recurrence
    ratio_1 = 1, omega_i = ratio_i, ratio_{i+1} = sqrt(omega_i^2 Var[x] + Var[f])."""
    captured = {"encoder": [], "decoder": []}
    handles = []

    def grab(stack, kind, pre=False):
        def hook(mod, args, out=None):
            t = args[0] if pre else (out[0] if isinstance(out, tuple) else out)
            captured[stack].append((kind, t.detach().double().numpy().copy()))
        return hook

    for layer in model.encoder.layers:
        handles.append(layer.register_forward_pre_hook(grab("encoder", "x", pre=True)))
        handles.append(layer.self_attn.register_forward_hook(grab("encoder", "f")))
        handles.append(layer.self_attn_layer_norm.register_forward_hook(grab("encoder", "x")))
        handles.append(layer.fc2.register_forward_hook(grab("encoder", "f")))
    for layer in model.decoder.layers:
        handles.append(layer.register_forward_pre_hook(grab("decoder", "x", pre=True)))
        handles.append(layer.self_attn.register_forward_hook(grab("decoder", "f")))
        handles.append(layer.self_attn_layer_norm.register_forward_hook(grab("decoder", "x")))
        handles.append(layer.encoder_attn.register_forward_hook(grab("decoder", "f")))
        handles.append(layer.encoder_attn_layer_norm.register_forward_hook(grab("decoder", "x")))
        handles.append(layer.fc2.register_forward_hook(grab("decoder", "f")))

    per_batch = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for n in net_inputs:
                for k in captured:
                    captured[k] = []
                enc = model.encoder(n["src_tokens"], src_lengths=n["src_lengths"])
                model.decoder(n["prev_output_tokens"], encoder_out=enc, features_only=True)
                masks = {
                    "encoder": (n["src_tokens"] != model.encoder.padding_idx).numpy(),
                    "decoder": (n["prev_output_tokens"] != model.decoder.padding_idx).numpy(),
                }
                per_batch.append(({k: list(v) for k, v in captured.items()}, masks))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()

    omegas = {}
    for stack in ("encoder", "decoder"):
        # shortcuts in execution order: each layer's input, then the LayerNorm outputs that
        # feed the next sub-layer of the same layer (the FFN's LN output is the next input)
        n_sub = len(getattr(model, stack).layers) * (2 if stack == "encoder" else 3)
        shortcut_vals, branch_vals = [[] for _ in range(n_sub)], [[] for _ in range(n_sub)]
        for seq, masks in per_batch:
            xs = [t for kind, t in seq[stack] if kind == "x"]
            fs = [t for kind, t in seq[stack] if kind == "f"]
            assert len(xs) == len(fs) == n_sub
            for i, (x, f) in enumerate(zip(xs, fs)):
                mask = masks[stack].T  # (T, B), fairseq activations are (T, B, C)
                if include_padding:
                    shortcut_vals[i].append(x.reshape(-1))
                    branch_vals[i].append(f.reshape(-1))
                else:
                    shortcut_vals[i].append(x[mask].reshape(-1))
                    branch_vals[i].append(f[mask].reshape(-1))
        ratio, out = 1.0, []
        for xv, fv in zip(shortcut_vals, branch_vals):
            out.append(ratio)
            ratio = math.sqrt(ratio ** 2 * np.var(np.concatenate(xv)) + np.var(np.concatenate(fv)))
        omegas[stack] = out
    return omegas


def clinic_layers(model, n):
    """Transformer-Clinic's profiling forward (its ``transformer_layer.py``), written out:
    fairseq's sub-modules called in the order and with the arguments of the model's own
    forward (so the dropout draws are the same), a generator that yields ``(stack, x, f)``
    at every residual sub-layer - ``x`` the shortcut, ``f`` the dropped-out branch output,
    ``(T, B, C)`` - and takes back the omega that the sub-layer applies:
    ``LN(x * omega + f)``. The model must be in training mode."""
    enc, dec = model.encoder, model.decoder
    src, prev = n["src_tokens"], n["prev_output_tokens"]
    pad = src.eq(enc.padding_idx)
    x, _ = enc.forward_embedding(src)
    x = (x * (1 - pad.unsqueeze(-1).type_as(x))).transpose(0, 1)
    src_pad = pad if pad.any() else None
    for layer in enc.layers:
        f, _ = layer.self_attn(query=x, key=x, value=x, key_padding_mask=src_pad,
                               need_weights=False, attn_mask=None)
        f = layer.dropout_module(f)
        omega = yield "encoder", x, f
        x = layer.self_attn_layer_norm(x * omega + f)
        f = layer.fc2(layer.activation_dropout_module(layer.activation_fn(layer.fc1(x))))
        f = layer.dropout_module(f)
        omega = yield "encoder", x, f
        x = layer.final_layer_norm(x * omega + f)
    enc_out = x
    y = dec.embed_scale * dec.embed_tokens(prev) + dec.embed_positions(prev)
    y = dec.dropout_module(y).transpose(0, 1)
    tgt_pad = prev.eq(dec.padding_idx)
    tgt_pad = tgt_pad if tgt_pad.any() else None
    last = len(dec.layers) - 1
    for i, layer in enumerate(dec.layers):
        f, _ = layer.self_attn(query=y, key=y, value=y, key_padding_mask=tgt_pad,
                               incremental_state=None, need_weights=False,
                               attn_mask=dec.buffered_future_mask(y))
        f = layer.dropout_module(f)
        omega = yield "decoder", y, f
        y = layer.self_attn_layer_norm(y * omega + f)
        f, _ = layer.encoder_attn(query=y, key=enc_out, value=enc_out, key_padding_mask=src_pad,
                                  incremental_state=None, static_kv=True,
                                  need_weights=i == last, need_head_weights=i == last)
        f = layer.dropout_module(f)
        omega = yield "decoder", y, f
        y = layer.encoder_attn_layer_norm(y * omega + f)
        f = layer.fc2(layer.activation_dropout_module(layer.activation_fn(layer.fc1(y))))
        f = layer.dropout_module(f)
        omega = yield "decoder", y, f
        y = layer.final_layer_norm(y * omega + f)


def clinic_reference(model, net_inputs, seeds):
    """Clinic's in-pass omegas. Each batch is one "rank" with its own RNG stream seeded with
    its seed; the ranks run in lockstep, and at each sub-layer ``omega = ratio`` and
    ``ratio = sqrt(np.var(x * omega) + np.var(f))`` over all ranks' flattened tensors
    (padding included). One batch and one seed: Clinic's single-GPU profiling run."""
    was_training = model.training
    model.train()
    outer = torch.get_rng_state()
    try:
        with torch.no_grad():
            states, gens = [], []
            for n, seed in zip(net_inputs, seeds):
                torch.manual_seed(seed)
                states.append(torch.get_rng_state())
                gens.append(clinic_layers(model, n))

            def step(r, value):
                torch.set_rng_state(states[r])
                try:
                    item = next(gens[r]) if value is None else gens[r].send(value)
                except StopIteration:
                    item = None
                states[r] = torch.get_rng_state()
                return item

            ratio = {"encoder": 1.0, "decoder": 1.0}
            omegas = {"encoder": [], "decoder": []}
            items = [step(r, None) for r in range(len(gens))]
            while items[0] is not None:
                stack = items[0][0]
                assert all(it[0] == stack for it in items)
                omega = ratio[stack]
                xs = np.concatenate([(x * omega).double().numpy().reshape(-1) for _, x, _ in items])
                fs = np.concatenate([f.double().numpy().reshape(-1) for _, _, f in items])
                ratio[stack] = math.sqrt(np.var(xs) + np.var(fs))
                omegas[stack].append(omega)
                items = [step(r, omega) for r in range(len(gens))]
    finally:
        torch.set_rng_state(outer)
        model.train(was_training)
    return omegas


def model_omegas(model):
    return {k: profiling.get_omegas(v) for k, v in admin_profile.residual_stacks(model).items()}


def assert_close(a, b, tol):
    assert set(a) == set(b)
    for k in a:
        assert len(a[k]) == len(b[k]), k
        np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=k)



SMALL = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim",
         "32", "--decoder-ffn-embed-dim", "32", "--encoder-layers", "2", "--decoder-layers", "2"]


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


# --------------------------------------------------------------------------------------- #
# profile files: format, mode and settings, checked when the model is built
# --------------------------------------------------------------------------------------- #
def test_json_round_trip_is_atomic(tmp_path):
    omegas = {"encoder": [1.0, 1.25, 1.5, 1.7], "decoder": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]}
    moments = {k: torch.tensor([[[10.0, 1.0, 12.0], [10.0, 0.0, 3.0]]] * len(v), dtype=torch.float64)
               for k, v in omegas.items()}
    path = tmp_path / "sub" / "profile.json"
    profiling.save_profile(str(path), omegas, {"encoder_layers": 2, "seed": 3}, moments)
    assert sorted(os.listdir(path.parent)) == ["profile.json"]  # no temporary left behind
    got, settings, kind = profiling.load_profile(str(path))
    assert kind == "json" and got == omegas and settings == {"encoder_layers": 2, "seed": 3}
    data = json.loads(path.read_text())
    assert data["version"] == 2
    assert data["variances"]["encoder"]["shortcut_variance"][0] == pytest.approx(1.2 - 0.01)
    assert data["variances"]["encoder"]["branch_variance"][0] == pytest.approx(0.3)


@pytest.mark.parametrize("mode", ["clinic", "eval"])
def test_profile_file_records_the_mode_and_is_read_back(tiny_data, tmp_path, mode):
    path = tmp_path / "p.json"
    extra = SMALL + PROFILE + ["--admin-profile-mode", mode, "--admin-profile-path", path]
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", extra, seed=4)
    model.train()
    model(**first_batches(task)[0])
    data = json.loads(path.read_text())
    s = data["settings"]
    assert s["admin_profile_mode"] == mode
    assert s["admin_profile_include_padding"] == (mode == "clinic")
    assert s["encoder_embed_dim"] == 16 and s["decoder_layers"] == 2 and s["dropout"] == 0.1
    assert_close(data["omegas"], model_omegas(model), 1e-6)
    # a new model with the same flags accepts the file and reads it
    again, task, _ = model_utils.build(tiny_data, "admin_transformer", extra, seed=9)
    again.train()
    again(**first_batches(task)[0])
    assert_close(model_omegas(again), data["omegas"], 1e-6)


def _profile_file(tmp_path, omegas=None, **settings):
    path = tmp_path / "p.json"
    omegas = omegas or {"encoder": [1.0, 1.5, 1.7, 1.9], "decoder": [1.0, 1.2, 1.3, 1.4, 1.5, 1.6]}
    profiling.save_profile(str(path), omegas, settings)
    return path


CLINIC_FILE = "1 1.0\n2 1.5\n3 1.75\n4 2.0\n1 1.0\n2 1.25\n3 1.5\n4 1.625\n5 1.75\n6 2.25\n"


@pytest.mark.parametrize("case, message", [
    ("count", "has 4 encoder and 6 decoder omegas but the model has 6 encoder (3 layers) "
              "and 6 decoder (2 layers)"),
    ("nan", "encoder omega 2 is nan"),
    ("negative", "decoder omega 3 is -1.3"),
    ("zero", "encoder omega 1 is 0"),
    ("width", "--encoder-embed-dim: file 999, flags 16"),
    ("mode", "--admin-profile-mode: file 'eval', flags 'clinic'"),
    ("padding", "--admin-profile-include-padding: file False, flags True"),
    ("dropout", "--dropout: file 0.3, flags 0.1"),
    ("version1", "--admin-profile-mode: file 'eval', flags 'clinic'"),
    ("clinic-in-eval", "use it with --admin-profile-mode clinic"),
])
def test_profile_file_problems_are_errors_when_the_model_is_built(tiny_data, tmp_path, case, message):
    enc3 = ["--encoder-layers", "3"] if case == "count" else []
    mode = ["--admin-profile-mode", "eval"] if case == "clinic-in-eval" else []
    enc, dec = [1.0, 1.5, 1.7, 1.9], [1.0, 1.2, 1.3, 1.4, 1.5, 1.6]
    if case == "nan":
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"format": profiling.PROFILE_FORMAT, "version": 2,
                                    "omegas": {"encoder": [1.0, float("nan"), 1.2, 1.3],
                                               "decoder": dec}}))
    elif case in ("negative", "zero"):
        bad = {"negative": {"decoder": [1.0, 1.2, -1.3, 1.4, 1.5, 1.6], "encoder": enc},
               "zero": {"encoder": [0, 1.5, 1.7, 1.9], "decoder": dec}}[case]
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"format": profiling.PROFILE_FORMAT, "version": 2,
                                    "omegas": bad}))
    elif case == "version1":
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"format": profiling.PROFILE_FORMAT, "version": 1,
                                    "omegas": {"encoder": enc, "decoder": dec},
                                    "settings": {"encoder_layers": 2, "include_padding": False}}))
    elif case == "clinic-in-eval":
        path = tmp_path / "profile.ratio.init"
        path.write_text(CLINIC_FILE)
    else:
        settings = {"count": {}, "width": {"encoder_embed_dim": 999},
                    "mode": {"admin_profile_mode": "eval"},
                    "padding": {"admin_profile_include_padding": False},
                    "dropout": {"dropout": 0.3}}[case]
        path = _profile_file(tmp_path, **settings)
    extra = SMALL + enc3 + PROFILE + mode + ["--admin-profile-path", path]
    with pytest.raises(profiling.ProfileFileError) as e:
        model_utils.build(tiny_data, "admin_transformer", extra)
    assert str(path) in str(e.value)
    assert message in str(e.value)


def test_settings_mismatch_lists_every_difference(tiny_data, tmp_path):
    path = _profile_file(tmp_path, encoder_embed_dim=999, decoder_layers=2,
                         admin_profile_mode="eval", encoder_pos_emb="learned", seed=123)
    with pytest.raises(profiling.ProfileFileError) as e:
        model_utils.build(tiny_data, "admin_transformer",
                          SMALL + PROFILE + ["--admin-profile-path", path])
    msg = str(e.value)
    assert ("(--encoder-embed-dim: file 999, flags 16; --encoder-pos-emb: file 'learned', "
            "flags 'sinusoidal'; --admin-profile-mode: file 'eval', flags 'clinic')") in msg
    assert "seed" not in msg and "--decoder-layers" not in msg  # the sample; equal values


def test_clinic_profile_ratio_init_is_read_by_the_model(tiny_data, tmp_path):
    path = tmp_path / "profile.ratio.init"
    path.write_text(CLINIC_FILE)
    model, task, _ = model_utils.build(
        tiny_data, "admin_transformer", SMALL + CLINIC + ["--admin-profile-path", path], seed=4)
    model.train()
    model(**first_batches(task)[0])
    assert model_omegas(model) == {"encoder": [1.0, 1.5, 1.75, 2.0],
                                   "decoder": [1.0, 1.25, 1.5, 1.625, 1.75, 2.25]}
    assert int(model.admin_profiled) == 1
    assert path.read_text() == CLINIC_FILE  # read, never rewritten


@pytest.mark.parametrize("text, message", [
    ("1 1.0\n2 1.5\n", "two"),
    ("1 1.0\n3 1.5\n1 1.0\n", "index 3 where 2"),
    ("1 1.0\n2 abc\n1 1\n", "line 2"),
    ("1 1.0\n2 -1\n1 1\n", "positive"),
])
def test_clinic_format_errors(tmp_path, text, message):
    path = tmp_path / "p.init"
    path.write_text(text)
    with pytest.raises(profiling.ProfileFileError, match=message) as e:
        profiling.load_profile(str(path))
    assert str(path) in str(e.value)


# --------------------------------------------------------------------------------------- #
# fairseq's Trainer: the trigger before the first train_step, K batches from its iterator
# --------------------------------------------------------------------------------------- #
def test_k_batches_are_the_first_k_the_trainer_trains_on_without_a_new_sampler(tiny_data, monkeypatch):
    from fairseq.data import data_utils

    calls = []
    batch_by_size = data_utils.batch_by_size

    def counting(*args, **kwargs):
        calls.append(1)
        return batch_by_size(*args, **kwargs)

    monkeypatch.setattr(data_utils, "batch_by_size", counting)
    # batches on the device while the next one is made: the profiling pass consumes them one
    # at a time (the previous one is still referenced by the loop at that moment)
    made, alive_at_creation = [], []
    net_input = admin_profile._net_input

    def tracking(sample, device):
        alive_at_creation.append(sum(r() is not None for r in made))
        out = net_input(sample, device)
        made.append(weakref.ref(out["src_tokens"]))
        return out

    monkeypatch.setattr(admin_profile, "_net_input", tracking)
    trainer = model_utils.build_trainer(
        tiny_data, SMALL + EVAL + ["--admin-profile-batches", "3", "--max-tokens", "200"])
    initial = copy.deepcopy(trainer.get_model())  # omega = 1: the weights profiling sees
    itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=True)
    trained = []
    for _, sample in zip(range(3), itr):
        trained.append(sample["net_input"])
        trainer.train_step([sample])
    assert len(calls) == 1  # the trainer's own batching; profiling reused its batches
    assert len(made) == 3 and max(alive_at_creation) <= 1
    assert trainer.get_num_updates() == 3
    # buffer omegas do not train: they are still the profiled ones
    assert_close(model_omegas(trainer.get_model()), reference_omegas(initial, trained), 1e-5)
    # and they are not the omegas of the first batch alone
    one = reference_omegas(initial, trained[:1])
    assert abs(one["encoder"][1] - model_omegas(trainer.get_model())["encoder"][1]) > 1e-4


def _fairseq_train_in_process(argv):
    """``fairseq-train`` as its console script runs it, in this process."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq.logging import metrics
    from fairseq_cli import train as train_cli

    args = options.parse_args_and_arch(options.get_training_parser(), list(map(str, argv)))
    try:
        distributed_utils.call_main(convert_namespace_to_omegaconf(args), train_cli.main)
    finally:
        metrics.reset()  # an aggregator left open by the exception must not leak into others


def _crash_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f == "crash.pt"]


@pytest.mark.parametrize("case, error, message", [
    ("nan omega", profiling.ProfileFileError, "encoder omega 2 is nan"),
    ("other width", profiling.ProfileFileError, "--encoder-embed-dim: file 999, flags 32"),
    ("omega count", profiling.ProfileFileError, "has 2 encoder and 6 decoder omegas"),
    ("negative layers", ValueError, "--decoder-layers must be a non-negative integer; got -2"),
    ("fails while profiling", RuntimeError, "profiling failed here"),
])
def test_fairseq_train_stops_before_training_and_leaves_no_crash_pt(
        tiny_data, tmp_path, monkeypatch, case, error, message):
    monkeypatch.chdir(tmp_path)  # fairseq's default --save-dir is ./checkpoints
    path = tmp_path / "p.json"
    enc, dec = [1.0, 1.5, 1.7, 1.9], [1.0, 1.2, 1.3, 1.4, 1.5, 1.6]
    omegas = {"nan omega": {"encoder": [1.0, float("nan"), 1.2, 1.3], "decoder": dec},
              "omega count": {"encoder": enc[:2], "decoder": dec}}.get(case, {"encoder": enc,
                                                                            "decoder": dec})
    path.write_text(json.dumps({"format": profiling.PROFILE_FORMAT, "version": 2, "omegas": omegas,
                                "settings": {"encoder_embed_dim": 999} if case == "other width" else {}}))
    extra = ["--decoder-layers", "-2"] if case == "negative layers" else []
    if case == "fails while profiling":
        os.unlink(path)

        def broken(*a, **k):
            raise RuntimeError("profiling failed here")

        monkeypatch.setattr(profiling, "measure_omegas", broken)
    with pytest.raises(error, match=message):
        _fairseq_train_in_process([
            tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TRAIN_COMMON,
            *TINY_MODEL, *extra, *PROFILE, "--admin-profile-path", path, "--no-save",
            "--max-update", "2"])
    assert _crash_files(tmp_path) == []


def test_fairseq_train_bad_profile_exit_code_and_message(tiny_data, tmp_path):
    """The command line as a user runs it: a NaN omega is reported as one error line and the
    process exits with status 2 (argparse's; not fairseq's crash handler, not an abort),
    leaving no crash.pt (every profile-file case: tests/test_profile_file_errors.py)."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": profiling.PROFILE_FORMAT, "version": 2,
                                "omegas": {"encoder": [1.0, float("nan"), 1.2, 1.3],
                                           "decoder": [1.0] * 6}}))
    proc = run("fairseq_cli.train", [
        tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TRAIN_COMMON,
        *TINY_MODEL, *PROFILE, "--admin-profile-path", path, "--no-save", "--max-update", "2"],
        cwd=tmp_path, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert "encoder omega 2 is nan" in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert "train_inner" not in log and "terminate called" not in log
    assert _crash_files(tmp_path) == []


# --------------------------------------------------------------------------------------- #
# distributed: two gloo processes (in-process API) and two fairseq-train ranks
# --------------------------------------------------------------------------------------- #
_RANK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import model_utils
    from fairseq_admin_pos import profiling
    from fairseq_admin_pos.models import admin_profile
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if world > 1:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port,
                                rank=rank, world_size=world)
    model, task, _ = model_utils.build({data!r}, "admin_transformer", {extra!r}, seed=5)
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=200, seed=1,
                                  required_batch_size_multiple=8,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=True)
    batches = [s["net_input"] for _, s in zip(range(2), itr)]  # = first_batches(task, 2)
    model.train()
    if world > 1:
        torch.manual_seed(11)           # the same seed on every rank, as fairseq seeds them
        model(**batches[rank])          # the trigger: each rank profiles its own batch
    else:
        om, _ = admin_profile.measure(model, batches)   # one process sees both batches
        admin_profile.apply(model, om)
    res = {{k: profiling.get_omegas(v) for k, v in admin_profile.residual_stacks(model).items()}}
    json.dump(res, open(out, "w"))
""")


@pytest.mark.parametrize("mode", ["clinic", "eval"])
def test_gloo_ranks_get_identical_omegas_equal_to_the_reference(tiny_data, tmp_path, mode):
    """eval: 2 ranks x 1 batch == 1 process x 2 batches. clinic: the moments of every
    sub-layer summed over the ranks inside the pass == Clinic's recurrence over both ranks'
    tensors, run in lockstep with each rank's own dropout masks."""
    extra = SMALL + PROFILE + ["--admin-profile-mode", mode]
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT.format(tests=str(REPO / "tests"), data=str(tiny_data),
                                          extra=extra))
    e = env()
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", port,
                               str(tmp_path / f"r{r}.json")], env=e, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f).read_text()) for f in ("r0.json", "r1.json"))
    assert r0 == r1  # bitwise identical on both ranks
    assert r0["encoder"][1] != 1.0
    if mode == "eval":
        subprocess.run([sys.executable, str(script), "0", "1", port, str(tmp_path / "one.json")],
                       env=e, check=True, capture_output=True)
        assert_close(r0, json.loads((tmp_path / "one.json").read_text()), 1e-9)
    else:
        model, task, _ = model_utils.build(tiny_data, "admin_transformer", extra, seed=5)
        batches = first_batches(task, 2, max_tokens=200, seed=1)
        assert_close(r0, clinic_reference(model, batches, seeds=[11, 11]), 1e-6)


def _omegas_from_state(state):
    """Omegas per stack, in execution order, from a checkpoint's model state dict."""
    out = {}
    order = {"self_attn_residual": 0, "encoder_attn_residual": 1, "final_residual": 2}
    for stack in ("encoder", "decoder"):
        keys = [k for k in state if k.startswith(stack) and k.endswith("_residual.omega")]
        keys.sort(key=lambda k: (int(k.split(".")[2]), order[k.split(".")[3]]))
        out[stack] = [float(state[k].reshape(-1)[0]) for k in keys]
    return out


@pytest.mark.slow
def test_fairseq_train_two_ranks_equal_one_process_two_batches(tiny_data, tmp_path):
    """Eval mode, 2 ranks x 1 batch (gloo) == 1 process x 2 batches: the same two batches
    (fairseq shuffles the batch list with the seed, then shards it), the statistics summed."""
    common = [*TINY_MODEL, *EVAL, "--max-tokens", "200"]
    port = free_port()
    procs = []
    for r in (0, 1):
        cmd = [sys.executable, "-m", "fairseq_cli.train", str(tiny_data), "--user-dir", USER_DIR,
               "--arch", "admin_transformer", *TRAIN_COMMON, *common, "--max-update", "1",
               "--save-dir", str(tmp_path / "ddp"), "--admin-profile-path",
               str(tmp_path / "ddp.json"), "--distributed-init-method",
               f"tcp://127.0.0.1:{port}", "--distributed-world-size", "2",
               "--distributed-rank", str(r), "--distributed-no-spawn", "--distributed-backend",
               "gloo", "--ddp-backend", "legacy_ddp"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    # rank 0 logs (fairseq silences the others); a rank disagreement would have raised
    assert "measured in eval mode on 1 batch(es) x 2 rank(s)" in logs[0]
    p1 = train(tiny_data, tmp_path / "one", "admin_transformer",
               [*common, "--admin-profile-batches", "2", "--admin-profile-path",
                tmp_path / "one.json"], max_update=1)
    assert "measured in eval mode on 2 batch(es) x 1 rank(s)" in p1.stderr + p1.stdout
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    one = json.loads((tmp_path / "one.json").read_text())
    assert_close(ddp["omegas"], one["omegas"], 1e-9)
    assert ddp["settings"]["world_size"] == 2 and one["settings"]["profile_batches"] == 2
    assert_close(_omegas_from_state(load_model_state(tmp_path / "ddp" / "checkpoint_last.pt")),
                 ddp["omegas"], 1e-6)


# --------------------------------------------------------------------------------------- #
# one fairseq-train command: profile, train on, resume without profiling, generate
# --------------------------------------------------------------------------------------- #
@pytest.mark.slow
def test_fairseq_train_profiles_then_resumes_and_generates(tiny_data, tmp_path):
    save, prof = tmp_path / "ck", tmp_path / "prof.json"
    extra = [*TINY_MODEL, *PROFILE, "--admin-profile-path", prof]
    p = train(tiny_data, save, "admin_transformer", extra, max_update=2)
    log = p.stdout + p.stderr
    assert log.count("admin profile: measured in clinic mode") == 1
    assert "num_updates=2" in log  # training continued in the same command
    losses = train_losses(log)
    state = load_model_state(save / "checkpoint_last.pt")
    assert int(state["admin_profiled"]) == 1
    assert state["_extra_state"]["admin_profile_mode"] == "clinic"
    saved = json.loads(prof.read_text())
    assert saved["settings"]["admin_profile_mode"] == "clinic"
    ck_omegas = _omegas_from_state(state)
    assert_close(ck_omegas, saved["omegas"], 1e-6)
    assert len(ck_omegas["encoder"]) == 4 and ck_omegas["encoder"][1] > 1.05
    assert saved["settings"]["encoder_layers"] == 2 and saved["settings"]["seed"] == 3

    # the omegas are Clinic's, on the first training batch of the freshly initialised model
    # (fairseq-train seeds the init with --seed), with the dropout masks of the first
    # training step (fairseq seeds it with seed + num_updates = 3)
    model, task, _ = model_utils.build(tiny_data, "admin_transformer",
                                       [*TINY_MODEL, *PROFILE, "--max-tokens", "400"], seed=3)
    first = first_batches(task, 1, max_tokens=400, seed=3)
    assert_close(clinic_reference(model, first, seeds=[3]), saved["omegas"], 1e-5)

    # resume: no second profiling, omegas unchanged (buffers), training goes on
    os.unlink(prof)
    p = train(tiny_data, save, "admin_transformer", extra, max_update=4)
    log = p.stdout + p.stderr
    assert "admin profile:" not in log and "num_updates=4" in log
    assert not prof.exists()
    assert _omegas_from_state(load_model_state(save / "checkpoint_last.pt")) == ck_omegas

    # generate needs no side file
    out = generate(tiny_data, save / "checkpoint_last.pt").stdout
    assert out.count("\nH-") + out.startswith("H-") > 0
    # nor does it read one measured since with other settings: the omegas are the checkpoint's
    _profile_file(tmp_path, admin_profile_mode="eval", encoder_embed_dim=999).rename(prof)
    again = generate(tiny_data, save / "checkpoint_last.pt").stdout
    assert hypotheses(again) == hypotheses(out)
    os.unlink(prof)

    # a new run given the saved profile reads it instead of measuring, and trains exactly
    # as the run that measured it: profiling consumed none of training's random numbers
    profiling.save_profile(str(prof), saved["omegas"], saved["settings"])
    p = train(tiny_data, tmp_path / "ck2", "admin_transformer", extra, max_update=2)
    log = p.stdout + p.stderr
    assert "read json omegas from" in log and "admin profile: measured" not in log
    assert train_losses(log) == losses and len(losses) == 2
    assert_close(_omegas_from_state(load_model_state(tmp_path / "ck2" / "checkpoint_last.pt")),
                 saved["omegas"], 1e-6)
