"""``make gpu-check``: what this package promises on a GPU, checked in one command of at most
six minutes, with one report (Markdown and JSON).

    python3 -m fairseq_admin_pos.cli.gpu_check --out gpu_check_out [--data DATA-BIN]

It runs with the Python it is started with (``python3``, the machine's own: no virtual
environment, nothing installed, no network). That Python needs a CUDA build of torch,
fairseq, sacrebleu and pytest, the repository checkout (tests/, examples/, benchmarks/) and
``bash``; anything missing, or no GPU, is named in one line (exit status 2) before anything
runs.

Steps, each with its own time limit inside the budget (``--budget``, 360 s):

1. data: ``--data`` (a binarized en-de set with a joined dictionary, e.g. ``make demo``'s
   ``demo_out/data-bin``); without it ``demo_out/data-bin`` when ``make demo`` made one, else
   a small synthetic en-de corpus binarized with ``fairseq-preprocess`` (``--synthetic``
   forces it; limit 45 s). The report says which;
2. at the same time (limit 120 s for the phase; the recipe runs train side by side as far as
   the GPU memory holds them, 20 GiB each: all three on an 80 GiB card):
   * the CUDA-only tests (pytest ``-m cuda``, the files that carry the marker);
   * ``examples/wmt14_en_de/train.sh SCHEME 18l_18l`` with ``PRECISION=fp16`` on one GPU for
     the paper's Admin (``admin``), the closed form (``admin-closed-form``) and Post-LN
     (``post-ln``), each trained for ``--train-seconds`` (40 s, fairseq's
     ``--stop-time-hours``), saved, then ``fairseq-generate`` on the test split and sacreBLEU
     against its references (a smoke run: with the recipe's 8000 warm-up updates nothing is
     learned in 40 s);
3. alone on the GPU: ``benchmarks/speed_vs_stock.py --data DATA --json PATH`` with the rest
   of the budget (about three minutes); its Markdown table and JSON go into the report.

The report (``report.md``, ``report.json`` under ``--out``, logs under ``--out/logs``) holds
the hardware, software versions, data, every step's command, status, time and limit, and
the figures. ``report.md`` starts with a level-2 heading so that it can be added to
``docs/gpu.md`` as it is. Exit status: 0 when every step passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
PROG = "gpu-check"

#: the three schemes of the recipe smoke runs (examples/wmt14_en_de/train.sh)
RECIPE_SCHEMES = ("admin", "admin-closed-form", "post-ln")
RECIPE_DEPTH = "18l_18l"
#: what the repository checkout must hold
REPO_FILES = ("tests/conftest.py", "examples/wmt14_en_de/train.sh",
              "benchmarks/speed_vs_stock.py")
REQUIRED_MODULES = ("fairseq", "sacrebleu", "pytest")

# limits (seconds) inside the budget; the benchmark gets what is left
DATA_LIMIT = 45
PHASE_LIMIT = 120
REPORT_MARGIN = 5


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


# -- environment ------------------------------------------------------------------------


def probe_environment() -> dict:
    """What this Python has: module versions or import errors, torch's CUDA build and
    devices, the repository files, bash."""
    info: Dict[str, object] = {
        "python": sys.executable, "python_version": platform.python_version(),
        "modules": {}, "import_errors": {}, "bash": shutil.which("bash"),
        "repo": str(REPO), "repo_missing": [f for f in REPO_FILES if not (REPO / f).exists()],
    }
    for name in ("torch",) + REQUIRED_MODULES:
        try:
            module = importlib.import_module(name)
            info["modules"][name] = str(getattr(module, "__version__", "?"))
        except Exception as e:  # noqa: BLE001  (any import failure means: not usable)
            info["modules"][name] = None
            info["import_errors"][name] = f"{type(e).__name__}: {e}"
    if info["modules"]["torch"] is not None:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = bool(torch.version.cuda) and torch.cuda.is_available()
        info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        if info["device_count"]:
            info["cudnn"] = torch.backends.cudnn.version()
            info["gpus"] = [_gpu(torch, i) for i in range(info["device_count"])]
    return info


def _gpu(torch, index: int) -> dict:
    p = torch.cuda.get_device_properties(index)
    return {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}"}


def environment_error(info: dict) -> Optional[str]:
    """The one line naming everything that stops the check, or None."""
    problems: List[str] = []
    modules, errors = info["modules"], info["import_errors"]
    torch_version = modules.get("torch")
    if torch_version is None:
        problems.append(f"torch is missing ({errors.get('torch')})")
    elif not info.get("torch_cuda"):
        problems.append(f"torch {torch_version} is a CPU-only build, so there is no GPU to "
                        "check (a CUDA build of torch is needed)")
    for name in REQUIRED_MODULES:
        if modules.get(name) is None:
            problems.append(f"{name} is missing ({errors.get(name)})")
    if not info.get("bash"):
        problems.append("bash is not on PATH (the recipes are bash scripts)")
    if info["repo_missing"]:
        problems.append(f"{', '.join(info['repo_missing'])} missing under {info['repo']} (run "
                        "gpu-check from a checkout of the repository)")
    if torch_version is not None and info.get("torch_cuda") and not info.get("device_count"):
        visible = info.get("cuda_visible_devices")
        problems.append(
            f"torch {torch_version} (CUDA {info['torch_cuda']}) sees no CUDA GPU "
            f"(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES="
            f"{'unset' if visible is None else repr(visible)})")
    if not problems:
        return None
    return (f"{PROG}: error: {info['python']}: " + "; ".join(problems) + ". gpu-check installs "
            "nothing: run it with a Python that has a CUDA build of torch, fairseq, sacrebleu "
            "and pytest, on a machine with a GPU")


# -- processes --------------------------------------------------------------------------


def run_process(cmd: Sequence[str], *, cwd: Path, env: dict, stdout: Path, timeout: float,
                stderr: Optional[Path] = None) -> dict:
    """Run ``cmd`` in its own process group with output to files; past ``timeout`` the
    whole group (train.sh, fairseq-train, tee) is stopped. Returns rc (None when timed
    out), seconds and the limit."""
    cmd = [str(c) for c in cmd]
    if _STOPPING.is_set():
        raise RuntimeError("gpu-check was interrupted")
    t0 = time.monotonic()
    with open(stdout, "w") as out, open(stderr or os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out,
                                stderr=err if stderr else subprocess.STDOUT,
                                start_new_session=True)
        _LIVE.add(proc)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
        except BaseException:  # Ctrl-C while waiting in the main thread
            _stop_group(proc)
            raise
        finally:
            _LIVE.discard(proc)
    return {"command": " ".join(cmd), "rc": rc, "seconds": round(time.monotonic() - t0, 1),
            "timeout": round(timeout, 1)}


#: processes running now (their own process groups, so Ctrl-C does not reach them: main
#: stops them itself)
_LIVE = set()
_STOPPING = threading.Event()


def stop_all() -> None:
    for proc in list(_LIVE):
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def child_env(**extra) -> dict:
    env = dict(os.environ)
    # the checkout first, so that the plugin is this repository's even when not installed
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    env.setdefault("OMP_NUM_THREADS", "4")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def tool_shims(folder: Path) -> Path:
    """``fairseq-train`` / ``-generate`` / ``-preprocess`` that run this Python's fairseq,
    for the recipes' ``FAIRSEQ_BIN`` (console scripts may be absent or another install's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in ("train", "generate", "preprocess", "interactive", "validate"):
        shim = folder / f"fairseq-{tool}"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fairseq_cli.{tool} "$@"\n')
        shim.chmod(0o755)
    return folder


