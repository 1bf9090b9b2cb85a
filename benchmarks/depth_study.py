#!/usr/bin/env python3
"""Depth study on Multi30k En-De: which residual schemes let deep Transformers train.

The CPU-scale counterpart of the WMT14 En-De depth table of Liu et al. 2020
("Understanding the Difficulty of Training Transformers"): same data, same hyperparameters,
same update budget; only the residual scheme and the depth change (and, for the position
rows, the position module). Two recipes (``--preset``; docs/results.md says what was scaled
and why):

* ``demo`` (default): the recipe of ``make demo``: d 128, FFN 512, 4 heads, dropout 0.1,
  label smoothing 0.1, shared embeddings, Adam (0.9, 0.98) (RAdam for ``admin-paper``),
  inverse_sqrt with lr 2e-3 and 400 warmup updates, 4096 tokens per batch, 700 updates;
* ``d64``: the first study's: d 64, FFN 256, 100 warmup updates, 200 updates (``--quick``
  uses it: two 12L-12L runs in about 7 minutes).

``--plan demo-scale`` runs the whole grid of docs/results.md (most informative runs first);
``--jobs 2 --threads 1`` runs two at a time.

``--plan converged`` measures the depth table at a converged schedule (docs/depth_converged.md):
lr 1e-3 after 2000 warmup updates, validation and a checkpoint every 200 updates, checkpoints
kept; first the convergence check (Admin 6L-6L and 18L-18L at 2400 and 4800 updates), then
Post-LN, Pre-LN and Admin at 6L-6L, 12L-12L, 18L-18L and Admin and Pre-LN at 12L-1L and 48L-1L,
two seeds (a third where the first two differ by more than 1 BLEU), seed 1 of every cell
first (where 12L-12L is every scheme's, Post-LN 18L-18L last, skipped where Post-LN 12L-12L
failed with both seeds). A run whose process was stopped (a session's end) resumes from its
``checkpoint_last.pt`` when the study is called again, and a longer run of a configuration
continues its kept shorter run (``depthstudy/segments.py``): one run, whose row says where it
was resumed (``resumed_at``). ``--cells admin:12L-1L:2,...`` trains only those cells of a
plan (every length, in the plan's order), for a session that cannot finish the plan's next
runs before it ends; the report still lists the whole plan. ``--report-only --publish docs``
rebuilds every table, the converged page's and the README's headline included, from the CSV.

Steps (every fairseq / data command is printed before it runs):

1. Data, cached under ``OUT/data`` and skipped when complete: the raw gzip text of
   Multi30k Task 1 (``train``, ``val``, ``test_2016_flickr``, ``.en`` / ``.de``), a joint
   sentencepiece unigram vocabulary trained on the *training* side only, the encoded
   splits, and ``fairseq-preprocess --joined-dictionary`` (needed by
   ``--share-all-embeddings``).
2. For each run not yet in ``OUT/results.csv``: ``fairseq-train`` with ``--arch
   admin_transformer`` of this package (validation every ``max_update / 4`` updates), then
   ``fairseq-generate`` of ``checkpoint_best.pt`` (lowest validation loss; at the demo
   recipe mostly the last checkpoint, in about a quarter of the runs the epoch-end one at
   update 680) on test_2016_flickr (beam 4, lenpen 0.6) and detokenized sacreBLEU against
   the raw references. A run that trained to the end but was not recorded (the study was
   stopped) is evaluated, not trained again.
3. One CSV row per finished run is added (a later call adds rows, an interrupted grid
   resumes where it stopped), then the markdown table ``OUT/results_table.md`` (summary over
   seeds, every run, the runs of the grid still missing) and the loss-curve figure
   ``OUT/depth_study_loss.png`` are rewritten from all rows (``--publish docs`` also copies
   them into the docs folder and its results.md). Commands are recorded relative to the
   repository root.

Diagnostics (why the paper's Admin fails at 24L-3L; ``--plan admin-causes``, ``--plan
admin-schedule``): every row also records each sub-layer's omega at initialisation (the
profile the run's log prints, the variant's file, or the closed form) and at the end (from
``checkpoint_last.pt``), the training monitor's encoder / decoder gradient norms (means over
the warmup and after it), and ``depthstudy/probe.py``'s source gain: the validation nll with
each sentence given the next sentence's source minus the nll with its own (about 0: the
decoder ignores the source), measured on ``checkpoint_best.pt`` before the checkpoints are
deleted. The omega variants (``admin-paper-floor``, ``-closed-bottom``, ``-max``, ``-enc``,
``-dec``; ``depthstudy/plan.py``) train admin-paper from its own Clinic profile changed by a
rule: the profile is measured once per depth and seed (``OUT/profiles``, a one-update
``fairseq-train`` with ``--admin-profile-path``), the variant's omegas are written to the
run's ``omegas.json`` and read through ``--admin-profile-path``. In clinic mode each omega is
measured with the earlier ones already in place, so a variant that changes the bottom omegas
keeps upper omegas that were measured under the original bottom: it is not a re-profile.

Parts: ``benchmarks/depthstudy/`` (plan, data, runner, logs, report, plot, omegas, probe).

Residual schemes (flags of ``fairseq_admin_pos``; the same as ``make demo --scheme``):

* ``post-ln``: ``--admin-init none`` (omega = 1: stock fairseq Post-LN);
* ``pre-ln``: ``--admin-init none --encoder-normalize-before --decoder-normalize-before``;
* ``admin``: ``--admin-init closed-form --admin-omega parameter`` (admin-torch's O(logn)
  closed form, omega a trainable vector: admin-torch's best setting);
* ``admin-paper``: the paper's Admin as Transformer-Clinic runs it: ``--admin-init profile
  --admin-profile-mode clinic --admin-omega parameter --optimizer radam
  --radam-early-steps skip``;
* ``deepnorm``: ``--admin-residual deepnorm`` (Wang et al. 2022);
* ``admin-profile`` (the d=64 study): ``--admin-init profile --admin-profile-mode eval
  --admin-omega parameter`` with Adam.

Position variants (``--positions``; Admin rows at 12L-3L): ``sinusoidal`` (fairseq's),
``scaled-sinusoidal`` (fairseq's table times a learnable scale starting at 1: the same model
at initialisation plus one scalar per side), ``scaled-sinusoidal-seed`` (the seed module: its
own table, scale starting at 1/sqrt(d)), ``learned``. The final learned scale of each run is
recorded (``final_shortcuts``, with the omegas' mean/min/max).

A run's status (see ``classify``), with H the unigram entropy of the German training side
in bits per token (</s> included, as fairseq's ``nll_loss``, which is base 2):

* ``nan``: a NaN/Inf loss, or fairseq stopped with ``FloatingPointError``;
* ``diverged``: the last logged train nll_loss is more than ``--diverge-bits`` (1.0) above
  the lowest logged train nll_loss;
* ``stuck``: the best valid nll_loss is not ``--stuck-bits`` (1.0) below H, i.e. the model
  predicts little more than word frequencies (the failure of deep Post-LN in the paper);
* ``trained`` otherwise.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

# the parts live in benchmarks/depthstudy/; this file is also loaded by path (tests)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from depthstudy.common import (REPO, USER_DIR, cpu_name, fairseq_env, log,  # noqa: E402,F401
                               parse_depth, relative, run_checked, show)
from depthstudy.deepshallow import END as DS_END, START as DS_START  # noqa: E402
from depthstudy.norms2025 import END as NS_END, START as NS_START  # noqa: E402
from depthstudy.data import (LANGS, SPLITS, SRC, TGT, check_data, prepare_data,  # noqa: E402,F401
                             unigram_entropy_bits)
from depthstudy.logs import LOG_RE, classify, parse_curve  # noqa: E402,F401
from depthstudy.omegas import init_omegas, variant_omegas  # noqa: E402,F401
from depthstudy.plan import (_DEEP_ENC, PLAN_RECIPES, PLANS, POSITIONS,  # noqa: E402,F401
                             PRESETS, QUICK, SCHEMES, item_args, item_key, run_key,
                             study_name)
from depthstudy.plot import plotted_study, write_omega_plot, write_plot  # noqa: E402,F401
from depthstudy import converged  # noqa: E402
from depthstudy.publish import publish  # noqa: E402,F401
from depthstudy.report import (CSV_FIELDS, TABLE_END, TABLE_START, append_row,  # noqa: E402,F401
                               distinct_translations, read_rows, write_table)
from depthstudy.grid import claim, run_grid  # noqa: E402,F401
from depthstudy.runner import (backfill, final_shortcuts, generate,  # noqa: E402,F401
                               one_run, train_command, unsupported_flags)


def check_imports(report_only: bool) -> None:
    """Fail early, naming what to install, instead of after the data preparation."""
    needed = ["matplotlib"] if report_only else ["fairseq", "sentencepiece", "sacrebleu",
                                                 "matplotlib"]
    missing = []
    for name in needed:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(
            f"depth_study needs {', '.join(missing)} in this Python ({sys.executable}); "
            "run `make install` and use .venv/bin/python (extras: data, plot)"
        )


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " See the module docstring / docs/results.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "multi30k",
                   help="folder with Multi30k Task 1 raw gzip text: train/val/test_2016_flickr "
                        ".en.gz/.de.gz")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "depth_study",
                   help="output folder: cached data, runs, results.csv, table, figure")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                   help="recipe: demo = the make-demo recipe (d 128, FFN 512, lr 2e-3, warmup "
                        "400, 700 updates); d64 = the first study (d 64, FFN 256, warmup 100, "
                        "200 updates). Explicit --embed-dim etc. override it")
    p.add_argument("--plan", choices=sorted(PLANS), default=None,
                   help="run a predefined grid (with its own recipe) instead of --schemes x "
                        "--depths x --seeds; each plan: benchmarks/depthstudy/plan.py")
    p.add_argument("--cells", default=None, metavar="SCHEME:DEPTH[:SEED],...",
                   help="with --plan: only the plan's runs of these cells (every length, in the "
                        "plan's order), e.g. admin:12L-1L:2,pre-ln:12L-1L:2")
    p.add_argument("--quick", action="store_true",
                   help="the headline contrast only, fast: --schemes post-ln,admin --depths "
                        "12L-12L --preset d64 (explicit flags override it)")
    p.add_argument("--schemes", default="post-ln,pre-ln,admin,admin-paper,deepnorm",
                   help=f"comma list from: {', '.join(SCHEMES)}")
    p.add_argument("--positions", default="sinusoidal",
                   help=f"comma list of position variants from: {', '.join(POSITIONS)}")
    p.add_argument("--depths", default="6L-6L,12L-12L," + _DEEP_ENC,
                   help="comma list of <enc>L-<dec>L")
    p.add_argument("--seeds", default="1", help="comma list of seeds")
    p.add_argument("--max-update", type=int, default=None,
                   help="updates per run (the budget; default: the preset's)")
    p.add_argument("--embed-dim", type=int, default=None, help="default: the preset's")
    p.add_argument("--ffn-dim", type=int, default=None, help="default: the preset's")
    p.add_argument("--heads", type=int, default=None, help="default: the preset's")
    p.add_argument("--dropout", type=float, default=0.1, help="fairseq --dropout of every run")
    p.add_argument("--lr", type=float, default=None, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=None,
                   help="inverse_sqrt warmup updates (default: the preset's; d64 uses 100 so "
                        "the lr peaks within its 200-update budget)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the preset's")
    p.add_argument("--clip-norm", type=float, default=0.0,
                   help="fairseq --clip-norm of every run (0: no clipping, the demo recipe; "
                        "B2T's authors clip at 0.1 beyond 18 layers). A non-zero value is "
                        "part of the run's key and its label in the table")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (each with --threads torch threads)")
    p.add_argument("--vocab", type=int, default=8000, help="joint sentencepiece vocabulary")
    p.add_argument("--validate-every", type=int, default=0,
                   help="validate every N updates (0: max_update / 4)")
    p.add_argument("--log-interval", type=int, default=10,
                   help="fairseq --log-interval: updates between logged training losses")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run")
    p.add_argument("--stuck-bits", type=float, default=1.0,
                   help="'stuck' if the best valid nll is not this far below the unigram "
                        "entropy of the target side")
    p.add_argument("--diverge-bits", type=float, default=1.0,
                   help="'diverged' if the last train nll exceeds its minimum by more")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep checkpoint_best.pt of each run (deleted after BLEU otherwise)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing new: rewrite the table and figures from results.csv "
                        "(after filling the diagnostic columns of rows whose run folders are "
                        "still in OUT/runs)")
    p.add_argument("--publish", type=Path, default=None, metavar="DIR",
                   help="also copy results.csv -> DIR/depth_study_results.csv, the figure -> "
                        "DIR/depth_study_loss.png, and put the table into DIR/results.md "
                        f"between the lines {TABLE_START!r} and {TABLE_END!r}; where the page "
                        f"has the lines {DS_START!r} and {DS_END!r} and --plan deep-shallow "
                        "has rows, the deep-shallow block between them (cells over seeds, "
                        "their deployed speed from DIR/deploy_speed_cells.csv and "
                        "DIR/deploy_speed_shapes.csv of benchmarks/deploy_speed.py, the "
                        "fastest model within 0.5 BLEU of the best) and, with the cells' "
                        "speed, DIR/deep_shallow_speed_quality.png; likewise between "
                        f"{NS_START!r} and {NS_END!r} when --plan norms-2025's or "
                        "norms-2025-dyt's schemes have rows: those cells next to admin, pre-ln "
                        "and post-ln at the same depths, and the training speed of "
                        "DIR/speed_norms_2025*.json (benchmarks/speed_vs_stock.py --json)")
    p.add_argument("--verbose", action="store_true", help="echo fairseq-train's log")
    return p


def _grid(args, schemes, depths, seeds, positions):
    if args.plan:
        return list(PLANS[args.plan])
    return [(s, d, seed, pos) for d in depths for pos in positions for s in schemes
            for seed in seeds]


def only_cells(grid, text: str) -> list:
    """The runs of ``grid`` in the cells ``text`` names (a comma list of ``scheme:depth`` or
    ``scheme:depth:seed``), in the grid's order. A cell the grid lacks is a ``ValueError``
    naming ``--cells`` and the grid's cells."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError("--cells: no cell given (a comma list of scheme:depth[:seed])")
    keep = set()
    for name in names:
        parts = name.split(":")
        chosen = {g for g in grid if len(parts) in (2, 3) and list(g[:2]) == parts[:2]
                  and (len(parts) == 2 or str(g[2]) == parts[2])}
        if not chosen:
            cells = ", ".join(dict.fromkeys(f"{g[0]}:{g[1]}:{g[2]}" for g in grid))
            raise ValueError(f"--cells: {name!r} is no cell of this grid; valid choices "
                             f"(the seed may be left out): {cells}")
        keep |= chosen
    return [g for g in grid if g in keep]


