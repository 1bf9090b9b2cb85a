"""The deep-shallow study in the docs: the plan's cells (BLEU and validation nll over seeds,
failures), their deployed speed (``benchmarks/deploy_speed.py --study-out``), the untrained
WMT-base shapes' speed (``--wmt-shapes``), the speed-quality figure, the line naming the
fastest model within 0.5 BLEU of the best, and the paper's Admin at the longer warmup
(``--plan deep-shallow-warmup``) beside the same cells at the demo recipe.

``--publish DIR`` (``publish.publish``) calls :func:`fill_block`: the block between
:data:`START` and :data:`END` of ``DIR/results.md`` is rewritten when the plan has rows, and
left as it is otherwise (also when the page lacks the markers). The speed parts and the figure
``DIR/deep_shallow_speed_quality.png`` need ``DIR/deploy_speed_cells.csv``; the WMT shapes
table needs ``DIR/deploy_speed_shapes.csv``. Every figure the block states is computed here
from those rows.

Speed is compared within a timing run only (the CSV's ``run``), and a failed timed model is
left out of the figure and the fastest line (:class:`Speed`, :func:`fastest_line`; the rules
in docs/deployment.md, "Deployed speed of the depth study's cells").
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
from collections import Counter
from pathlib import Path

from .courses import course_lines
from .plan import PLAN_RECIPES, PLANS, PRESETS, run_key
from .report import published_curve

PLAN = "deep-shallow"
#: the paper's Admin at the longer warmup (lr 1e-3, warmup 2000) in the 1-layer-decoder
#: cells (plan.py)
WARMUP_PLAN = "deep-shallow-warmup"
#: the same recipe's deep encoder with a 3-layer decoder (``--plan admin-warmup``), where the
#: longer warmup is known to make the paper's Admin train
WARMUP_REFERENCE = "24L-3L"
START = "<!-- deep_shallow table: start -->"
END = "<!-- deep_shallow table: end -->"
CELLS_CSV, SHAPES_CSV = "deploy_speed_cells.csv", "deploy_speed_shapes.csv"
FIGURE = "deep_shallow_speed_quality.png"
BLEU_MARGIN = 0.5
PLUGIN, CT2 = "fairseq + plugin", "CTranslate2"
#: the speed the figure and the "fastest" line use: CTranslate2 int8, batch 64, 1 thread; for
#: a scheme that cannot be exported, fairseq-generate with the plugin at the same batch/threads
X_SPEED = (CT2, "int8", "64", "1")
X_FALLBACK = (PLUGIN, "float32", "64", "1")
X_LABEL = "CTranslate2 int8, batch 64, 1 thread"
COMMANDS = [
    # the study itself, keeping each run's checkpoint_best.pt for the speed run
    "python benchmarks/depth_study.py --plan deep-shallow --out runs/depth_study --threads 1 "
    "--jobs 2 --keep-checkpoints",
    # one timing run of every cell, merged into the CSV: every ratio within that run
    "python benchmarks/deploy_speed.py --study-out runs/depth_study --plan deep-shallow "
    "--batches 64,1 --threads 1 --rounds 1 --csv docs/deploy_speed_cells.csv",
    # the WMT-width shapes on the first 200 sentences of test2016, as published
    "mkdir -p runs/wmt200 && for f in test.en test.de; do head -n 200 "
    "runs/depth_study/data/spm/$f > runs/wmt200/$f; done",
    "python benchmarks/deploy_speed.py --wmt-shapes --text runs/wmt200 --threads 1,2 "
    "--rounds 1 --csv docs/deploy_speed_shapes.csv",
    "python benchmarks/depth_study.py --plan deep-shallow --out runs/depth_study "
    "--report-only --publish docs",
]


def plan_args(plan: str) -> argparse.Namespace:
    """The recipe a plan's runs were keyed with: the demo preset, the plan's own recipe,
    the study's defaults for the rest (``depth_study.py`` without extra flags)."""
    recipe = dict(PRESETS["demo"], **PLAN_RECIPES.get(plan, {}))
    return argparse.Namespace(**recipe, dropout=0.1, vocab=8000, clip_norm=0.0)