def failure(step: dict, why: str, timed_out: bool = False) -> dict:
    step["status"] = "timeout" if timed_out else "failed"
    step["error"] = why
    return step


# -- data -------------------------------------------------------------------------------


def check_data(data: Path) -> Optional[str]:
    """None when ``data`` is a binarized en-de set with a joined dictionary, else why not."""
    need = ["dict.en.txt", "dict.de.txt"] + [f"{s}.en-de.{lang}.{ext}" for s in
                                             ("train", "valid", "test") for lang in ("en", "de")
                                             for ext in ("bin", "idx")]
    missing = [n for n in need if not (data / n).exists()]
    if missing:
        return (f"--data {data}: not a binarized en-de set ({', '.join(missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''} missing); make it with fairseq-preprocess "
                "--source-lang en --target-lang de --joined-dictionary, or leave --data out")
    if (data / "dict.en.txt").read_bytes() != (data / "dict.de.txt").read_bytes():
        return (f"--data {data}: dict.en.txt and dict.de.txt differ; the recipe shares all "
                "embeddings and needs fairseq-preprocess --joined-dictionary")
    return None


def write_synthetic_corpus(folder: Path, n_train=6000, n_valid=300, n_test=300, vocab=600,
                           seed=1) -> None:
    """A learnable en -> de toy task: every word has its own translation and each pair of
    neighbouring words swaps places (seeded; plain text, one sentence per line)."""
    rng = random.Random(seed)
    words = [f"e{i}" for i in range(vocab)]
    targets = [f"d{i}" for i in range(vocab)]
    rng.shuffle(targets)
    to_de = dict(zip(words, targets))
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        en, de = [], []
        for _ in range(n):
            sent = [rng.choice(words) for _ in range(rng.randint(4, 24))]
            out = [to_de[w] for w in sent]
            for i in range(0, len(out) - 1, 2):
                out[i], out[i + 1] = out[i + 1], out[i]
            en.append(" ".join(sent))
            de.append(" ".join(out))
        (folder / f"{split}.en").write_text("\n".join(en) + "\n")
        (folder / f"{split}.de").write_text("\n".join(de) + "\n")