def _split(parser, flag: str, text: str, valid: dict) -> list:
    """A comma list of choices; an unknown one is an argparse error naming ``flag``."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in valid]
    if bad:
        parser.error(f"{flag}: unknown {', '.join(bad)}; valid choices: {', '.join(valid)}")
    return items


def parse_args(argv):
    """The parsed flags with ``--quick``'s, the plan's recipe and the preset filled in where
    not given, and the grid's axes checked: (parser, args, schemes, positions, depths,
    seeds)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    for name, value in (QUICK.items() if args.quick else ()):
        if "--" + name.replace("_", "-") not in given:
            setattr(args, name, value)
    for name, value in PLAN_RECIPES.get(args.plan, {}).items():
        if "--" + name.replace("_", "-") not in given:
            setattr(args, name, value)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    schemes = _split(parser, "--schemes", args.schemes, SCHEMES)
    positions = _split(parser, "--positions", args.positions, POSITIONS)
    depths = [d.strip() for d in args.depths.split(",") if d.strip()]
    for d in depths:
        try:
            parse_depth(d)
        except SystemExit as err:  # one argparse line, exit status 2
            parser.error(str(err))
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma list of integers")
    if args.max_update < 1 or args.threads < 1 or args.jobs < 1:
        parser.error("--max-update, --threads and --jobs must be >= 1")
    if args.clip_norm < 0:
        parser.error(f"--clip-norm: {args.clip_norm:g} is negative; 0 turns clipping off")
    if args.cells is not None and not args.plan:
        # one line, without argparse's usage block: the flag's name says what to change
        parser.exit(2, f"{parser.prog}: error: --cells selects runs of a --plan; without one "
                       "use --schemes, --depths and --seeds\n")
    args.out = args.out.resolve()
    return parser, args, schemes, positions, depths, seeds


