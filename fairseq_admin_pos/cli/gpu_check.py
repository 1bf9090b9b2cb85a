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
     the paper's Admin (``admin-paper``), the closed form (``admin``) and Post-LN
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
import shutil
import sys
import time
from pathlib import Path

# the parts (fairseq_admin_pos/cli/gpucheck/): standard library only at import, so that a
# Python without torch or fairseq still gets the one-line refusal
from fairseq_admin_pos.cli.gpucheck.environment import (
    PROG, REPO, REPO_FILES, REQUIRED_MODULES, environment_error, environment_summary,
    probe_environment)
from fairseq_admin_pos.cli.gpucheck.processes import (
    child_env, interrupt, run_process, stop_all, tool_shims)
from fairseq_admin_pos.cli.gpucheck.report import gpu_line, markdown, step_result, write_report
from fairseq_admin_pos.cli.gpucheck.steps import (
    GIB_PER_RECIPE_RUN, RECIPE_DEPTH, RECIPE_SCHEMES, benchmark, bpe_kind, check_data,
    cuda_test_files, cuda_tests, dataset_size, failure, generated_pairs, junit_counts,
    parse_train_log, prepare_data, recipe_env, recipe_run, recipe_slots, write_synthetic_corpus)

#: the check's names, importable from here whichever part of :mod:`.gpucheck` holds them
__all__ = [
    "main", "build_parser", "say", "DATA_LIMIT", "PHASE_LIMIT", "REPORT_MARGIN",
    "PROG", "REPO", "REPO_FILES", "REQUIRED_MODULES", "probe_environment", "environment_error",
    "environment_summary",
    "run_process", "stop_all", "interrupt", "child_env", "tool_shims",
    "RECIPE_SCHEMES", "RECIPE_DEPTH", "GIB_PER_RECIPE_RUN", "failure", "check_data",
    "write_synthetic_corpus", "prepare_data", "dataset_size", "bpe_kind", "cuda_test_files",
    "cuda_tests", "junit_counts", "recipe_slots", "recipe_env", "parse_train_log", "recipe_run",
    "generated_pairs", "benchmark",
    "gpu_line", "step_result", "markdown", "write_report",
]

# limits (seconds) inside the budget; the benchmark gets what is left
DATA_LIMIT = 45
PHASE_LIMIT = 120
REPORT_MARGIN = 5


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


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


def tests_and_recipes(args, info: dict, data_step: dict, out: Path, logs: Path, shims: Path,
                      phase_end: float) -> list:
    """The CUDA tests beside the recipe runs (as many at once as :func:`recipe_slots`
    allows, spread over the GPUs), all ending by ``phase_end``; their steps in order."""
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
        return [tests.result()] + [r.result() for r in runs]
    except KeyboardInterrupt:
        # the children run in their own sessions: Ctrl-C reached only this process
        interrupt()
        raise
    finally:
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


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
    say(f"{gpu_line(env)}; torch {env['torch']} (CUDA {env['torch_cuda']}); report in {out}")

    steps = [prepare_data(args, out, logs, min(DATA_LIMIT, deadline - time.monotonic()))]
    data_step = steps[0]
    say(f"data: {data_step.get('source')} {data_step.get('path')} ({data_step['status']})")
    if data_step["status"] == "passed":
        phase_end = time.monotonic() + min(PHASE_LIMIT, deadline - time.monotonic() - 60)
        steps += tests_and_recipes(args, info, data_step, out, logs, shims, phase_end)
        for s in steps[1:]:
            say(f"{s['name']}: {s['status']} in {s.get('seconds', 0):.0f} s ({step_result(s)})")
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
