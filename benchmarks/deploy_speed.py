"""BLEU and speed of the demo's model as trained and as deployed, side by side in one run.

The model ``make demo`` trained (``demo_out/admin/checkpoints/checkpoint_last.pt``) is
exported with ``fairseq-admin-export`` (a stock fairseq ``transformer`` file and two
CTranslate2 models, float32 and int8) and translates Multi30k test2016 four ways, with the
demo's settings (beam 4, length penalty 0.6, at most ``1.2 * source + 10`` tokens, batches
of 64 sentences, CPU, the same number of threads):

* ``fairseq + plugin``: ``fairseq-generate --user-dir fairseq_admin_pos`` on the original;
* ``fairseq, exported``: plain ``fairseq-generate`` (no ``--user-dir``) on the export;
* ``CTranslate2 float32`` / ``CTranslate2 int8``: ``ctranslate2.Translator`` through
  ``fairseq_admin_pos.export.ct2.translate`` (fairseq's settings mapped onto CTranslate2's).

Speed is sentences per second of translation alone: fairseq-generate's own timer (its
"Translated N sentences ... in X s" line, which times the generator and nothing else) and
the wall time of CTranslate2's ``translate_batch`` calls; loading, tokenisation and scoring
are outside both. The four are measured ``--rounds`` times in rotating order (so a load
change on a shared machine hits all alike); the table gives the median and the ratio to
``fairseq + plugin``. BLEU is sacreBLEU on the detokenised output (sentencepiece pieces
joined) against the raw references, as the demo scores it; "same as plugin" counts
sentences whose output equals the plugin's.

    python benchmarks/deploy_speed.py                 # demo_out/admin, 1 thread, 3 rounds
    python benchmarks/deploy_speed.py --threads 2 --rounds 5 --work bench_out/deploy

Two more modes (parts in ``benchmarks/deployspeed/``) time shapes of encoder and decoder
depth. Each invocation is one timing run with its own id (``run``: UTC start time and
``--run-label``); it writes one CSV row per (shape, scheme, engine, precision, batch,
threads) with the CPU, sentences/s, ms per sentence, the ratio to the 6L-6L row of the same
run, scheme, engine, precision, batch and threads, and CTranslate2's fairseq last step
(sentences at the length limit and its seconds), **merges** them into the CSV (rows of the
same run and key replaced, every other run's rows kept) and prints them as a markdown table:

* ``--study-out OUT [--plan deep-shallow] [--cells admin:12L-1L,...]``: one trained
  checkpoint per cell of a depth-study plan through ``fairseq-generate --user-dir`` and the
  CTranslate2 export (float32, int8; plugin only where the export refuses the scheme), on
  test2016 at batch 64 and 1 with 1 and 2 threads (``deployspeed/cells.py``); CSV default
  ``docs/deploy_speed_cells.csv`` (``docs/deploy_speed_PLAN.csv`` for another ``--plan``), which
  ``depth_study.py --publish docs`` reads;
* ``--wmt-shapes``: untrained WMT-base shapes (d 512, FFN 2048, 8 heads, synthetic joined
  vocabulary of 32000 symbols; 6L-6L, 12L-3L, 12L-1L, 24L-1L) exported to CTranslate2 and
  timed with every output held to its reference's length (``deployspeed/shapes.py``); CSV
  default ``docs/deploy_speed_shapes.csv``.

``--quick`` runs either mode in seconds (1 round, 1 thread; tiny WMT shapes, 24 sentences;
the CSV in the work folder) for the tests. The published tables' runs, one command each, are
in docs/deployment.md ("Deployed speed of the depth study's cells"):

    python benchmarks/deploy_speed.py --study-out runs/depth_study --plan deep-shallow
    python benchmarks/deploy_speed.py --study-out runs/depth_study --plan converged --threads 1
    python benchmarks/deploy_speed.py --wmt-shapes --text runs/depth_study/data/spm
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

# the parts live in benchmarks/deployspeed/ (and the study's in benchmarks/depthstudy/)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from depthstudy.plan import PLANS  # noqa: E402
from deployspeed.timing import (BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B, REPO,  # noqa: E402,F401
                                cpu_name, detok, fairseq_generate, markdown, merge_csv,
                                parse_ints, run_id, tool)

BATCH = 64
WAYS = ("fairseq + plugin", "fairseq, exported", "CTranslate2 float32", "CTranslate2 int8")


def export(args, work: Path) -> Dict[str, Path]:
    paths = {"stock": work / "stock.pt", "ct2": work / "ct2-float32", "int8": work / "ct2-int8"}
    if not (paths["stock"].exists() and paths["ct2"].exists()):
        if paths["ct2"].exists():
            raise SystemExit(f"{paths['ct2']} exists without {paths['stock']}: remove {work}")
        cmd = [tool("fairseq-admin-export"), args.checkpoint, "--out", paths["stock"],
               "--ctranslate2", paths["ct2"]]
        print("+ " + " ".join(map(str, cmd)), flush=True)
        subprocess.run([str(c) for c in cmd], check=True)
    if not paths["int8"].exists():
        # the same export, quantised by CTranslate2's converter (the fairseq file is the same)
        cmd = [tool("fairseq-admin-export"), args.checkpoint, "--out", work / "stock-int8.pt",
               "--ctranslate2", paths["int8"], "--quantization", "int8"]
        print("+ " + " ".join(map(str, cmd)), flush=True)
        subprocess.run([str(c) for c in cmd], check=True)
        (work / "stock-int8.pt").unlink()
    return paths


def read_lines(path: Path) -> List[str]:
    return path.read_text(encoding="utf-8").splitlines()


def run_fairseq(args, checkpoint: Path, plugin: bool) -> (List[str], float):
    hyps, n, seconds = fairseq_generate(args.data, checkpoint, BATCH, args.threads, plugin)
    return hyps, n / seconds


def run_ct2(args, folder: Path, compute_type: str, sources, references
            ) -> (List[str], float):
    import ctranslate2

    from fairseq_admin_pos.export.ct2 import translate

    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type=compute_type,
                                        intra_threads=args.threads, inter_threads=1)
    t0 = time.perf_counter()
    # the references only order the batches as fairseq-generate orders a split with targets
    out = translate(translator, sources, BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B, batch_size=BATCH,
                    references=references)
    seconds = time.perf_counter() - t0
    return [detok(tokens) for tokens, _ in out], len(sources) / seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo-out", type=Path, default=Path("demo_out"),
                   help="make demo's output folder (default demo_out)")
    p.add_argument("--scheme", default="admin", help="the demo run to deploy (default admin)")
    p.add_argument("--work", type=Path, default=None,
                   help="where the exports go (default DEMO_OUT/SCHEME/deploy; with "
                   "--study-out: the first STUDY_OUT/deploy_speed; with --wmt-shapes: "
                   "runs/deploy_speed/wmt-shapes)")
    p.add_argument("--threads", default=None,
                   help="threads of every engine (OMP/MKL for fairseq, intra_threads for "
                   "CTranslate2; default 1); with --study-out / --wmt-shapes a comma list, "
                   "each timed (default 1,2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measurements per engine (default 3; --quick: 1)")
    g = p.add_argument_group("trained cells of a depth-study plan")
    g.add_argument("--study-out", type=Path, action="append", default=None, metavar="OUT",
                   help="a depth study's output folder (results.csv, runs/*/ckpt, data); "
                   "repeat to search several in order (a cell's first run with a checkpoint "
                   "wins, timed with its own folder's data)")
    g.add_argument("--plan", default="deep-shallow", choices=sorted(PLANS), metavar="PLAN",
                   help="the depth-study plan whose cells are timed (default deep-shallow; "
                   "converged: the converged schedule's grid)")
    g.add_argument("--cells", default="",
                   help="only these cells, scheme:<enc>L-<dec>L comma list (cells outside the "
                   "plan are looked up with the plan's recipe)")
    g = p.add_argument_group("untrained WMT-base shapes")
    g.add_argument("--wmt-shapes", action="store_true",
                   help="time untrained WMT-base shapes as CTranslate2 models with fixed "
                   "output lengths (deployspeed/shapes.py)")
    g.add_argument("--shapes", default="6L-6L,12L-3L,12L-1L,24L-1L",
                   help="the shapes of --wmt-shapes (default 6L-6L,12L-3L,12L-1L,24L-1L)")
    g.add_argument("--text", type=Path, default=None,
                   help="folder with the sentencepiece test.en / test.de the WMT inputs and "
                   "output lengths come from (default STUDY_OUT/data/spm, else "
                   "runs/depth_study/data/spm)")
    g.add_argument("--keep-checkpoints", action="store_true",
                   help="keep the untrained WMT checkpoints after their export")
    g = p.add_argument_group("both depth modes (--study-out, --wmt-shapes)")
    g.add_argument("--batches", default="64,1",
                   help="batch sizes timed (default 64,1: sentences/s at 64, latency at 1)")
    g.add_argument("--csv", type=Path, default=None,
                   help="the CSV this run is merged into (default docs/deploy_speed_cells.csv, "
                   "docs/deploy_speed_PLAN.csv for another --plan, or docs/deploy_speed_shapes.csv;"
                   " --quick: in the work folder)")
    g.add_argument("--run-label", default=None,
                   help="the run id's label after its UTC time (default cells or wmt-shapes)")
    g.add_argument("--quick", action="store_true",
                   help="seconds, for the tests: 1 round, 1 thread; tiny WMT shapes (d 16, "
                   "vocabulary 64) on 24 sentences; the CSV in the work folder")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.study_out and args.wmt_shapes:
        p.error("--study-out and --wmt-shapes are two runs: give one")
    if args.study_out or args.wmt_shapes:
        return depth_main(args)
    if args.quick or args.run_label:
        p.error("--quick and --run-label apply to --study-out and --wmt-shapes")
    args.threads = parse_ints(args.threads or "1", "--threads")
    if len(args.threads) != 1:
        p.error("--threads: the demo's comparison takes one thread count")
    args.threads = args.threads[0]
    args.rounds = args.rounds or 3
    run_dir = args.demo_out / args.scheme
    args.checkpoint = run_dir / "checkpoints" / "checkpoint_last.pt"
    args.data = args.demo_out / "data-bin"
    if not args.checkpoint.exists():
        raise SystemExit(f"{args.checkpoint} not found: run `make demo` first")
    work = args.work or run_dir / "deploy"
    work.mkdir(parents=True, exist_ok=True)
    paths = export(args, work)
    refs = read_lines(args.demo_out / "raw" / "test_2016_flickr.de")
    sources = [line.split() for line in read_lines(args.demo_out / "spm" / "test.en")]
    pieces = [line.split() for line in read_lines(args.demo_out / "spm" / "test.de")]
    runners = {
        WAYS[0]: lambda: run_fairseq(args, args.checkpoint, plugin=True),
        WAYS[1]: lambda: run_fairseq(args, paths["stock"], plugin=False),
        WAYS[2]: lambda: run_ct2(args, paths["ct2"], "float32", sources, pieces),
        WAYS[3]: lambda: run_ct2(args, paths["int8"], "int8", sources, pieces),
    }
    speeds: Dict[str, List[float]] = {w: [] for w in WAYS}
    outputs: Dict[str, List[str]] = {}
    for r in range(args.rounds):
        order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
        for way in order:
            hyps, speed = runners[way]()
            if way in outputs and outputs[way] != hyps:
                raise SystemExit(f"{way}: the output changed between rounds")
            outputs[way] = hyps
            speeds[way].append(speed)
            print(f"round {r + 1} {way:<22} {speed:8.1f} sentences/s", flush=True)

    report(args, work, outputs, speeds, refs)


def report(args, work: Path, outputs: Dict[str, List[str]], speeds: Dict[str, List[float]],
           refs: List[str]) -> None:
    """The demo comparison's table (BLEU, median speed, ratio to the plugin, outputs equal
    to the plugin's) printed and written to ``work/deploy_speed.json``."""
    import sacrebleu

    base = statistics.median(speeds[WAYS[0]])
    rows = []
    for way in WAYS:
        hyps = outputs[way]
        if len(hyps) != len(refs):
            raise SystemExit(f"{way}: {len(hyps)} translations for {len(refs)} references")
        bleu = sacrebleu.metrics.BLEU().corpus_score(hyps, [refs]).score
        same = sum(a == b for a, b in zip(hyps, outputs[WAYS[0]]))
        med = statistics.median(speeds[way])
        rows.append({"engine": way, "bleu": round(bleu, 2), "sentences_per_s": round(med, 1),
                     "ratio": round(med / base, 2), "same_as_plugin": same,
                     "rounds": [round(s, 1) for s in speeds[way]]})
    print(f"\nMulti30k test2016 ({len(refs)} sentences), beam {BEAM}, lenpen {LENPEN}, "
          f"batch {BATCH}, {args.threads} thread(s), median of {args.rounds} rounds\n")
    print("| engine | sacreBLEU | sentences/s | ratio | same output as plugin |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['engine']} | {row['bleu']:.2f} | {row['sentences_per_s']:.1f} | "
              f"{row['ratio']:.2f} | {row['same_as_plugin']} / {len(refs)} |")
    result = {"threads": args.threads, "rounds": args.rounds, "rows": rows,
              "cpu": cpu_name(), "checkpoint": str(args.checkpoint)}
    (work / "deploy_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{cpu_name()}; results in {work / 'deploy_speed.json'}")


