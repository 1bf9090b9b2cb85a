"""Data-parallel training with the plugin: 2 processes == 1 process with --update-freq 2.

Every multi-GPU recipe relies on fairseq's data parallelism: each of N workers takes every
N-th batch and the gradients are summed across workers, which is the same update as one
worker accumulating N consecutive batches (``--update-freq N``). Here that is checked on
CPU with two gloo processes (``--ddp-backend legacy_ddp``: fairseq's default c10d wrapper
passes ``device_ids`` and rejects CPU modules; GPUs keep the default backend), for
admin_transformer with trainable omegas, by comparing the parameters in checkpoint_last.pt.
A third run without accumulation shows the comparison can tell the difference.
"""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from fairseq_cli_utils import env as cli_env
from fairseq_cli_utils import free_port, preprocess, write_reversal_corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.join(REPO, ".venv", "bin")

pytestmark = pytest.mark.slow


def env():
    e = cli_env()
    e["PATH"] = VENV_BIN + os.pathsep + e.get("PATH", "")
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "CUDA_VISIBLE_DEVICES"):
        e.pop(key, None)  # fairseq would infer torchrun / SLURM launching from these
    return e



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    write_reversal_corpus(base / "raw", n_train=96, n_valid=8, n_test=8, vocab=16, max_len=12)
    preprocess(base / "raw", base / "bin")
    return base


def train_args(data, save_dir, update_freq):
    return [
        "fairseq-train", str(data / "bin"), "--user-dir", os.path.join(REPO, "fairseq_admin_pos"),
        "--arch", "admin_transformer_tiny", "--admin-omega", "parameter", "--share-all-embeddings",
        "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "2", "--warmup-init-lr", "1e-4",
        "--max-tokens", "120", "--update-freq", str(update_freq), "--max-update", "3",
        "--seed", "5", "--cpu", "--num-workers", "0", "--disable-validation",
        "--no-epoch-checkpoints", "--save-dir", str(save_dir), "--log-format", "simple",
        "--log-interval", "1",
    ]


def run_single(data, name, update_freq):
    save = data / name
    result = subprocess.run(train_args(data, save, update_freq), capture_output=True, text=True,
                            env=env(), cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return save


def run_two_processes(data, name):
    save = data / name
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = train_args(data, save, 1) + [
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", "2",
            "--distributed-rank", str(rank), "--distributed-no-spawn", "--distributed-backend", "gloo",
            "--ddp-backend", "legacy_ddp"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env(), cwd=REPO))
    logs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        logs.append(out)
        assert proc.returncode == 0, out[-3000:]
    return save, logs


def model_tensors(save_dir):
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    return state, {k: v for k, v in state["model"].items()
                   if torch.is_tensor(v) and v.is_floating_point()}


def test_two_workers_equal_update_freq_two(data):
    accumulated = run_single(data, "uf2", update_freq=2)
    distributed, logs = run_two_processes(data, "ddp2")
    plain = run_single(data, "uf1", update_freq=1)

    assert "distributed init (rank 1)" in "".join(logs)
    state_acc, acc = model_tensors(accumulated)
    state_ddp, ddp = model_tensors(distributed)
    _, one = model_tensors(plain)
    assert state_acc["optimizer_history"][-1]["num_updates"] == 3
    assert state_ddp["optimizer_history"][-1]["num_updates"] == 3
    assert state_ddp["cfg"]["distributed_training"]["distributed_world_size"] == 2
    assert set(acc) == set(ddp)
    omegas = [k for k in acc if k.endswith("omega")]
    assert omegas  # trainable Admin omegas go through the gradient all-reduce too

    worst = max((acc[k] - ddp[k]).abs().max().item() for k in acc)
    assert worst < 1e-5, f"2 workers differ from update-freq 2 by {worst}"
    # Adam moves every weight by about lr per step: the check can see a different batch
    differs = max((acc[k] - one[k]).abs().max().item() for k in acc)
    assert differs > 1e-4
    moved = max((acc[k] - ddp[k]).abs().max().item() for k in omegas)
    omega_change = max((acc[k] - acc[k].mean()).abs().max().item() for k in omegas)
    assert moved < 1e-5 and omega_change > 0  # trained omegas agree, and they did train
