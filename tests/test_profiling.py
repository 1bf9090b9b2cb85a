"""``--admin-init profile``: Admin's profiling initialisation (fairseq_admin_pos.profiling and
models/admin_profile.py).

The omegas the model sets are checked against an independent computation: forward hooks on
the attention/FFN/LayerNorm modules (not on the residual modules the implementation hooks),
``numpy.var`` over the real-token positions and the ratio recurrence written out again here.
End-to-end runs go through ``fairseq-train``/``fairseq-generate`` with ``--user-dir``.
"""
import json
import math
import os
import socket
import subprocess
import sys
import textwrap

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
    generate,
    load_model_state,
    train,
)

from fairseq_admin_pos import profiling
from fairseq_admin_pos.admin import OmegaResidual
from fairseq_admin_pos.models import admin_profile

PROFILE = ["--admin-init", "profile"]


# --------------------------------------------------------------------------------------- #
# helpers: an independent computation of the omegas
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
    """Shortcuts and branches captured from the sub-modules *around* each residual call
    (layer inputs, attention/fc2 outputs, LayerNorm outputs), variances with numpy (float64,
    ddof=0, over real-token positions unless include_padding), recurrence
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


def model_omegas(model):
    return {k: profiling.get_omegas(v) for k, v in admin_profile.residual_stacks(model).items()}


def assert_close(a, b, tol):
    assert set(a) == set(b)
    for k in a:
        assert len(a[k]) == len(b[k]), k
        np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=k)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_profiling_module_imports_no_fairseq():
    code = ("import importlib.util, sys;"
            f"spec = importlib.util.spec_from_file_location('p', {os.path.join(REPO, 'fairseq_admin_pos', 'profiling.py')!r});"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "print(any(k == 'fairseq' or k.startswith('fairseq.') for k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env())
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------- #
# the model: trigger, independent check, determinism, precision, wrappers
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("omega_form", ["buffer", "parameter"])
@pytest.mark.parametrize("include_padding", [False, True])
def test_first_training_forward_sets_reference_omegas(tiny_data, omega_form, include_padding):
    extra = SMALL + PROFILE + ["--admin-omega", omega_form, "--dropout", "0.3"]
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


def test_padding_choice_changes_the_omegas(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=4)
    (n,) = first_batches(task)
    excl, _ = admin_profile.measure(model, [n], include_padding=False)
    incl, _ = admin_profile.measure(model, [n], include_padding=True)
    assert abs(excl["encoder"][1] - incl["encoder"][1]) > 1e-3


def test_statistics_add_exactly_over_batches(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=4)
    b1, b2 = first_batches(task, 2)
    _, m1 = admin_profile.measure(model, [b1])
    _, m2 = admin_profile.measure(model, [b2])
    om12, m12 = admin_profile.measure(model, [b1, b2])
    for k in m12:
        torch.testing.assert_close(m12[k], m1[k] + m2[k], rtol=1e-12, atol=1e-9)
    assert_close(om12, reference_omegas(model, [b1, b2]), 1e-5)


def test_deterministic_same_seed_same_data(tiny_data):
    runs = []
    for seed in (7, 7, 8):
        model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=seed)
        model.train()
        model(**first_batches(task)[0])
        runs.append(model_omegas(model))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_bfloat16_model_stats_in_float32(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=4)
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


def test_checkpoint_activations_wrapper_is_profiled_too(tiny_data):
    plain, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=4)
    ckpt, _, _ = model_utils.build(tiny_data, "admin_transformer",
                                   SMALL + PROFILE + ["--checkpoint-activations"], seed=4)
    assert hasattr(ckpt.encoder.layers[0], "precheckpoint_forward")
    (n,) = first_batches(task)
    for m in (plain, ckpt):
        m.train()
        m(**n)
    assert_close(model_omegas(ckpt), model_omegas(plain), 1e-6)


def test_eval_forward_never_profiles(tiny_data):
    model, task, _ = model_utils.build(tiny_data, "admin_transformer", SMALL + PROFILE, seed=4)
    model.eval()
    model(**first_batches(task)[0])
    assert int(model.admin_profiled) == 0


# --------------------------------------------------------------------------------------- #
# flags and precision checks
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("extra, message", [
    (["--admin-init", "profile", "--admin-profile-batches", "0"], "--admin-profile-batches"),
    (["--admin-init", "closed-form", "--admin-profile-path", "x.json"], "--admin-profile-path"),
    (["--admin-init", "none", "--admin-profile-include-padding"], "--admin-profile-include-padding"),
])
def test_bad_flags_name_the_flag(tiny_data, extra, message):
    with pytest.raises(ValueError, match=message):
        model_utils.build(tiny_data, "admin_transformer", SMALL + extra)


@pytest.mark.parametrize("flags, ok", [
    ({"fp16": True}, False), ({"bf16": True}, False),
    ({"fp16": True, "memory_efficient_fp16": True}, True), ({"fp16": True, "amp": True}, True),
    ({}, True),
])
def test_fp16_master_copy_with_trainable_omega_is_refused(tiny_data, flags, ok):
    model, _, args = model_utils.build(tiny_data, "admin_transformer",
                                       SMALL + PROFILE + ["--admin-omega", "parameter"])
    for k, v in flags.items():
        setattr(args, k, v)
    ctrl = admin_profile.ProfileController(args, None)
    if ok:
        ctrl._check_precision()
    else:
        with pytest.raises(ValueError, match="FP16Optimizer"):
            ctrl._check_precision()


# --------------------------------------------------------------------------------------- #
# profile files
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
    assert data["variances"]["encoder"]["shortcut_variance"][0] == pytest.approx(1.2 - 0.01)
    assert data["variances"]["encoder"]["branch_variance"][0] == pytest.approx(0.3)


CLINIC = "1 1.0\n2 1.5\n3 1.75\n4 2.0\n1 1.0\n2 1.25\n3 1.5\n4 1.625\n5 1.75\n6 2.25\n"


def test_clinic_profile_ratio_init_is_read_by_the_model(tiny_data, tmp_path):
    path = tmp_path / "profile.ratio.init"
    path.write_text(CLINIC)
    model, task, _ = model_utils.build(
        tiny_data, "admin_transformer", SMALL + PROFILE + ["--admin-profile-path", path], seed=4)
    model.train()
    model(**first_batches(task)[0])
    assert model_omegas(model) == {"encoder": [1.0, 1.5, 1.75, 2.0],
                                   "decoder": [1.0, 1.25, 1.5, 1.625, 1.75, 2.25]}
    assert int(model.admin_profiled) == 1
    assert path.read_text() == CLINIC  # read, never rewritten


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


@pytest.mark.parametrize("kind", ["json", "clinic"])
def test_mismatched_layer_counts_error_names_file_and_counts(tiny_data, tmp_path, kind):
    path = tmp_path / ("p.json" if kind == "json" else "profile.ratio.init")
    if kind == "json":
        profiling.save_profile(str(path), {"encoder": [1.0, 1.5, 1.7, 1.9],
                                           "decoder": [1.0, 1.2, 1.3, 1.4, 1.5, 1.6]}, {})
    else:
        path.write_text(CLINIC)
    extra = SMALL[:-4] + ["--encoder-layers", "3", "--decoder-layers", "2"]
    model, task, _ = model_utils.build(
        tiny_data, "admin_transformer", extra + PROFILE + ["--admin-profile-path", path])
    model.train()
    with pytest.raises(profiling.ProfileFileError) as e:
        model(**first_batches(task)[0])
    msg = str(e.value)
    assert str(path) in msg
    assert "4 encoder and 6 decoder omegas" in msg
    assert "6 encoder (3 layers) and 6 decoder (2 layers)" in msg


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
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=True)
    batches = [s["net_input"] for _, s in zip(range(2), itr)]
    model.train()
    if world > 1:
        model(**batches[rank])          # the trigger: each rank profiles its own batch
    else:
        om, _ = admin_profile.measure(model, batches)   # one process sees both batches
        admin_profile.apply(model, om)
    res = {{k: profiling.get_omegas(v) for k, v in admin_profile.residual_stacks(model).items()}}
    json.dump(res, open(out, "w"))
""")


