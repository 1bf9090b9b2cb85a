"""``make gpu-check`` (fairseq_admin_pos/cli/gpu_check.py): the one-line refusals where it
cannot run (no GPU here; a module missing), the report it writes from its steps' results,
a step that fails or overruns, the recipe step's plumbing on the CPU (train.sh, fairseq-train
stopped by time, fairseq-generate, sacreBLEU) and, where CUDA is, the whole check."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sacrebleu
import torch

from fairseq_admin_pos.cli import gpu_check
from fairseq_cli_utils import REPO, env, preprocess

ADVICE = ("gpu-check installs nothing: run it with a Python that has a CUDA build of torch, "
          "fairseq, sacrebleu and pytest, on a machine with a GPU")
CPU_ONLY = (f"torch {torch.__version__} is a CPU-only build, so there is no GPU to check (a "
            "CUDA build of torch is needed)")


def gpu_check_cli(args, extra_env=None, timeout=300):
    e = env()
    e.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "fairseq_admin_pos.cli.gpu_check", *map(str, args)],
                          cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_no_gpu_is_one_line_and_nothing_runs(tmp_path):
    proc = gpu_check_cli(["--out", tmp_path / "out"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu-check: error: {sys.executable}: {CPU_ONLY}. {ADVICE}"]
    assert proc.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_missing_modules_are_named_in_the_same_line(tmp_path):
    """fairseq and sacrebleu made unimportable (packages on PYTHONPATH that fail to import,
    found before the installed ones): named with their import errors, after the CPU torch."""
    hide = tmp_path / "hide"
    (hide / "fairseq").mkdir(parents=True)
    (hide / "fairseq" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    (hide / "sacrebleu.py").write_text("raise ImportError('hidden by the test')\n")
    proc = gpu_check_cli(["--out", tmp_path / "out"],
                         {"PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu-check: error: {sys.executable}: {CPU_ONLY}; "
        "fairseq is missing (ImportError: hidden by the test); "
        f"sacrebleu is missing (ImportError: hidden by the test). {ADVICE}"]
    assert not (tmp_path / "out").exists()


def probe(**changes):
    info = {"python": "/usr/bin/python3", "modules": {"torch": "2.11.0+cu130", "fairseq": "0.12.3",
                                                       "sacrebleu": "2.6.0", "pytest": "9.0"},
            "import_errors": {}, "bash": "/bin/bash", "repo": "/repo", "repo_missing": [],
            "torch_cuda": "13.0", "device_count": 1, "cuda_visible_devices": None}
    info.update(changes)
    return info


@pytest.mark.parametrize("changes,problem", [
    ({}, None),
    ({"device_count": 0, "cuda_visible_devices": ""},
     "torch 2.11.0+cu130 (CUDA 13.0) sees no CUDA GPU (torch.cuda.is_available() is False; "
     "CUDA_VISIBLE_DEVICES='')"),
    ({"modules": {"torch": None, "fairseq": "0.12.3", "sacrebleu": "2.6.0", "pytest": None},
      "import_errors": {"torch": "ModuleNotFoundError: No module named 'torch'",
                        "pytest": "ModuleNotFoundError: No module named 'pytest'"}},
     "torch is missing (ModuleNotFoundError: No module named 'torch'); pytest is missing "
     "(ModuleNotFoundError: No module named 'pytest')"),
    ({"bash": None, "repo_missing": ["benchmarks/speed_vs_stock.py"]},
     "bash is not on PATH (the recipes are bash scripts); benchmarks/speed_vs_stock.py missing "
     "under /repo (run gpu-check from a checkout of the repository)"),
])
def test_environment_error(changes, problem):
    line = gpu_check.environment_error(probe(**changes))
    assert line == (None if problem is None else
                    f"gpu-check: error: /usr/bin/python3: {problem}. {ADVICE}")


def test_probe_sees_this_python():
    info = gpu_check.probe_environment()
    assert info["python"] == sys.executable
    assert info["modules"]["torch"] == torch.__version__
    assert info["modules"]["sacrebleu"] == sacrebleu.__version__
    assert info["torch_cuda"] == torch.version.cuda
    assert info["device_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert info["repo_missing"] == []


def _report():
    recipes = [{"name": f"train.sh {s} 18l_18l", "scheme": s, "status": "passed", "seconds": 71.0,
                "timeout": 100.0, "train_seconds": 40.0, "updates": u, "first_loss": 14.5,
                "last_loss": loss, "checkpoint_mib": 1650, "translated": 1000, "bleu": b,
                "log": "logs/x.log"}
               for s, u, loss, b in (("admin", 120, 12.25, 0.31), ("admin-paper", 131,
                                                                    11.9, 0.4),
                                     ("post-ln", 140, 12.0, 0.12))]
    recipes[2].update(status="timeout", error="train.sh did not finish within 100 s")
    recipes[2].pop("bleu")
    return {
        "started": "2026-12-04T18:00:00+00:00", "seconds": 351.0, "budget_seconds": 360.0,
        "passed": False, "data": "make demo's demo_out/data-bin: /x/demo_out/data-bin",
        "recipe_slots": 3,
        "environment": {"python": "/usr/bin/python3", "python_version": "3.12.3",
                        "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cudnn": 91002,
                        "fairseq": "0.12.3", "sacrebleu": "2.6.0", "pytest": "9.0",
                        "package": "0.1.0", "commit": "abc1234",
                        "gpus": [{"name": "NVIDIA H200", "memory_gib": 139.8,
                                  "capability": "9.0"}]},
        "steps": [
            {"name": "data", "status": "passed", "seconds": 0.0, "timeout": 45.0,
             "source": "make demo's demo_out/data-bin",
             "sentences": {"train": 29000, "valid": 1014, "test": 1000}},
            {"name": "CUDA tests", "status": "passed", "seconds": 52.3, "timeout": 120.0,
             "counts": {"passed": 17, "failed": 0, "errors": 0, "skipped": 0}},
            *recipes,
            {"name": "speed benchmark", "status": "passed", "seconds": 185.0, "timeout": 190.0,
             "table": "| run | stock | admin |\n|---|---|---|\n| 6L-6L fp16 | 44,551 | 49,318 |",
             "json": {"rows": 1}},
        ],
    }


def test_report_markdown_and_json(tmp_path):
    report = _report()
    gpu_check.write_report(tmp_path, report)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    md = (tmp_path / "report.md").read_text()
    lines = md.splitlines()
    assert lines[0] == "## 2026-12-04 18:00 UTC, NVIDIA H200: gpu-check FAILED"
    for row in [
        "| GPU | 1 x NVIDIA H200 (139.8 GiB, compute 9.0) |",
        "| torch / CUDA / cuDNN | 2.11.0+cu130 / 13.0 / 91002 |",
        "| Python | 3.12.3 (/usr/bin/python3) |",
        "| fairseq-admin-pos | 0.1.0, commit abc1234 |",
        "| time | 351 s of a 360 s budget |",
        "| data | passed | 0 s (45 s) | make demo's demo_out/data-bin: 29000 / 1014 / 1000 pairs |",
        "| CUDA tests | passed | 52 s (120 s) | 17 passed, 0 failed, 0 errors, 0 skipped |",
        "| train.sh admin 18l_18l | passed | 71 s (100 s) | 120 updates, loss 14.5 -> 12.25, "
        "1000 sentences, sacreBLEU 0.31 |",
        "| train.sh post-ln 18l_18l | timeout | 71 s (100 s) | train.sh did not finish within "
        "100 s |",
        "| speed benchmark | passed | 185 s (190 s) | Markdown table and JSON below |",
        "| admin-paper | 131 | 14.5 -> 11.9 | 1650 MiB | 1000 | 0.40 |",
        "| post-ln | 140 | 14.5 -> 12.0 | 1650 MiB | 1000 | - |",
        "| 6L-6L fp16 | 44,551 | 49,318 |",
        "* train.sh post-ln 18l_18l: train.sh did not finish within 100 s (log: `logs/x.log`)",
    ]:
        assert row in lines, row
    assert "40 s of training each (`--stop-time-hours`), 3 at a time on the GPU(s)" in md


@pytest.mark.parametrize("memories,slots", [([139.8], 3), ([79.6], 3), ([40.0], 2), ([16.0], 1),
                                            ([24.0, 24.0], 2), ([11.0] * 8, 3)])
def test_recipe_runs_side_by_side_as_far_as_memory_holds(memories, slots):
    assert gpu_check.recipe_slots([{"memory_gib": m} for m in memories]) == slots


def test_recipes_run_beside_the_tests_spread_over_the_gpus(monkeypatch, tmp_path):
    """The CUDA tests' step first, then one step per recipe scheme in order, run i on GPU
    i mod the GPU count, at most recipe_slots() at once, each given the same phase end."""
    import threading

    running, peak, lock = [0], [0], threading.Lock()

    def fake_run(scheme, data_step, out, logs, shims, seconds, phase_end, gpu, keep):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)  # long enough for the pool's other worker to start
        with lock:
            running[0] -= 1
        return {"name": scheme, "gpu": gpu, "phase_end": phase_end, "seconds": seconds}

    monkeypatch.setattr(gpu_check, "cuda_tests", lambda logs, limit: {"name": "cuda tests"})
    monkeypatch.setattr(gpu_check, "recipe_run", fake_run)
    args = type("Args", (), {"train_seconds": 40.0, "keep_checkpoints": False})()
    info = {"device_count": 2, "gpus": [{"memory_gib": 16.0}] * 2}
    steps = gpu_check.tests_and_recipes(args, info, {}, tmp_path, tmp_path, tmp_path, 123.0)
    assert [s["name"] for s in steps] == ["cuda tests", *gpu_check.RECIPE_SCHEMES]
    assert [s["gpu"] for s in steps[1:]] == [i % 2 for i in range(len(gpu_check.RECIPE_SCHEMES))]
    assert {(s["phase_end"], s["seconds"]) for s in steps[1:]} == {(123.0, 40.0)}
    assert peak[0] == gpu_check.recipe_slots(info["gpus"]) == 2


FAKE_BENCH = {
    "ok": "import sys, json\nargs = sys.argv[1:]\n"
          "json.dump({'data': args[args.index('--data') + 1]}, open(args[args.index('--json') + 1], 'w'))\n"
          "print('| run | words/s |')\nprint('|---|---|')\nprint('| a | 1 |')\n",
    "fails": "import sys\nprint('| partial |')\nsys.exit(3)\n",
    "slow": "import time\nprint('| started |', flush=True)\ntime.sleep(60)\n",
    "no-json": "print('| run |')\n",
}


@pytest.mark.parametrize("kind,status,error", [
    ("ok", "passed", None),
    ("fails", "failed", "the benchmark's exit status 3"),
    ("slow", "timeout", "the benchmark did not finish within 3 s"),
    ("no-json", "failed", "the benchmark wrote no readable JSON"),
])
def test_benchmark_step(tmp_path, kind, status, error):
    """The benchmark's contract (``--data``, ``--json PATH``, a Markdown table on stdout):
    its table and JSON are kept; a failure or an overrun is the step's status."""
    script = tmp_path / "bench.py"
    script.write_text(FAKE_BENCH[kind])
    (tmp_path / "logs").mkdir()
    t0 = time.monotonic()
    step = gpu_check.benchmark(tmp_path / "data", tmp_path, tmp_path / "logs", 3, script=script)
    assert time.monotonic() - t0 < 30
    assert step["status"] == status
    assert (step.get("error") or "").startswith(error or "")
    if kind == "ok":
        assert step["json"] == {"data": str(tmp_path / "data")}
        assert step["table"] == "| run | words/s |\n|---|---|\n| a | 1 |"
    if kind == "slow":
        assert step["table"] == "| started |" and step["rc"] is None


