"""``make demo``'s ``--device auto|cpu|cuda`` (fairseq_admin_pos/cli/demo.py): the CPU
commands are the ones the demo always ran, ``auto`` takes the GPU only when torch sees one,
``cuda`` without one is one line before anything is made; the GPU run itself is a test that
skips without CUDA."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fairseq_admin_pos.cli import demo
from fairseq_cli_utils import REPO, env, write_fake_multi30k

VENV_BIN = Path(sys.executable).parent
PKG = str(REPO / "fairseq_admin_pos")

# the demo's fairseq-train command with the defaults, as the demo ran it before --device
# existed (commit ab4150f); the CPU run must stay exactly this
CPU_TRAIN_ARGV = [
    str(VENV_BIN / "fairseq-train"), "DATA", "--user-dir", PKG, "--arch", "admin_transformer",
    "--cpu", "--seed", "1", "--encoder-layers", "12", "--decoder-layers", "3",
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--admin-init", "closed-form", "--admin-omega", "parameter", "--share-all-embeddings",
    "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
    "--clip-norm", "0.0", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "400", "--warmup-init-lr", "1e-07",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "4096", "--max-update", "700", "--save-dir", "SAVE",
    "--no-epoch-checkpoints", "--save-interval-updates", "200", "--keep-interval-updates", "1",
    "--log-format", "simple", "--log-interval", "20", "--no-progress-bar", "--num-workers", "0",
]
CPU_GENERATE_ARGV = [
    str(VENV_BIN / "fairseq-generate"), "DATA", "--user-dir", PKG, "--path", "CKPT",
    "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--batch-size", "64",
    "--max-len-a", "1.2", "--max-len-b", "10", "--remove-bpe", "sentencepiece", "--cpu",
    "--num-workers", "0",
]


def demo_args(*extra):
    return demo.build_parser().parse_args(["--data", "m30k", "--out", "out", *extra])


def strs(cmd):
    return [str(c) for c in cmd]


def test_cpu_commands_are_unchanged():
    args = demo_args()
    assert args.device == "auto"
    assert strs(demo.train_command(args, Path("DATA"), Path("SAVE"), "cpu")) == CPU_TRAIN_ARGV
    assert strs(demo.generate_command(Path("DATA"), Path("CKPT"), "cpu")) == CPU_GENERATE_ARGV


def test_gpu_commands_differ_only_in_the_device_flags():
    args = demo_args("--device", "cuda")
    gpu = strs(demo.train_command(args, Path("DATA"), Path("SAVE"), "cuda"))
    i = CPU_TRAIN_ARGV.index("--cpu")
    # one GPU: the CPU recipe's batch per update, not data-parallel over every visible GPU
    assert gpu == CPU_TRAIN_ARGV[:i] + ["--distributed-world-size", "1"] + CPU_TRAIN_ARGV[i + 1:]
    assert strs(demo.generate_command(Path("DATA"), Path("CKPT"), "cuda")) == \
        [a for a in CPU_GENERATE_ARGV if a != "--cpu"]


@pytest.mark.parametrize("choice,has_cuda,expected", [
    ("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cpu", False, "cpu"),
    ("cuda", True, "cuda"),
])
def test_device_choice(choice, has_cuda, expected):
    assert demo.resolve_device(choice, has_cuda=lambda: has_cuda) == expected


def test_auto_is_this_machines_device():
    assert demo.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_cuda_without_a_gpu_is_one_line_before_anything(tmp_path):
    write_fake_multi30k(tmp_path / "m30k")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_admin_pos.cli.demo", "--data", str(tmp_path / "m30k"),
         "--out", str(out), "--device", "cuda"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"[demo] --device cuda: torch {torch.__version__} in {sys.executable} sees no CUDA GPU "
        "(torch.cuda.is_available() is False); use --device cpu, or --device auto (the "
        "default), which takes the GPU when there is one"]
    assert proc.stdout == "" and not out.exists()


def test_results_record_the_device_name_on_the_cpu():
    name = demo.device_name("cpu")
    assert name.endswith("cores)") and len(name) > len(" (2 cores)")


@pytest.mark.cuda
def test_demo_trains_and_translates_on_the_gpu_by_default(tmp_path):
    """``--device`` left at auto on a CUDA machine: fairseq-train and fairseq-generate run
    without --cpu, fairseq sees the GPU, and results.json says so."""
    pytest.importorskip("sentencepiece")  # the demo's own dependency (a GPU machine may lack it)
    write_fake_multi30k(tmp_path / "m30k")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_admin_pos.cli.demo", "--data", str(tmp_path / "m30k"),
         "--out", str(out), "--encoder-layers", "3", "--decoder-layers", "1", "--dim", "32",
         "--vocab", "60", "--max-update", "6", "--max-tokens", "600", "--warmup", "2",
         "--save-interval-updates", "3"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    commands = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    # the console script, or python -m fairseq_cli.train where fairseq has none on PATH
    fairseq = [c for c in commands if "fairseq-" in c or "fairseq_cli." in c]
    assert any("fairseq-train" in c or "fairseq_cli.train" in c for c in fairseq)
    assert all("--cpu" not in c.split() for c in fairseq)
    run = out / "admin-3L-1L"
    res = json.loads((run / "results.json").read_text())
    assert res["device"] == "cuda"
    assert res["device_name"] == torch.cuda.get_device_name(0)
    # fairseq's own report of the device it trained on
    assert "CUDA enviroments for all 1 workers" in (run / "train.log").read_text()
    assert res["test_sentences"] == 20