#: the study's order of the shapes (others after them, by total depth)
SHAPES = ("6L-6L", "12L-3L", "12L-1L", "24L-1L", "48L-1L")


def plan_cells(plan: str):
    """``(scheme, depth, positions)`` of the plan, each once: shapes in the study's order,
    schemes in the plan's order."""
    cells = list(dict.fromkeys((s, d, p) for s, d, _, p, *_n in PLANS[plan]))
    schemes = list(dict.fromkeys(c[0] for c in cells))
    return sorted(cells, key=lambda c: (_shape_order(c[1]), schemes.index(c[0])))


def _shape_order(depth: str):
    enc, dec = (int(x.rstrip("L")) for x in depth.split("-"))
    return (SHAPES.index(depth) if depth in SHAPES else len(SHAPES), enc + dec, enc)


def cell_rows(rows, plan: str = PLAN, cells=None):
    """``{(scheme, depth, positions): [rows of the plan's recipe, by seed]}`` for every cell
    of ``cells`` (default: the plan's); a cell without rows maps to ``[]``."""
    args = plan_args(plan)
    cells = plan_cells(plan) if cells is None else cells
    by_key = {r["key"]: r for r in rows}
    out = {}
    for scheme, depth, pos in cells:
        found = [r for r in by_key.values() if r["scheme"] == scheme and r["depth"] == depth
                 and r["positions"] == pos
                 and r["key"] == run_key(scheme, depth, r["seed"], args, pos)]
        out[scheme, depth, pos] = sorted(found, key=lambda r: int(r["seed"]))
    return out


def _finite(values):
    out = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            out.append(x)
    return out


def mean_std(values):
    """``(mean, sample std or None, n)`` of the finite values; ``(None, None, 0)`` without."""
    xs = _finite(values)
    if not xs:
        return None, None, 0
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None), len(xs)


def fmt_mean(values, nd: int) -> str:
    m, s, n = mean_std(values)
    if m is None:
        return "-"
    return f"{m:.{nd}f}" + (f" +- {s:.{nd}f}" if s is not None else "")


#: bits per target token: a run whose source gain (``probe.py``: validation nll with another
#: sentence's source minus with its own) is below this translates without reading the source,
#: whatever its loss did. The line sits in the gap the study's runs show: every run below 1.5
#: bits (0 to 1.26) scored BLEU 7.3 or less with 1 to 787 different outputs for 1000 inputs,
#: every run above it (1.68 and up) BLEU 10 or more.
SOURCE_BLIND_BITS = 1.5
SOURCE_BLIND = "ignores the source"


def failure(r) -> str:
    """Why a run failed ('' if it trained): its status, or ``SOURCE_BLIND`` for a run the
    status rule calls trained whose recorded source gain is under ``SOURCE_BLIND_BITS``."""
    if r["status"] != "trained":
        return r["status"]
    gain = r.get("source_gain") or ""
    return SOURCE_BLIND if gain and float(gain) < SOURCE_BLIND_BITS else ""


def failures(rs) -> str:
    """The runs that failed, counted by ``failure`` (``none`` when every run trained)."""
    bad = Counter(f for f in map(failure, rs) if f)
    return ", ".join(f"{n} {why}" for why, n in sorted(bad.items())) or "none"


def fewest_distinct(rs) -> str:
    """The fewest different test translations among the runs that recorded them ('-' if
    none did)."""
    counts = [int(r["distinct_hyps"]) for r in rs
              if str(r.get("distinct_hyps") or "").isdigit()]
    return str(min(counts)) if counts else "-"


def most_collapsed(rs) -> str:
    """The highest encoder cos (``depthstudy.probe``: mean cosine between the encoder outputs
    of two different source tokens) among the runs that recorded it ('-' if none did)."""
    values = [float(r["encoder_cos"]) for r in rs if r.get("encoder_cos")]
    return f"{max(values):.2f}" if values else "-"


