"""fairseq-admin-average-checkpoints on tiny real fairseq checkpoints (CPU).

One fairseq-train run of admin_transformer_tiny writes epoch and update checkpoints; the
averages are checked against a mean computed here with torch.stack(...).mean in float64.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.join(REPO, ".venv", "bin")
sys.path.insert(0, REPO)

from fairseq_admin_pos.cli import average_checkpoints as avg  # noqa: E402
from fairseq_cli_utils import preprocess, run, write_reversal_corpus  # noqa: E402
from fairseq_cli_utils import env as cli_env  # noqa: E402


def env():
    e = cli_env()
    e["PATH"] = VENV_BIN + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return e


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """3 epochs of admin_transformer_tiny: checkpoint{1,2,3}.pt and checkpoint_E_U.pt every
    2 updates, with trainable omegas (so parameters of the plugin are averaged too)."""
    base = tmp_path_factory.mktemp("avg")
    write_reversal_corpus(base / "raw", n_train=48, n_valid=8, n_test=8, vocab=15, max_len=8)
    preprocess(base / "raw", base / "bin")
    save = base / "run"
    run("fairseq_cli.train", [
        base / "bin", "--user-dir", os.path.join(REPO, "fairseq_admin_pos"),
        "--arch", "admin_transformer_tiny", "--admin-omega", "parameter", "--share-all-embeddings",
        "--optimizer", "adam", "--lr", "5e-3", "--max-tokens", "200", "--max-epoch", "3",
        "--save-interval-updates", "2", "--keep-interval-updates", "-1", "--cpu",
        "--num-workers", "0", "--seed", "3", "--save-dir", save, "--disable-validation"])
    return save


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def reference_mean(paths):
    """Independent mean of every floating-point tensor, float64."""
    models = [load(p)["model"] for p in paths]
    return {k: torch.stack([m[k].double() for m in models]).mean(0)
            for k, v in models[-1].items() if torch.is_tensor(v) and v.is_floating_point()}


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run_cli(capsys):
    """The command line in-process (``main(argv)``: argument parsing, selection, errors);
    test_console_entry_point runs it as a separate process once."""
    def run(*args):
        capsys.readouterr()
        code = avg.main([str(a) for a in args])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)
    return run


def test_epoch_average_matches_independent_mean(run_dir, tmp_path, run_cli):
    out = tmp_path / "avg.pt"
    result = run_cli("--inputs", run_dir, "--num-epoch-checkpoints", 2, "--output", out)
    assert result.returncode == 0, result.stderr
    assert "checkpoint2.pt, checkpoint3.pt" in result.stdout
    state = load(out)
    expected = reference_mean([run_dir / "checkpoint2.pt", run_dir / "checkpoint3.pt"])
    newest = load(run_dir / "checkpoint3.pt")
    assert set(state["model"]) == set(newest["model"])
    omegas = [k for k in expected if k.endswith("omega")]
    assert omegas, "trainable omegas should be in the state dict"
    moved = 0
    for key, mean in expected.items():
        value = state["model"][key]
        assert value.dtype == newest["model"][key].dtype
        assert torch.allclose(value.double(), mean, rtol=1e-6, atol=1e-9), key
        moved += not torch.equal(value, newest["model"][key])
    assert moved > len(expected) // 2  # the average is not just the newest checkpoint
    # non-tensor entries: from the newest checkpoint
    assert state["model"]["_extra_state"] == newest["model"]["_extra_state"]
    assert state["model"]["_extra_state"]["admin_omega"] == "parameter"
    assert state["extra_state"]["train_iterator"] == newest["extra_state"]["train_iterator"]
    assert state["optimizer_history"] == newest["optimizer_history"]
    assert "last_optimizer_state" not in state and "last_optimizer_state" in newest
    assert state["averaged_checkpoints"] == ["checkpoint2.pt", "checkpoint3.pt"]


def test_tied_embeddings_stay_tied(run_dir, tmp_path, run_cli):
    out = tmp_path / "avg.pt"
    assert run_cli("--inputs", run_dir, "--num-epoch-checkpoints", 3, "--output", out).returncode == 0
    model = load(out)["model"]
    newest = load(run_dir / "checkpoint3.pt")["model"]
    tied = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    shared_before = newest[tied[0]].data_ptr() == newest[tied[1]].data_ptr()
    assert (model[tied[0]].data_ptr() == model[tied[1]].data_ptr()) == shared_before
    assert torch.equal(model[tied[0]], model[tied[1]])


@pytest.mark.parametrize("bound,expected", [(None, ["checkpoint2.pt", "checkpoint3.pt"]),
                                            (2, ["checkpoint1.pt", "checkpoint2.pt"])])
def test_epoch_selection_and_upper_bound(run_dir, bound, expected):
    paths = avg.select_checkpoints([str(run_dir)], num_epoch_checkpoints=2, upper_bound=bound)
    assert [os.path.basename(p) for p in paths] == expected


def test_update_checkpoints(run_dir, tmp_path, run_cli):
    names = sorted(n for n in os.listdir(run_dir) if n.count("_") == 2 and n.startswith("checkpoint_"))
    by_update = sorted(names, key=lambda n: int(n[:-3].split("_")[2]))
    assert len(by_update) >= 3
    paths = avg.select_checkpoints([str(run_dir)], num_update_checkpoints=3)
    assert [os.path.basename(p) for p in paths] == by_update[-3:]
    out = tmp_path / "upd.pt"
    assert run_cli("--inputs", run_dir, "--num-update-checkpoints", 3, "--output", out).returncode == 0
    expected = reference_mean(paths)
    state = load(out)
    for key, mean in expected.items():
        assert torch.allclose(state["model"][key].double(), mean, rtol=1e-6, atol=1e-9), key


def test_explicit_files_keep_non_float_entries_of_the_last(run_dir, tmp_path, run_cli):
    """Integer tensors are not averaged: the last file's values are kept. Half precision
    weights are averaged in float64 and written back as half."""
    files = []
    for k, name in enumerate(["checkpoint1.pt", "checkpoint3.pt"]):
        state = load(run_dir / name)
        state["model"]["encoder.step_counter"] = torch.tensor([10 * (k + 1)], dtype=torch.int64)
        for key, value in list(state["model"].items()):
            if torch.is_tensor(value) and value.is_floating_point():
                state["model"][key] = value.half()
        path = tmp_path / f"in{k}.pt"
        torch.save(state, path)
        files.append(path)
    out = tmp_path / "avg.pt"
    result = run_cli("--inputs", *files, "--output", out)
    assert result.returncode == 0, result.stderr
    model = load(out)["model"]
    assert model["encoder.step_counter"].tolist() == [20]
    expected = reference_mean(files)
    for key, mean in expected.items():
        assert model[key].dtype == torch.float16
        assert torch.equal(model[key], mean.half()), key


def _modified(run_dir, tmp_path, change):
    state = load(run_dir / "checkpoint2.pt")
    change(state["model"])
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    return path


@pytest.mark.parametrize(
    "change,message",
    [(lambda m: m.pop("decoder.layers.0.fc2.bias"), "have different keys"),
     (lambda m: m.__setitem__("encoder.layers.1.fc1.weight", torch.zeros(3, 3)),
      "encoder.layers.1.fc1.weight: shape (3, 3)"),
     (lambda m: m["_extra_state"].__setitem__("admin_init", "none"),
      "_extra_state differs"),
     (lambda m: m.__setitem__("decoder.layers.0.fc1.bias",
                              torch.zeros_like(m["decoder.layers.0.fc1.bias"], dtype=torch.int64)),
      "floating point in")],
)
def test_mismatches_are_refused_and_output_untouched(run_dir, tmp_path, change, message, run_cli):
    bad = _modified(run_dir, tmp_path, change)
    out = tmp_path / "avg.pt"
    out.write_bytes(b"previous output")
    result = run_cli("--inputs", bad, run_dir / "checkpoint3.pt", "--output", out)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert out.read_bytes() == b"previous output"
    assert [p for p in os.listdir(tmp_path) if ".tmp." in p] == []


@pytest.mark.parametrize(
    "args,message",
    [(["--num-epoch-checkpoints", "5"], "holds only 3 matching checkpoint(s)"),
     (["--num-epoch-checkpoints", "0"], "must be >= 1"),
     ([], "is a folder: add --num-epoch-checkpoints"),
     (["--checkpoint-upper-bound", "2"], "--checkpoint-upper-bound needs")],
)
def test_selection_errors(run_dir, tmp_path, args, message, run_cli):
    result = run_cli("--inputs", run_dir, "--output", tmp_path / "x.pt", *args)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "x.pt").exists()


def test_console_entry_point(run_dir, tmp_path):
    """The console script's target (setup.py: fairseq-admin-average-checkpoints =
    fairseq_admin_pos.cli.average_checkpoints:cli_main) in its own process; an error exits 2."""
    code = ("import sys; from fairseq_admin_pos.cli.average_checkpoints import cli_main; "
            "sys.argv[0] = 'fairseq-admin-average-checkpoints'; cli_main()")
    out = tmp_path / "one.pt"
    result = subprocess.run([sys.executable, "-c", code, "--inputs", str(run_dir),
                             "--num-epoch-checkpoints", "1", "--output", str(out)],
                            capture_output=True, text=True, env=env(), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "averaged 1 checkpoint(s): checkpoint3.pt" in result.stdout
    one = load(out)["model"]
    newest = load(run_dir / "checkpoint3.pt")["model"]
    for key, value in newest.items():
        if torch.is_tensor(value):
            assert torch.equal(one[key], value), key
