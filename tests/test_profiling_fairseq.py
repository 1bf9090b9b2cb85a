"""``--admin-init profile`` through fairseq: profile files checked when the model is built,
the trigger before fairseq's first ``train_step`` (K batches from the trainer's own
iterator, nothing left behind on a refusal), two gloo ranks and two ``fairseq-train``
ranks, and one ``fairseq-train`` command that profiles, trains, resumes and generates. The
omegas are checked against the independent computations of ``profiling_utils``.

End-to-end runs go through ``fairseq-train``/``fairseq-generate`` with ``--user-dir``, and
``fairseq_cli.train.main`` in-process for the checks that must stop before training.
"""
import copy
import json
import os
import subprocess
import sys
import textwrap
import weakref

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
from fairseq_admin_pos.models import admin_profile
from profiling_utils import (
    CLINIC,
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