def speed_key(r):
    """A speed row's measurement, whatever run made it."""
    return (r["kind"], r["scheme"], r["shape"], r["engine"], r["precision"], r["batch"],
            r["threads"])


class Speed:
    """A deploy-speed CSV's rows (in run order: ``deploy_speed.py`` appends each run's):
    :meth:`get` gives a measurement's row of the latest run that made it, :meth:`base` the
    6L-6L row of a row's own run."""

    def __init__(self, rows=()):
        self.rows = list(rows)
        self.latest = {speed_key(r): r for r in self.rows}
        self.in_run = {(r.get("run", ""), *speed_key(r)): r for r in self.rows}

    def get(self, scheme: str, shape: str, key, kind: str = "cells"):
        return self.latest.get((kind, scheme, shape, *key))

    def base(self, row):
        """The 6L-6L row of ``row``'s run, kind, scheme and engine settings (None without)."""
        kind, scheme, _, *settings = speed_key(row)
        return self.in_run.get((row.get("run", ""), kind, scheme, "6L-6L", *settings))


def read_speed(path: Path) -> Speed:
    """The rows of a deploy-speed CSV (none without the file)."""
    if not path.is_file():
        return Speed()
    with open(path, newline="") as fh:
        return Speed(csv.DictReader(fh))


def cell_speed(speed: Speed, scheme: str, shape: str):
    """``(row, engine key)`` for the figure and the fastest line: X_SPEED, else X_FALLBACK (a
    scheme the export refuses), each of the latest run that timed it; ``(None, None)``
    without either."""
    for key in (X_SPEED, X_FALLBACK):
        r = speed.get(scheme, shape, key)
        if r is not None:
            return r, key
    return None, None


def cell_ratio(row):
    """The row's ``ratio_to_6l6l`` (its speed over its scheme's 6L-6L with the same engine
    settings, timed in the same run); None where that run timed no such 6L-6L: rows of
    different runs are never divided (the machine's speed drifts between runs)."""
    return float(row["ratio_to_6l6l"]) if row and row.get("ratio_to_6l6l") else None


def bleu_gap(speed: Speed, row):
    """The timed model's BLEU minus that of the 6L-6L its ratio divides by (the two rows'
    ``bleu``: the timed outputs' own sacreBLEU); None without that 6L-6L or a BLEU."""
    base = speed.base(row) if row else None
    if not base or not row.get("bleu") or not base.get("bleu"):
        return None
    return float(row["bleu"]) - float(base["bleu"])


def timed_failure(rs, row) -> str:
    """Why the cell's timed model failed ('' if it trained): :func:`failure` of the study row
    of the seed ``row`` timed, else the speed row's own status."""
    own = [r for r in rs if str(r["seed"]) == str(row.get("seed", ""))]
    if own:
        return failure(own[0])
    status = row.get("train_status") or ""
    return "" if status in ("", "trained", "untrained") else status


def _ranked(groups, speed, near):
    """``(timed, failed, ranked)`` of the ``near`` cells: those with a speed, those whose
    timed model failed, and ``(ratio to 2 decimals, cell, row, key)`` of the trained ones
    whose run timed their scheme's 6L-6L."""
    timed, failed, ranked = [], [], []
    for c in near:
        row, key = cell_speed(speed, c[0], c[1])
        if row is None:
            continue
        timed.append(c)
        if timed_failure(groups[c], row):
            failed.append(c)
        elif cell_ratio(row) is not None:
            ranked.append((round(cell_ratio(row), 2), c, row, key))
    return timed, failed, ranked