def prepare_data(args, out: Path, logs: Path, limit: float) -> dict:
    """The data step: which binarized set the check uses (and making the synthetic one)."""
    step = {"name": "data", "status": "passed", "seconds": 0.0, "timeout": round(limit, 1)}
    if args.data is not None:
        step.update(path=str(args.data), source="given (--data)")
    else:
        demo = next((p for p in (Path("demo_out/data-bin"), REPO / "demo_out" / "data-bin")
                     if (p / ".done").exists()), None)
        if demo is not None and not args.synthetic:
            step.update(path=str(demo.resolve()), source="make demo's demo_out/data-bin")
        else:
            raw, dest = out / "data" / "raw", out / "data" / "data-bin"
            shutil.rmtree(out / "data", ignore_errors=True)
            write_synthetic_corpus(raw)
            result = run_process(
                [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "en",
                 "--target-lang", "de", "--trainpref", raw / "train", "--validpref",
                 raw / "valid", "--testpref", raw / "test", "--destdir", dest,
                 "--joined-dictionary", "--workers", "4"],
                cwd=out, env=child_env(), stdout=logs / "data-preprocess.log", timeout=limit)
            step.update(result, path=str(dest), source="synthetic en-de corpus (fairseq-preprocess)",
                        log=str(logs / "data-preprocess.log"))
            if result["rc"] != 0:
                return failure(step, "fairseq-preprocess failed" if result["rc"] is not None
                               else f"fairseq-preprocess did not finish within {limit:.0f} s",
                               timed_out=result["rc"] is None)
    why = check_data(Path(step["path"]))
    if why:
        return failure(step, why)
    step["sentences"] = {s: dataset_size(Path(step["path"]), s) for s in ("train", "valid", "test")}
    step["remove_bpe"] = bpe_kind(Path(step["path"]) / "dict.de.txt")
    return step


def dataset_size(data: Path, split: str) -> int:
    from fairseq.data import indexed_dataset

    return len(indexed_dataset.MMapIndexedDataset(str(data / f"{split}.en-de.de")))


def bpe_kind(dictionary: Path) -> Optional[str]:
    """fairseq-generate's ``--remove-bpe`` for the set's subwords: sentencepiece pieces
    (``\u2581``), subword-nmt (``@@``), or None (whole words)."""
    tokens = [line.split(" ", 1)[0] for line in dictionary.read_text(encoding="utf-8").splitlines()]
    if any(t.startswith("\u2581") for t in tokens):
        return "sentencepiece"
    if any(t.endswith("@@") for t in tokens):
        return "subword_nmt"
    return None


# -- steps ------------------------------------------------------------------------------


def cuda_test_files() -> List[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text(encoding="utf-8"))


def cuda_tests(logs: Path, timeout: float) -> dict:
    junit = logs / "cuda-tests.xml"
    # the full gpu-check test (marker gpu_check) would run this very command again
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
           "cuda and not gpu_check", "--junitxml", junit, *cuda_test_files()]
    if importlib.util.find_spec("xdist") is not None:  # optional: the files side by side
        cmd[3:3] = ["-n", "4", "--dist", "loadfile"]
    step = {"name": "CUDA tests", **run_process(cmd, cwd=REPO, env=child_env(),
                                                stdout=logs / "cuda-tests.log", timeout=timeout),
            "log": str(logs / "cuda-tests.log")}
    counts = junit_counts(junit)
    step["counts"] = counts
    if step["rc"] is None:
        return failure(step, f"pytest did not finish within {timeout:.0f} s", timed_out=True)
    if step["rc"] != 0 or counts is None or counts["failed"] or counts["errors"]:
        return failure(step, f"pytest exit status {step['rc']}")
    if counts["passed"] == 0:
        return failure(step, "no CUDA test ran")
    step["status"] = "passed"
    return step