def depth_main(args) -> None:
    """``--study-out`` (deployspeed/cells.py) or ``--wmt-shapes`` (deployspeed/shapes.py):
    one timing run, merged into the CSV; its rows printed as a markdown table."""
    import logging

    # fairseq's INFO lines (task setup, model loading) would bury the progress
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.threads = parse_ints(args.threads or ("1" if args.quick else "1,2"), "--threads")
    args.batches = parse_ints(args.batches, "--batches")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.precisions = ("float32", "int8")
    if args.study_out:
        from deployspeed import cells as mode

        args.study_out = [o.resolve() for o in args.study_out]
        kind = "cells"
        args.work = args.work or args.study_out[0] / "deploy_speed"
    else:
        from deployspeed import shapes as mode

        kind = "shapes"
        args.work = args.work or REPO / "runs" / "deploy_speed" / "wmt-shapes"
        args.text = args.text or (REPO / "runs" / "depth_study" / "data" / "spm")
        if not (args.text / "test.en").is_file():
            raise SystemExit(f"--text {args.text}: no test.en / test.de (sentencepiece pieces "
                             "of test2016, e.g. a depth study's OUT/data/spm)")
    args.work.mkdir(parents=True, exist_ok=True)
    # the deep-shallow plan's cells keep their historical file; another plan gets its own
    name = kind if kind == "shapes" or args.plan == "deep-shallow" else args.plan
    csv_path = args.csv or (args.work if args.quick else REPO / "docs") / \
        f"deploy_speed_{name}.csv"
    args.run = run_id(args.run_label or ("cells" if kind == "cells" else "wmt-shapes"))
    rows = mode.run(args)
    merged = merge_csv(csv_path, rows)
    print(f"\nrun {args.run}: beam {BEAM}, lenpen {LENPEN}, median of {args.rounds} round(s) "
          f"in rotating order; {cpu_name()}\n")
    print("\n".join(markdown(rows)))
    print(f"\n{len(rows)} rows of run {args.run} merged into {csv_path} ({len(merged)} rows, "
          f"{len({r['run'] for r in merged})} runs)")


if __name__ == "__main__":
    main()