def fastest_line(groups, speed: Speed) -> str:
    """The fastest cell whose mean BLEU is within BLEU_MARGIN of the best cell's, ranked by
    the within-run ratio to its scheme's 6L-6L (:func:`cell_ratio`; equal to two decimals is
    a tie); the BLEU it gives up is the timed models' own (:func:`bleu_gap`)."""
    means = {c: mean_std(r["bleu"] for r in rs)[0] for c, rs in groups.items()}
    means = {c: m for c, m in means.items() if m is not None}
    if not means:
        return "No cell has a BLEU score yet."
    best = max(means, key=lambda c: means[c])
    near = [c for c in means if means[c] >= means[best] - BLEU_MARGIN]
    head = (f"Best model of the study (mean BLEU over seeds): {best[0]} {best[1]}, "
            f"{means[best]:.2f}. ")
    timed, failed, ranked = _ranked(groups, speed, near)
    if not timed:
        return head + (f"None of the {len(near)} cells within {BLEU_MARGIN} BLEU of it has a "
                       "deployed speed yet, so no fastest model is named.")
    left = (f"; {len(failed)} left out, their timed model failed" if failed else "")
    if not ranked:
        return head + (f"None of the {len(timed)} timed cells within {BLEU_MARGIN} BLEU of it "
                       "was timed beside its scheme's 6L-6L in one run, so no fastest model "
                       f"is named (speeds of different runs are not compared{left}).")
    top = max(r[0] for r in ranked)
    tied = [r for r in ranked if r[0] == top]
    if len({r[2].get("run", "") for r in tied}) == 1:  # one run: its speeds compare
        tied = [max(tied, key=lambda r: float(r[2]["sentences_per_s"]))]
    named = " and ".join(
        f"**{c[0]} {c[1]}** (mean BLEU {means[c]:.2f}; {float(row['sentences_per_s']):.1f} "
        f"sentences/s, {_engine_label(key)}, run {row.get('run') or '-'})"
        for _, c, row, key in tied)
    text = (head + f"Fastest within {BLEU_MARGIN} BLEU of it by the speed ratio to its "
            f"scheme's 6L-6L in the same timing run ({len(near)} cells qualify, {len(timed)} "
            f"timed, {len(ranked)} beside their 6L-6L{left}): {named}")
    if len(tied) > 1:
        text += (f", tied at {top:.2f} times their 6L-6L; their runs differ, and speeds of "
                 "different runs are not compared")
    if all(c[1] == "6L-6L" for _, c, _, _ in tied):
        return text + (f": no cell within {BLEU_MARGIN} BLEU runs faster than its scheme's "
                       "6L-6L.")
    if len(tied) > 1:
        return text + "."
    _, c, row, _ = tied[0]
    gap, base = bleu_gap(speed, row), speed.base(row)
    less = "" if gap is None else (
        f", for {abs(gap):.2f} BLEU {'less' if gap < 0 else 'more'} (the timed models: seed "
        f"{row['seed']} {float(row['bleu']):.2f} against 6L-6L seed {base['seed']} "
        f"{float(base['bleu']):.2f})")
    return text + f", {top:.2f} times the speed of {c[0]} 6L-6L in the same run{less}."


def _engine_label(key) -> str:
    engine, precision, batch, threads = key
    name = f"CTranslate2 {precision}" if engine == CT2 else "fairseq-generate with the plugin"
    return f"{name}, batch {batch}, {threads} thread{'s' if threads != '1' else ''}"


def _fallback_cell(r) -> str:
    """CTranslate2's fairseq last step in a row: sentences / seconds, or why there is none."""
    if r is None or not r.get("fallback_seconds"):
        return "-" if r is None else "not recorded"
    return "0" if r["fallback_sentences"] == "0" else \
        f"{r['fallback_sentences']} / {float(r['fallback_seconds']):.2f} s"