def test_gloo_ranks_get_identical_omegas_equal_to_one_process(tiny_data, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT.format(tests=str(REPO / "tests"), data=str(tiny_data),
                                          extra=SMALL + PROFILE))
    e = env()
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", port,
                               str(tmp_path / f"r{r}.json")], env=e, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    subprocess.run([sys.executable, str(script), "0", "1", port, str(tmp_path / "single.json")],
                   env=e, check=True, capture_output=True)
    r0, r1, single = (json.loads((tmp_path / f).read_text()) for f in ("r0.json", "r1.json", "single.json"))
    assert r0 == r1  # bitwise identical on both ranks
    assert_close(r0, single, 1e-9)
    assert r0["encoder"][1] != 1.0


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
    """2 ranks x 1 batch (gloo) == 1 process x 2 batches: the same two batches (fairseq
    shuffles the batch list with the seed, then shards it), the statistics summed."""
    common = [*TINY_MODEL, "--admin-init", "profile", "--max-tokens", "200"]
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
    assert "measured on 1 batch(es) x 2 rank(s)" in logs[0]
    p1 = train(tiny_data, tmp_path / "one", "admin_transformer",
               [*common, "--admin-profile-batches", "2", "--admin-profile-path",
                tmp_path / "one.json"], max_update=1)
    assert "measured on 2 batch(es) x 1 rank(s)" in p1.stderr + p1.stdout
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
    assert log.count("admin profile: measured") == 1
    assert "num_updates=2" in log  # training continued in the same command
    state = load_model_state(save / "checkpoint_last.pt")
    assert int(state["admin_profiled"]) == 1
    saved = json.loads(prof.read_text())
    ck_omegas = _omegas_from_state(state)
    assert_close(ck_omegas, saved["omegas"], 1e-6)
    assert len(ck_omegas["encoder"]) == 4 and ck_omegas["encoder"][1] > 1.05
    assert saved["settings"]["encoder_layers"] == 2 and saved["settings"]["seed"] == 3

    # the omegas are those of the independent computation on the first training batch
    # of the freshly initialised model (fairseq-train seeds the init with --seed)
    model, task, _ = model_utils.build(tiny_data, "admin_transformer",
                                       [*TINY_MODEL, *PROFILE, "--max-tokens", "400"], seed=3)
    first = first_batches(task, 1, max_tokens=400, seed=3)
    assert_close(reference_omegas(model, first), saved["omegas"], 1e-5)

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

    # a new run given the saved profile reads it instead of measuring
    profiling.save_profile(str(prof), saved["omegas"], saved["settings"])
    p = train(tiny_data, tmp_path / "ck2", "admin_transformer", extra, max_update=1)
    log = p.stdout + p.stderr
    assert "read json omegas from" in log and "admin profile: measured" not in log
    assert_close(_omegas_from_state(load_model_state(tmp_path / "ck2" / "checkpoint_last.pt")),
                 saved["omegas"], 1e-6)
