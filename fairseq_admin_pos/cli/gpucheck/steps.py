"""What ``make gpu-check`` runs, one function per step, each returning the step's record (a
dict: name, status, command, seconds and limit, log, figures, error): the data
(:func:`prepare_data`: ``--data``, ``make demo``'s set or a synthetic one), the CUDA tests
(:func:`cuda_tests`), the recipe smoke runs (:func:`recipe_run`: ``train.sh``,
``fairseq-generate``, sacreBLEU) and the speed benchmark (:func:`benchmark`). Standard
library only at import (fairseq and sacrebleu when a step needs them)."""
from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from .environment import REPO
from .processes import child_env, run_process

#: the three schemes of the recipe smoke runs (examples/wmt14_en_de/train.sh)
RECIPE_SCHEMES = ("admin-paper", "admin", "post-ln")
RECIPE_DEPTH = "18l_18l"


def failure(step: dict, why: str, timed_out: bool = False) -> dict:
    """``step`` marked failed (or timed out) with the reason."""
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


# -- CUDA tests, recipe runs, benchmark ----------------------------------------------


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
    gen = generate_test(data_step, ckpt, out, gen_out, logs / f"{scheme}-generate.log", gpu,
                        deadline, cpu=env_overrides.get("DEVICE") == "cpu")
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


def generate_test(data_step: dict, ckpt: Path, out: Path, gen_out: Path, gen_log: Path,
                  gpu: Optional[int], deadline: float, cpu: bool) -> dict:
    """fairseq-generate of ``ckpt`` on the test split into ``gen_out`` (beam 4, lenpen 0.6,
    until ``deadline``); returns :func:`run_process`'s record."""
    cmd = [sys.executable, "-m", "fairseq_cli.generate", data_step["path"], "--user-dir",
           REPO / "fairseq_admin_pos", "--path", ckpt, "--source-lang", "en", "--target-lang",
           "de", "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--batch-size", "128",
           # an untrained model never stops by itself: at most 1.2 x the source + 10 tokens
           "--max-len-a", "1.2", "--max-len-b", "10", "--required-batch-size-multiple", "1",
           "--num-workers", "0"]
    if data_step.get("remove_bpe"):
        cmd += ["--remove-bpe", data_step["remove_bpe"]]
    if cpu:
        cmd.append("--cpu")
    gen_env = child_env(**({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
    return run_process(cmd, cwd=out, env=gen_env, stdout=gen_out, stderr=gen_log,
                       timeout=max(deadline - time.monotonic(), 1))


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