def _speed_table(rows, failed=None):
    """One line per (run, shape, scheme, engine, precision): sentences/s at batch 64 and ms
    per sentence at batch 1 for each thread count, the batch-64 1-thread ratio to 6L-6L (of
    the same run), and where any row has one, CTranslate2's fairseq last step at batch 64, 1
    thread. ``failed``: ``{(scheme, shape, seed): why}`` of the timed models that failed."""
    failed = failed or {}
    threads = sorted({r["threads"] for r in rows}, key=int)
    runs = list(dict.fromkeys(r.get("run", "") for r in rows))
    with_fallback = any(r["engine"] == CT2 and r.get("fallback_sentences", "") != "0"
                        for r in rows)
    # a batch of fixed-length shapes holds one output length: 64 is a cap, mean_batch what ran
    means = sorted({r["mean_batch"] for r in rows if r["batch"] == "64" and r.get("mean_batch")})
    b64 = f"batch cap 64 (mean {'/'.join(means)})" if means else "batch 64"
    cols = [f"{b64}, {t} thr: sent/s" for t in threads] + \
           [f"batch 1, {t} thr: ms/sent" for t in threads] + ["ratio to 6L-6L (batch 64, 1 thr)"]
    cols += ["at the length limit: sentences / s (batch 64, 1 thr)"] if with_fallback else []
    lines = ["| shape | scheme | seed | engine | " + " | ".join(cols) + " | run |",
             "|---|---|---|---|" + "---:|" * len(cols) + "---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r.get("run", ""), r["shape"], r["scheme"], r["engine"],
                           r["precision"]), {})[r["batch"], r["threads"]] = r
    def order(item):
        run, shape, scheme, engine, precision = item[0]
        return _shape_order(shape), scheme, engine != PLUGIN, precision, runs.index(run)

    for (run, shape, scheme, engine, precision), g in sorted(groups.items(), key=order):
        any_row = next(iter(g.values()))
        vals = [g.get(("64", t)) for t in threads] + [g.get(("1", t)) for t in threads]
        cells = [f"{float(v['sentences_per_s']):.1f}" if v and i < len(threads) else
                 f"{float(v['ms_per_sentence']):.2f}" if v else "-" for i, v in enumerate(vals)]
        base = g.get(("64", "1"))
        cells.append((base or {}).get("ratio_to_6l6l") or "-")
        if with_fallback:
            cells.append(_fallback_cell(base) if engine == CT2 else "-")
        label = f"{engine} {precision}" if engine == CT2 else "fairseq + plugin"
        seed = any_row["seed"] or "-"
        why = failed.get((scheme, shape, seed))
        if why:
            seed += f" (failed: {why})"
        elif any_row.get("train_status") not in (None, "", "trained", "untrained"):
            seed += f" ({any_row['train_status']})"  # no seed of the cell trained
        lines.append(f"| {shape} | {scheme} | {seed} | {label} | " + " | ".join(cells) +
                     f" | {run or '-'} |")
    return lines


def warmup_cells(rows):
    """``{(scheme, depth, positions): [rows]}`` at the warmup plan's recipe: its own cells and
    the 24L-3L reference pair; ``{}`` when no cell of the plan itself has a row."""
    cells = plan_cells(WARMUP_PLAN)
    own = cell_rows(rows, WARMUP_PLAN, cells)
    if not any(own.values()):
        return {}
    # the reference pair is --plan admin-warmup's schemes (no Post-LN 24L-3L was run there)
    schemes = list(dict.fromkeys(s for s, _, _, _ in PLANS["admin-warmup"]))
    ref = [(s, WARMUP_REFERENCE, "sinusoidal") for s in schemes]
    return {**cell_rows(rows, WARMUP_PLAN, ref), **own}


def _recipe(args) -> str:
    return f"lr {args.lr:g}, warmup {args.warmup}, {args.max_update} updates"


