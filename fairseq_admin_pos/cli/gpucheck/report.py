"""The report of ``make gpu-check``: ``report.md`` (starting with a level-2 heading, so that
it can be added to ``docs/gpu.md`` as it is: the hardware and software, one row per step,
the recipe runs' figures, the speed table, the failures with the tails of their logs) and
``report.json`` (the same record in full), written by :func:`write_report`. Standard
library only."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from .steps import RECIPE_DEPTH


def gpu_line(env: dict) -> str:
    """The GPUs of the environment summary in a few words."""
    gpus = env.get("gpus") or []
    if not gpus:
        return "none"
    names = sorted({g["name"] for g in gpus})
    g = gpus[0]
    return f"{len(gpus)} x {', '.join(names)} ({g['memory_gib']} GiB, compute {g['capability']})"


def _limit(step: dict) -> str:
    return f"{step.get('seconds', 0):.0f} s ({step.get('timeout', 0):.0f} s)"


def step_result(step: dict) -> str:
    """A step's outcome in one line: its error, its test counts or its figures."""
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
        f"| GPU | {gpu_line(env)} |",
        f"| torch / CUDA / cuDNN | {env.get('torch')} / {env.get('torch_cuda')} / {env.get('cudnn')} |",
        f"| Python | {env.get('python_version')} ({env.get('python')}) |",
        f"| fairseq / sacrebleu / pytest | {env.get('fairseq')} / {env.get('sacrebleu')} / "
        f"{env.get('pytest')} |",
        f"| fairseq-admin-pos | {env.get('package')}, commit {env.get('commit') or 'unknown'} |",
        f"| data | {report['data']} |",
        f"| time | {report['seconds']:.0f} s of a {report['budget_seconds']:.0f} s budget |",
        "", "| step | status | time (limit) | result |", "|---|---|---|---|",
    ]
    lines += [f"| {s['name']} | {s['status']} | {_limit(s)} | {step_result(s)} |" for s in steps]
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