@pytest.mark.slow
def test_recipe_step_on_the_cpu(tmp_path):
    """The recipe step's own plumbing, run for real on the CPU with a tiny model (train.sh's
    DEVICE/PRECISION/ARCH settings): fairseq-train through the tool shims, stopped by
    --stop-time-hours, saved, fairseq-generate on the whole test split, sacreBLEU recomputed
    here from the generate output."""
    raw = tmp_path / "raw"
    gpu_check.write_synthetic_corpus(raw, n_train=200, n_valid=10, n_test=12, vocab=30)
    data = preprocess_en_de(raw, tmp_path / "bin")
    out, logs = tmp_path / "out", tmp_path / "out" / "logs"
    logs.mkdir(parents=True)
    shims = gpu_check.tool_shims(out / "bin")
    args = type("Args", (), {"data": data, "synthetic": False})()
    data_step = gpu_check.prepare_data(args, out, logs, 45)
    assert data_step["status"] == "passed"
    assert data_step["sentences"] == {"train": 200, "valid": 10, "test": 12}
    step = gpu_check.recipe_run(
        "admin", data_step, out, logs, shims, 2, time.monotonic() + 240, None,
        DEVICE="cpu", PRECISION="fp32", ARCH="admin_transformer_tiny")
    assert step["status"] == "passed", (step, (logs / "admin-train.log").read_text()[-3000:])
    assert step["stopped_by_time"] and step["updates"] >= 1 and step["checkpoint_mib"] >= 1
    assert step["translated"] == 12
    assert not list((out / "runs" / "admin").glob("*.pt"))  # removed after decoding
    hyps, refs = gpu_check.generated_pairs((logs / "admin-generate.txt").read_text())
    assert refs == (raw / "test.de").read_text().splitlines()  # no subwords: the raw targets
    assert step["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    train_log = (logs / "admin-train.log").read_text()
    assert "--admin-init closed-form --admin-omega parameter" in train_log
    assert "--stop-time-hours 0.000556" in train_log


def preprocess_en_de(raw: Path, dest: Path) -> Path:
    from fairseq_cli_utils import run

    run("fairseq_cli.preprocess", [
        "--source-lang", "en", "--target-lang", "de", "--trainpref", raw / "train",
        "--validpref", raw / "valid", "--testpref", raw / "test", "--destdir", dest,
        "--joined-dictionary", "--workers", "1"])
    return dest


def test_refuses_data_that_is_not_an_en_de_set(tiny_data, tmp_path):
    assert gpu_check.check_data(tiny_data).startswith(
        f"--data {tiny_data}: not a binarized en-de set (dict.en.txt, dict.de.txt, "
        "train.en-de.en.bin, train.en-de.en.idx ... missing)")


def test_bpe_kind(tmp_path):
    for tokens, kind in ((["\u2581Ein", "Mann"], "sentencepiece"), (["Ein@@", "mann"], "subword_nmt"),
                         (["d1", "d2"], None)):
        path = tmp_path / "dict.txt"
        path.write_text("".join(f"{t} 1\n" for t in tokens), encoding="utf-8")
        assert gpu_check.bpe_kind(path) == kind


def test_cuda_test_files_are_the_marked_ones():
    files = gpu_check.cuda_test_files()
    for name in ("tests/test_admin.py", "tests/test_positional.py", "tests/test_host_sync.py",
                 "tests/test_demo_device.py", "tests/test_gpu_check.py"):
        assert name in files
    assert "tests/test_cli.py" not in files


@pytest.mark.cuda
@pytest.mark.gpu_check
@pytest.mark.slow
def test_gpu_check_passes_on_this_gpu(tmp_path):
    """The whole check as ``make gpu-check`` runs it (about six minutes)."""
    t0 = time.monotonic()
    proc = gpu_check_cli(["--out", tmp_path / "out"], timeout=480)
    took = time.monotonic() - t0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text()
    assert proc.returncode == 0, md
    assert report["passed"] and took < 380
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["CUDA tests"]["counts"]["passed"] >= 16
    assert steps["CUDA tests"]["counts"]["failed"] == 0
    for scheme in gpu_check.RECIPE_SCHEMES:
        s = steps[f"train.sh {scheme} 18l_18l"]
        assert s["updates"] > 0 and s["translated"] == steps["data"]["sentences"]["test"]
    assert steps["speed benchmark"]["json"] and steps["speed benchmark"]["table"] in md