def warmup_lines(wgroups, short):
    """The warmup plan's table: each cell at lr 1e-3 / warmup 2000 / 2400 updates beside the
    same cell at the demo recipe (``short``, rows by cell), and per shape the paper's Admin's
    distance to the closed form at both recipes."""
    if not wgroups:
        return []
    recipe, demo_recipe = _recipe(plan_args(WARMUP_PLAN)), _recipe(plan_args(PLAN))
    lines = ["", f"`--plan {WARMUP_PLAN}`: the paper's Admin and the closed form at the "
             f"longer warmup ({recipe}; the {WARMUP_REFERENCE} rows are `--plan "
             f"admin-warmup`'s, the same recipe), and stock Post-LN at 12L-1L (Kasai et al.'s "
             "scheme, which fails here at the demo recipe), beside the same cell at the demo "
             f"recipe ({demo_recipe}); `python benchmarks/depth_study.py --plan {WARMUP_PLAN} "
             "--out runs/depth_study --threads 1 --jobs 2`:", "",
             f"| shape | scheme | seeds | BLEU ({recipe}) | best valid nll (bits) | failures | "
             "distinct | BLEU at the demo recipe |",
             "|---|---|---|---|---|---|---:|---|"]
    order = ["admin-paper", "admin"]
    for (scheme, depth, pos), rs in sorted(wgroups.items(), key=lambda kv: (
            _shape_order(kv[0][1]), order.index(kv[0][0]) if kv[0][0] in order else 2)):
        same = short.get((scheme, depth, pos), [])
        demo_bleu = fmt_mean([x["bleu"] for x in same], 2) + (
            f" (seed{'s' if len(same) > 1 else ''} {','.join(x['seed'] for x in same)})"
            if same else "")
        if not rs:
            lines.append(f"| {depth} | {scheme} | - | not run yet | - | - | - | {demo_bleu} |")
            continue
        lines.append(f"| {depth} | {scheme} | {','.join(x['seed'] for x in rs)} | "
                     f"{fmt_mean([x['bleu'] for x in rs], 2)} | "
                     f"{fmt_mean([x['best_valid_nll'] for x in rs], 3)} | {failures(rs)} | "
                     f"{fewest_distinct(rs)} | {demo_bleu} |")
    lines.append("")
    for depth in sorted({c[1] for c in wgroups}, key=_shape_order):
        gaps = []
        for label, groups in ((recipe, wgroups), ("the demo recipe", short)):
            paper = mean_std(x["bleu"] for x in groups.get(("admin-paper", depth,
                                                               "sinusoidal"), []))[0]
            closed = mean_std(x["bleu"] for x in groups.get(("admin", depth,
                                                                "sinusoidal"), []))[0]
            gaps.append(f"{paper - closed:+.2f} at {label}" if None not in (paper, closed)
                        else f"not measured at {label}")
        lines.append(f"- {depth}: admin-paper minus admin, mean BLEU: {'; '.join(gaps)}.")
    return lines


def _cells_table(groups, speed: Speed):
    """The table of the plan's cells: BLEU, nll and failures over seeds, the timed model's
    speed (its run, the ratio to its 6L-6L, its BLEU minus that 6L-6L's), distinct, cos."""
    lines = [f"`--plan {PLAN}` (demo recipe; sacreBLEU on test2016, beam 4): "
             f"{sum(len(rs) for rs in groups.values())} of {len(PLANS[PLAN])} planned runs "
             "recorded. BLEU and best valid nll: mean +- sample std over the seeds recorded; "
             "failures: runs whose status is not `trained`, and runs whose decoder "
             f"{SOURCE_BLIND} (source gain under {SOURCE_BLIND_BITS} bits per token: their "
             "validation nll barely changes when each sentence is given another's source). "
             f"Deployed: sentences/s of the cell's timed model (one seed), {X_LABEL} "
             "(fairseq-generate with the plugin, batch 64, 1 thread, where the scheme cannot "
             "be exported), from the latest timing run that timed it; ratio: over its "
             "scheme's 6L-6L timed in the same run (- where that run timed none); BLEU vs "
             "6L-6L: the timed model's BLEU minus that 6L-6L model's; (failed): the timed "
             "model failed, so its speed is not the shape's. Distinct: the fewest different "
             "translations of the 1000 test sentences over the seeds (a few hundred or less: "
             "the decoder ignores most of the source, whatever the status says). Encoder "
             "cos: the highest over the seeds probed of the mean cosine between the encoder "
             "outputs of two different source tokens (200 validation sentences; 1: a "
             "collapsed encoder that gives the decoder one vector whatever the source).", "",
             "| shape | scheme | seeds | n | BLEU | best valid nll (bits) | failures | "
             "deployed sentences/s | run | ratio to 6L-6L | BLEU vs 6L-6L | distinct | "
             "encoder cos |",
             "|---|---|---|---:|---|---|---|---:|---|---:|---:|---:|---:|"]
    for (scheme, depth, _pos), rs in groups.items():
        row, key = cell_speed(speed, scheme, depth)
        shown = "-" if row is None else f"{float(row['sentences_per_s']):.1f}" + (
            "" if key == X_SPEED else " (plugin)") + (
            " (failed)" if timed_failure(rs, row) else "")
        ratio, gap = cell_ratio(row), bleu_gap(speed, row)
        timing = (f"{shown} | {(row or {}).get('run') or '-'} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} | "
                  f"{'-' if gap is None else f'{gap:+.2f}'}")
        if not rs:
            lines.append(f"| {depth} | {scheme} | - | 0 | not run yet | - | - | {timing} | - "
                         "| - |")
            continue
        lines.append(f"| {depth} | {scheme} | {','.join(r['seed'] for r in rs)} | {len(rs)} | "
                     f"{fmt_mean([r['bleu'] for r in rs], 2)} | "
                     f"{fmt_mean([r['best_valid_nll'] for r in rs], 3)} | {failures(rs)} | "
                     f"{timing} | {fewest_distinct(rs)} | {most_collapsed(rs)} |")
    return lines