def report(args, grid, csv_path: Path) -> None:
    """The table and figures of the CSV's rows, and with ``--publish`` the docs' blocks."""
    rows = read_rows(csv_path)
    if not rows:
        log(f"no rows in {csv_path} yet")
        return
    done = {r["key"] for r in rows}
    missing = [(study_name(item_args(args, g)), *g[:4]) for g in grid
               if item_key(g, args) not in done]
    write_table(rows, args.out / "results_table.md", missing)
    write_plot(rows, args.out, args.out / "depth_study_loss.png", args.publish or REPO / "docs")
    write_omega_plot(rows, args.out / "depth_study_omegas.png")
    log(f"{len(rows)} rows in {csv_path}; table {args.out/'results_table.md'}; "
        f"figure {args.out/'depth_study_loss.png'}")
    if missing:
        log(f"{len(missing)} runs of this grid are still missing (listed in the table)")
    print((args.out / "results_table.md").read_text())
    if args.publish is not None:
        publish(args.out, args.publish)
        # the converged schedule's tables (depthstudy/converged.py) and the README's headline
        for page in (args.publish / "depth_converged.md",
                     args.publish.resolve().parent / "README.md"):
            if page.is_file():
                converged.fill(page, rows, args.out, args.publish)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser, args, schemes, positions, depths, seeds = parse_args(argv)
    csv_path = args.out / "results.csv"
    grid = _grid(args, schemes, depths, seeds, positions)
    if args.plan == "converged":  # a third seed where the first two disagree; Post-LN
        # 18L-18L not where Post-LN 12L-12L failed with both seeds
        rows = read_rows(csv_path)
        skip = converged.skipped(rows)
        grid = [g for g in grid if g not in skip] + converged.third_seeds(rows)
    # the report lists what the whole grid misses; --cells narrows only what runs now
    to_run = grid
    if args.cells is not None:
        try:
            to_run = only_cells(grid, args.cells)
        except ValueError as err:
            parser.exit(2, f"{parser.prog}: error: {err}\n")
    if not args.report_only:
        try:
            check_data(args.data)
        except SystemExit as err:
            # one line naming --data and what it must hold, argparse's exit status, nothing
            # written (--out is made after the check); before check_imports, whose fairseq
            # import leaves the root logger at DEBUG, so that nothing else is printed
            parser.exit(2, f"{parser.prog}: error: {err.code}\n")
    check_imports(args.report_only)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        root = prepare_data(args.data, args.out, args.vocab, args.threads, args.threads)
        unigram_bits = unigram_entropy_bits(root)
        log(f"unigram entropy of train.{TGT}: {unigram_bits:.3f} bits/token")
        study_cmd = "python benchmarks/depth_study.py " + " ".join(shlex.quote(a) for a in argv)
        run_grid(args, root, to_run, unigram_bits, study_cmd, csv_path)
    if (args.out / "data" / "bin").is_dir():
        # rows recorded before the diagnostic columns, whose runs are still here
        backfill(args, args.out / "data", csv_path)
    report(args, grid, csv_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