def junit_counts(path: Path) -> Optional[dict]:
    if not path.exists():
        return None
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in
                                      ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors,
            "skipped": skipped}


#: GPU memory one 18L-18L fp16 recipe run at 4096 tokens may take (weights, fp32 master
#: copy, RAdam/Adam moments and activations, with room to spare)
GIB_PER_RECIPE_RUN = 20


def recipe_slots(gpus: Sequence[dict]) -> int:
    """How many recipe runs train at the same time: as many as the GPUs' memory holds (all
    three on an 80 GiB or larger card); the others wait for a free slot, inside the same
    phase limit."""
    slots = sum(max(1, int(g["memory_gib"] // GIB_PER_RECIPE_RUN)) for g in gpus)
    return max(1, min(len(RECIPE_SCHEMES), slots))


def recipe_env(data: Path, run_dir: Path, shims: Path, train_seconds: float, gpu: Optional[int],
               **overrides) -> dict:
    settings = {
        "DATA_BIN": data, "RUN_DIR": run_dir, "FAIRSEQ_BIN": shims, "PYTHON": sys.executable,
        "DEVICE": "gpu", "PRECISION": "fp16", "NUM_GPUS": 1,
        # one GPU x 4096 tokens x update-freq 1 (the recipe's 32768-token batch would take
        # update-freq 8 on one GPU: 8 times fewer updates in the same time)
        "MAX_TOKENS": 4096, "EFFECTIVE_BATCH": 4096, "LOG_INTERVAL": 10,
        "EXTRA_ARGS": f"--stop-time-hours {train_seconds / 3600:.6f} --no-epoch-checkpoints",
    }
    if gpu is not None:
        settings["CUDA_VISIBLE_DEVICES"] = gpu
    settings.update(overrides)
    env = child_env(**settings)
    for key in ("LAUNCHER", "NNODES", "GPUS_PER_NODE", "DATA_DIR", "RUNS_DIR", "ARCH",
                "KEEP_LAST_EPOCHS", "DRY_RUN", "ADMIN_INIT", "OPTIMIZER", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_NNODES", "NODE_RANK", "GEN_EXTRA_ARGS"):
        if key not in overrides:
            env.pop(key, None)
    return env


def parse_train_log(text: str) -> dict:
    updates = re.findall(r"num_updates[= ](\d+)", text)
    losses = re.findall(r"\| train(?:_inner)? \|.*?\bloss[= ]([0-9.]+)", text)
    return {"updates": int(updates[-1]) if updates else 0,
            "first_loss": float(losses[0]) if losses else None,
            "last_loss": float(losses[-1]) if losses else None,
            "stopped_by_time": "Stopping training due to cumulative_training_time" in text}


def recipe_run(scheme: str, data_step: dict, out: Path, logs: Path, shims: Path,
               train_seconds: float, deadline: float, gpu: Optional[int],
               keep_checkpoints: bool = False, **env_overrides) -> dict:
    """``train.sh SCHEME 18l_18l`` for ``train_seconds``, then fairseq-generate on the test
    split and sacreBLEU; every limit ends at ``deadline`` (time.monotonic())."""
    data = Path(data_step["path"])
    run_dir = out / "runs" / scheme
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run, never a resume
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    step = {"name": f"train.sh {scheme} {RECIPE_DEPTH}", "scheme": scheme,
            "train_seconds": train_seconds, "timeout": round(deadline - t0, 1), "gpu": gpu,
            "log": str(logs / f"{scheme}-train.log")}
    env = recipe_env(data, run_dir, shims, train_seconds, gpu, **env_overrides)
    # 20 s of the limit are kept for fairseq-generate
    train = run_process(["bash", REPO / "examples" / "wmt14_en_de" / "train.sh", scheme,
                         RECIPE_DEPTH], cwd=out, env=env, stdout=logs / f"{scheme}-train.log",
                        timeout=max(deadline - time.monotonic() - 20, 1))
    step["train"] = train
    step["seconds"] = round(time.monotonic() - t0, 1)
    log_text = (logs / f"{scheme}-train.log").read_text(errors="replace")
    step.update(parse_train_log(log_text))
    ckpt = run_dir / "checkpoint_last.pt"
    step["checkpoint_mib"] = round(ckpt.stat().st_size / 2**20) if ckpt.exists() else None
    if train["rc"] is None:
        return failure(step, f"train.sh did not finish within {train['timeout']:.0f} s",
                       timed_out=True)
    if train["rc"] != 0 or not ckpt.exists() or not step["updates"]:
        return failure(step, f"train.sh exit status {train['rc']}, {step['updates']} updates, "
                       f"checkpoint_last.pt {'saved' if ckpt.exists() else 'missing'}")
    gen_out = logs / f"{scheme}-generate.txt"
    cmd = [sys.executable, "-m", "fairseq_cli.generate", data, "--user-dir",
           REPO / "fairseq_admin_pos", "--path", ckpt, "--source-lang", "en", "--target-lang",
           "de", "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--batch-size", "128",
           # an untrained model never stops by itself: at most 1.2 x the source + 10 tokens
           "--max-len-a", "1.2", "--max-len-b", "10", "--required-batch-size-multiple", "1",
           "--num-workers", "0"]
    if data_step.get("remove_bpe"):
        cmd += ["--remove-bpe", data_step["remove_bpe"]]
    if env_overrides.get("DEVICE") == "cpu":
        cmd.append("--cpu")
    gen_env = child_env(**({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
    gen = run_process(cmd, cwd=out, env=gen_env, stdout=gen_out,
                      stderr=logs / f"{scheme}-generate.log",
                      timeout=max(deadline - time.monotonic(), 1))
    step["generate"] = {**gen, "output": str(gen_out)}
    step["seconds"] = round(time.monotonic() - t0, 1)
    if not keep_checkpoints:
        for path in run_dir.glob("*.pt"):
            path.unlink()
    if gen["rc"] != 0:
        return failure(step, "fairseq-generate did not finish within "
                       f"{gen['timeout']:.0f} s" if gen["rc"] is None
                       else f"fairseq-generate exit status {gen['rc']}",
                       timed_out=gen["rc"] is None)
    hyps, refs = generated_pairs(gen_out.read_text(encoding="utf-8", errors="replace"))
    step["translated"] = len(hyps)
    expected = data_step["sentences"]["test"]
    if len(hyps) != expected:
        return failure(step, f"fairseq-generate translated {len(hyps)} of {expected} sentences")
    import sacrebleu

    metric = sacrebleu.metrics.BLEU()
    step["bleu"] = round(metric.corpus_score(hyps, [refs]).score, 2)
    step["bleu_signature"] = str(metric.get_signature())
    step["status"] = "passed"
    return step


def generated_pairs(text: str):
    """Detokenized hypotheses (``D-``) and references (``T-``) in sentence order."""
    hyps, refs = {}, {}
    for line in text.splitlines():
        if line.startswith(("D-", "T-")):
            fields = line.split("\t")
            target = hyps if line[0] == "D" else refs
            target[int(fields[0][2:])] = fields[-1] if len(fields) > 1 else ""
    ids = sorted(hyps)
    return [hyps[i] for i in ids], [refs.get(i, "") for i in ids]


def benchmark(data: Path, out: Path, logs: Path, timeout: float,
              script: Path = REPO / "benchmarks" / "speed_vs_stock.py") -> dict:
    table, json_path = out / "speed.md", out / "speed.json"
    for path in (table, json_path):
        path.unlink(missing_ok=True)
    step = {"name": "speed benchmark", "log": str(logs / "speed.log"),
            **run_process([sys.executable, script, "--data", data, "--json", json_path],
                          cwd=REPO, env=child_env(), stdout=table, stderr=logs / "speed.log",
                          timeout=timeout)}
    step["table"] = table.read_text(errors="replace").strip() if table.exists() else ""
    if step["rc"] is None:
        return failure(step, f"the benchmark did not finish within {timeout:.0f} s",
                       timed_out=True)
    if step["rc"] != 0:
        return failure(step, f"the benchmark's exit status {step['rc']}")
    try:
        step["json"] = json.loads(json_path.read_text())
    except (OSError, ValueError) as e:
        return failure(step, f"the benchmark wrote no readable JSON to {json_path} ({e})")
    step["status"] = "passed"
    return step


# -- report -----------------------------------------------------------------------------


def environment_summary(info: dict) -> dict:
    summary = {k: info.get(k) for k in ("python", "python_version", "torch_cuda", "cudnn",
                                          "gpus", "cuda_visible_devices")}
    summary.update({name: info["modules"].get(name) for name in ("torch",) + REQUIRED_MODULES})
    from fairseq_admin_pos import __version__

    summary["package"] = __version__
    try:
        summary["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        summary["commit"] = None
    summary["host_cpus"] = os.cpu_count()
    return summary


def _gpus(env: dict) -> str:
    gpus = env.get("gpus") or []
    if not gpus:
        return "none"
    names = sorted({g["name"] for g in gpus})
    g = gpus[0]
    return f"{len(gpus)} x {', '.join(names)} ({g['memory_gib']} GiB, compute {g['capability']})"


def _limit(step: dict) -> str:
    return f"{step.get('seconds', 0):.0f} s ({step.get('timeout', 0):.0f} s)"


def _result(step: dict) -> str:
    if step.get("error"):
        return step["error"]
    if "counts" in step and step["counts"]:
        c = step["counts"]
        return f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped"
    if "bleu" in step:
        return (f"{step['updates']} updates, loss {step['first_loss']} -> {step['last_loss']}, "
                f"{step['translated']} sentences, sacreBLEU {step['bleu']:.2f}")
    if step["name"] == "data":
        s = step.get("sentences", {})
        return f"{step['source']}: {s.get('train')} / {s.get('valid')} / {s.get('test')} pairs"
    if "json" in step:
        return "Markdown table and JSON below"
    return "done"


def markdown(report: dict) -> str:
    env, steps = report["environment"], report["steps"]
    verdict = "passed" if report["passed"] else "FAILED"
    gpu = (env.get("gpus") or [{"name": "no GPU"}])[0]["name"]
    lines = [
        f"## {report['started'][:16].replace('T', ' ')} UTC, {gpu}: gpu-check {verdict}", "",
        "| | |", "|---|---|",
        f"| GPU | {_gpus(env)} |",
        f"| torch / CUDA / cuDNN | {env.get('torch')} / {env.get('torch_cuda')} / {env.get('cudnn')} |",
        f"| Python | {env.get('python_version')} ({env.get('python')}) |",
        f"| fairseq / sacrebleu / pytest | {env.get('fairseq')} / {env.get('sacrebleu')} / "
        f"{env.get('pytest')} |",
        f"| fairseq-admin-pos | {env.get('package')}, commit {env.get('commit') or 'unknown'} |",
        f"| data | {report['data']} |",
        f"| time | {report['seconds']:.0f} s of a {report['budget_seconds']:.0f} s budget |",
        "", "| step | status | time (limit) | result |", "|---|---|---|---|",
    ]
    lines += [f"| {s['name']} | {s['status']} | {_limit(s)} | {_result(s)} |" for s in steps]
    recipes = [s for s in steps if "scheme" in s]
    if recipes:
        lines += ["", f"Recipe smoke runs: `examples/wmt14_en_de/train.sh SCHEME {RECIPE_DEPTH}`"
                  f" with `PRECISION=fp16`, one GPU x 4096 tokens, "
                  f"{recipes[0]['train_seconds']:.0f} s of training each "
                  f"(`--stop-time-hours`), {report.get('recipe_slots', 3)} at a time on the "
                  "GPU(s) and next to the CUDA tests, then `fairseq-generate` "
                  "(beam 4) on the test split and sacreBLEU against its references:", "",
                  "| scheme | updates | train loss first -> last | checkpoint | translated | "
                  "sacreBLEU |", "|---|---|---|---|---|---|"]
        for s in recipes:
            ck = f"{s['checkpoint_mib']} MiB" if s.get("checkpoint_mib") else "none"
            lines.append(f"| {s['scheme']} | {s.get('updates')} | {s.get('first_loss')} -> "
                         f"{s.get('last_loss')} | {ck} | {s.get('translated', '-')} | "
                         f"{s['bleu']:.2f} |" if "bleu" in s else
                         f"| {s['scheme']} | {s.get('updates')} | {s.get('first_loss')} -> "
                         f"{s.get('last_loss')} | {ck} | {s.get('translated', '-')} | - |")
    bench = next((s for s in steps if s["name"] == "speed benchmark"), None)
    if bench is not None:
        lines += ["", "Speed (`benchmarks/speed_vs_stock.py --data DATA`, alone on the GPU):", ""]
        lines += [bench["table"] or "(no table printed)"]
    failed = [s for s in steps if s["status"] != "passed"]
    if failed:
        lines += ["", "Failures:", ""]
        for s in failed:
            lines.append(f"* {s['name']}: {s.get('error')} (log: `{s.get('log', '-')}`)")
            tail = _tail(s.get("log"))
            if tail:
                lines += ["", "  ```text", *["  " + t for t in tail], "  ```"]
    return "\n".join(lines) + "\n"


def _tail(path: Optional[str], n: int = 12) -> List[str]:
    if not path or not Path(path).exists():
        return []
    return Path(path).read_text(errors="replace").splitlines()[-n:]


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


# -- main -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"),
                   help="report folder (default gpu_check_out); its runs/ and logs/ are replaced")
    p.add_argument("--data", type=Path, default=None,
                   help="binarized en-de data with a joined dictionary (default: "
                   "demo_out/data-bin when make demo made it, else a synthetic set)")
    p.add_argument("--synthetic", action="store_true",
                   help="use the synthetic set even when demo_out/data-bin exists")
    p.add_argument("--budget", type=float, default=360.0,
                   help="seconds for the whole check (default 360)")
    p.add_argument("--train-seconds", type=float, default=40.0,
                   help="training time of each recipe run (default 40)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep the recipe runs' checkpoints (about 1.6 GB each)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start, started = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
    deadline = start + args.budget
    if args.data is not None:
        args.data = args.data.resolve()
    info = probe_environment()
    error = environment_error(info)
    if error:
        print(error, file=sys.stderr, flush=True)
        return 2
    out = args.out.resolve()
    logs = out / "logs"
    for folder in (logs, out / "runs", out / "bin"):
        shutil.rmtree(folder, ignore_errors=True)
    logs.mkdir(parents=True)
    shims = tool_shims(out / "bin")
    env = environment_summary(info)
    say(f"{_gpus(env)}; torch {env['torch']} (CUDA {env['torch_cuda']}); report in {out}")

    steps = [prepare_data(args, out, logs, min(DATA_LIMIT, deadline - time.monotonic()))]
    data_step = steps[0]
    say(f"data: {data_step.get('source')} {data_step.get('path')} ({data_step['status']})")
    if data_step["status"] == "passed":
        phase_end = time.monotonic() + min(PHASE_LIMIT, deadline - time.monotonic() - 60)
        n_gpus = info["device_count"]
        slots = recipe_slots(info.get("gpus") or [])
        pools = [concurrent.futures.ThreadPoolExecutor(1),
                 concurrent.futures.ThreadPoolExecutor(slots)]
        try:
            tests = pools[0].submit(cuda_tests, logs, phase_end - time.monotonic())
            runs = [pools[1].submit(recipe_run, scheme, data_step, out, logs, shims,
                                    args.train_seconds, phase_end, i % n_gpus,
                                    args.keep_checkpoints)
                    for i, scheme in enumerate(RECIPE_SCHEMES)]
            steps.append(tests.result())
            steps += [r.result() for r in runs]
        except KeyboardInterrupt:
            # the children run in their own sessions: Ctrl-C reached only this process
            _STOPPING.set()
            stop_all()
            raise
        finally:
            for pool in pools:
                pool.shutdown(wait=True, cancel_futures=True)
        for s in steps[1:]:
            say(f"{s['name']}: {s['status']} in {s.get('seconds', 0):.0f} s ({_result(s)})")
        steps.append(benchmark(Path(data_step["path"]), out, logs,
                               deadline - time.monotonic() - REPORT_MARGIN))
        say(f"speed benchmark: {steps[-1]['status']} in {steps[-1]['seconds']:.0f} s")
    report = {
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - start, 1), "budget_seconds": args.budget,
        "passed": all(s["status"] == "passed" for s in steps) and len(steps) > 1,
        "environment": env,
        "data": f"{data_step.get('source')}: {data_step.get('path')}",
        "recipe_slots": recipe_slots(info.get("gpus") or []),
        "steps": steps,
    }
    write_report(out, report)
    say(f"{'passed' if report['passed'] else 'FAILED'} in {report['seconds']:.0f} s: "
        f"{out / 'report.md'}, {out / 'report.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