def failed_timed(groups, speed_rows):
    """``{(scheme, shape, seed): why}`` of every timed model that failed."""
    by_cell = {(s, d): rs for (s, d, _), rs in groups.items()}
    found = [(r, timed_failure(by_cell.get((r["scheme"], r["shape"]), []), r))
             for r in speed_rows]
    return {(r["scheme"], r["shape"], r["seed"]): why for r, why in found if why}


def _speed_lines(groups, speed_rows, figure: bool):
    """The per-row speed table of the cells, what it leaves out, the figure."""
    if not speed_rows:
        return ["Deployed speed: not measured yet (`" + COMMANDS[1] + "`)."]
    failed = failed_timed(groups, speed_rows)
    cpu = sorted({r["cpu"] for r in speed_rows})
    rounds = sorted({r["rounds"] for r in speed_rows}, key=int)
    refused = sorted({f"{r['scheme']} ({r['note']})" for r in speed_rows
                      if r["engine"] == PLUGIN and "not exported" in r["note"]})
    lines = ["Deployed speed (the cells table's column: one seed's model each; test2016, beam 4, "
             f"length penalty 0.6, median of {'/'.join(rounds)} round(s) in rotating order; "
             f"{'; '.join(cpu)}). Every engine, precision, batch size and thread count of each "
             f"timing run (`run`, docs/deployment.md), with its ratio over the 6L-6L of the same "
             f"scheme in that run: [{CELLS_CSV}]({CELLS_CSV})."]
    if refused:
        lines += ["", "Plugin speed only (CTranslate2 export refused): " +
                  "; ".join(refused) + "."]
    if failed:
        names = ", ".join(sorted({f"{s} {d}" for s, d, _ in failed}))
        lines += ["", f"Failed timed models ({names}): their speed is what they emit, mostly "
                  "to the length limit, and CTranslate2's time holds `translate`'s fairseq last "
                  "step for every sentence that reaches the limit (a second beam search and one "
                  "`score_batch` call each; the CSV's `fallback_*` columns where the run "
                  "recorded them). They are left out of the figure and the fastest line."]
    if figure:
        lines += ["", f"![speed against BLEU]({FIGURE}) x: {X_LABEL} (plugin where the "
                  "scheme cannot be exported; log scale; different timing runs, whose speeds "
                  "drift, in one picture); y: mean BLEU over seeds, error bars one sample std; "
                  "cells whose timed model failed left out."]
    return lines


def _shapes_lines(shape_rows):
    """The WMT-width shapes' table, with the batches they really ran."""
    if not shape_rows:
        return []
    mean64 = next((r["mean_batch"] for r in shape_rows if r["batch"] == "64"), "-")
    return ["", "The same shapes at WMT base width (d 512, FFN 2048, 8 heads, a joined "
            f"vocabulary of {shape_rows[0]['vocab']} symbols), CTranslate2: **untrained "
            "models with the output length held to each sentence's reference length** (min = "
            "max decoding length; the synthetic vocabulary and inputs are described in "
            "benchmarks/deployspeed/shapes.py), so the figures are the cost of the shape and "
            "not of what a model emits. A batch holds sentences of one output length only: "
            f"\"batch 64\" is a cap of 64, the batches it gave held {mean64} sentences on "
            f"average ({shape_rows[0]['sentences']} sentences). "
            f"{'; '.join(sorted({r['cpu'] for r in shape_rows}))}:", ""] + \
        _speed_table(shape_rows)


def block(groups, speed_rows, shape_rows, figure: bool, warmup=None, courses=()) -> str:
    """The markdown between the markers; ``warmup``: ``(warmup_cells(rows), the same cells'
    rows at the demo recipe)``, the warmup table's input, or None; ``courses``: the lines of
    ``courses.course_lines`` (the encoder token cosine while training), or none."""
    speed = Speed(speed_rows)
    lines = _cells_table(groups, speed)
    lines += ["", fastest_line(groups, speed), ""]
    lines += _speed_lines(groups, speed_rows, figure)
    lines += _shapes_lines(shape_rows)
    if warmup:
        lines += warmup_lines(*warmup)
    if courses:
        lines += [""] + list(courses)
    lines += ["", "Reproduce (the study, then the two speed runs, then this block; each "
              "timing run is merged into its CSV, docs/deployment.md lists the published "
              "runs' commands):", "", "```bash"] + COMMANDS + ["```"]
    return "\n".join(lines) + "\n"


def plot_points(groups, speed_rows):
    """One point per cell with a BLEU and a speed whose timed model trained: x the speed of
    :func:`cell_speed`, y the mean BLEU, yerr its sample std (0 for one seed)."""
    speed = Speed(speed_rows)
    points = []
    for (scheme, depth, _pos), rs in groups.items():
        m, s, n = mean_std(r["bleu"] for r in rs)
        row, key = cell_speed(speed, scheme, depth)
        if m is None or row is None or timed_failure(rs, row):
            continue
        points.append(dict(scheme=scheme, shape=depth, x=float(row["sentences_per_s"]), y=m,
                           yerr=s or 0.0, n=n, exported=key == X_SPEED))
    return points


def fill_block(text: str, rows, dest: Path, log=print) -> str:
    """``text`` (results.md) with the deep-shallow block rewritten from ``rows`` and the
    speed CSVs in ``dest`` (and the figure drawn there); unchanged without the markers or
    without a row of the plan."""
    if START not in text or END not in text:
        return text
    groups = cell_rows(rows)
    if not any(groups.values()):
        log(f"no rows of --plan {PLAN} yet: the deep-shallow block is left as it is")
        return text
    speed_rows = [r for r in read_speed(dest / CELLS_CSV).rows if r["kind"] == "cells"]
    shape_rows = read_speed(dest / SHAPES_CSV).rows
    figure = False
    if speed_rows:
        from .plot import write_speed_quality_plot

        figure = write_speed_quality_plot(plot_points(groups, speed_rows), dest / FIGURE,
                                          X_LABEL)
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    wgroups = warmup_cells(rows)
    warmup = (wgroups, cell_rows(rows, PLAN, list(wgroups))) if wgroups else None
    log(f"deep-shallow block: {sum(len(v) for v in groups.values())} runs"
        + (f", {sum(len(v) for v in wgroups.values())} at the warmup recipe" if wgroups else "")
        + (f", figure {dest / FIGURE}" if figure else ""))
    # every run logged with the monitor's enc_tok_cos, from the curves publish() copied into
    # dest (a study started again in a new folder keeps the earlier runs' courses)
    courses = course_lines(rows, lambda r: published_curve(dest, r) if r.get("curve_file")
                           else None, failure)
    body = block(groups, speed_rows, shape_rows, figure, warmup, courses)
    return f"{head}{START}\n{body}{END}{tail}"
