"""Issue 41's answer in the docs: the deep-shallow plan's cells (BLEU and validation nll over
seeds, failures), their deployed speed (``benchmarks/deploy_speed.py --study-out``), the
untrained WMT-base shapes' speed (``--wmt-shapes``), the speed-quality figure, the line
naming the fastest model within 0.5 BLEU of the best, and the paper's Admin at issue 22's
longer warmup (``--plan deep-shallow-warmup``) beside the same cells at the demo recipe.

``--publish DIR`` (``publish.publish``) calls :func:`fill_block`: the block between
:data:`START` and :data:`END` of ``DIR/results.md`` is rewritten when the plan has rows, and
left as it is otherwise (also when the page lacks the markers). The speed parts and the figure
``DIR/deep_shallow_speed_quality.png`` need ``DIR/deploy_speed_cells.csv``; the WMT shapes
table needs ``DIR/deploy_speed_shapes.csv``. Every figure the block states is computed here
from those rows.
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
#: the paper's Admin at issue 22's longer warmup in the 1-layer-decoder cells (plan.py)
WARMUP_PLAN = "deep-shallow-warmup"
#: the same recipe's deep encoder with a 3-layer decoder (``--plan admin-warmup``, issue 22),
#: where the longer warmup is known to make the paper's Admin train
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
    "python benchmarks/deploy_speed.py --study-out runs/depth_study --plan deep-shallow "
    "--csv docs/deploy_speed_cells.csv",
    "python benchmarks/deploy_speed.py --wmt-shapes --text runs/depth_study/data/spm "
    "--csv docs/deploy_speed_shapes.csv",
    "python benchmarks/depth_study.py --plan deep-shallow --out runs/depth_study "
    "--report-only --publish docs",
]


def plan_args(plan: str) -> argparse.Namespace:
    """The recipe a plan's runs were keyed with: the demo preset, the plan's own recipe,
    the study's defaults for the rest (``depth_study.py`` without extra flags)."""
    recipe = dict(PRESETS["demo"], **PLAN_RECIPES.get(plan, {}))
    return argparse.Namespace(**recipe, dropout=0.1, vocab=8000, clip_norm=0.0)


#: the issue's order of the shapes (others after them, by total depth)
SHAPES = ("6L-6L", "12L-3L", "12L-1L", "24L-1L", "48L-1L")


def plan_cells(plan: str):
    """``(scheme, depth, positions)`` of the plan, each once: shapes in the issue's order,
    schemes in the plan's order."""
    cells = list(dict.fromkeys((s, d, p) for s, d, _, p in PLANS[plan]))
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


def read_speed(path: Path):
    """``{(kind, scheme, shape, engine, precision, batch, threads): row}`` of a deploy-speed
    CSV ({} without the file)."""
    if not path.is_file():
        return {}
    with open(path, newline="") as fh:
        return {(r["kind"], r["scheme"], r["shape"], r["engine"], r["precision"], r["batch"],
                 r["threads"]): r for r in csv.DictReader(fh)}


def cell_speed(speed, scheme: str, shape: str):
    """``(sentences/s, the engine key used)`` for the figure and the fastest line: X_SPEED,
    else X_FALLBACK (a scheme the export refuses); ``(None, None)`` without either."""
    for key in (X_SPEED, X_FALLBACK):
        r = speed.get(("cells", scheme, shape, *key))
        if r is not None:
            return float(r["sentences_per_s"]), key
    return None, None


def cell_ratio(speed, scheme: str, shape: str):
    """The cell's deployed speed (:func:`cell_speed`) over its scheme's 6L-6L with the same
    engine, as one timing run measured both: the row's ``ratio_to_6l6l``, so that cells timed
    in a later run (the machine's speed drifts by 10% and more between runs) are not divided
    by an earlier run's 6L-6L; the two rows' division where the CSV has no ratio. None
    without a 6L-6L row of the same engine."""
    x, key = cell_speed(speed, scheme, shape)
    base, base_key = cell_speed(speed, scheme, "6L-6L")
    if x is None or base is None or key != base_key:
        return None
    own = speed[("cells", scheme, shape, *key)].get("ratio_to_6l6l")
    return float(own) if own else x / base


def fastest_line(groups, speed) -> str:
    """The fastest cell (by :func:`cell_speed`) whose mean BLEU is within BLEU_MARGIN of the
    best cell's mean BLEU, with its speed ratio to 6L-6L of the same scheme."""
    means = {c: mean_std(r["bleu"] for r in rs)[0] for c, rs in groups.items()}
    means = {c: m for c, m in means.items() if m is not None}
    if not means:
        return "No cell has a BLEU score yet."
    best = max(means, key=lambda c: means[c])
    near = [c for c in means if means[c] >= means[best] - BLEU_MARGIN]
    timed = [(cell_speed(speed, c[0], c[1]), c) for c in near]
    timed = [(x, key, c) for (x, key), c in timed if x is not None]
    head = (f"Best model of the study (mean BLEU over seeds): {best[0]} {best[1]}, "
            f"{means[best]:.2f}. ")
    if not timed:
        return head + (f"None of the {len(near)} cells within {BLEU_MARGIN} BLEU of it has a "
                       "deployed speed yet, so no fastest model is named.")
    x, key, c = max(timed, key=lambda t: t[0])
    how = _engine_label(key)
    value = cell_ratio(speed, c[0], c[1])
    if value is not None:
        ratio = f"{value:.2f} times the speed of {c[0]} 6L-6L in the same timing run"
    elif cell_speed(speed, c[0], "6L-6L")[0] is None:
        ratio = f"{c[0]} 6L-6L has no deployed speed, so no ratio is given"
    else:  # cell_ratio's only other None: the 6L-6L was timed with another engine
        ratio = f"{c[0]} 6L-6L was timed with another engine, so no ratio is given"
    return (head + f"Fastest within {BLEU_MARGIN} BLEU of it ({len(near)} cells qualify, "
            f"{len(timed)} of them timed): **{c[0]} {c[1]}**, mean BLEU {means[c]:.2f}, "
            f"{x:.1f} sentences/s ({how}), {ratio}.")


def _engine_label(key) -> str:
    engine, precision, batch, threads = key
    name = f"CTranslate2 {precision}" if engine == CT2 else "fairseq-generate with the plugin"
    return f"{name}, batch {batch}, {threads} thread{'s' if threads != '1' else ''}"


def _speed_table(rows):
    """One line per (shape, scheme, engine, precision): sentences/s at batch 64 and ms per
    sentence at batch 1 for each thread count, and the batch-64 1-thread ratio to 6L-6L."""
    threads = sorted({r["threads"] for r in rows}, key=int)
    cols = [f"batch 64, {t} thr: sent/s" for t in threads] + \
           [f"batch 1, {t} thr: ms/sent" for t in threads]
    lines = ["| shape | scheme | seed | engine | " + " | ".join(cols) +
             " | ratio to 6L-6L (batch 64, 1 thr) |",
             "|---|---|---|---|" + "---:|" * (len(cols) + 1)]
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["scheme"], r["engine"], r["precision"]), {})[
            r["batch"], r["threads"]] = r
    order = lambda k: (_shape_order(k[0]), k[1], k[2] != PLUGIN, k[3])  # noqa: E731
    for (shape, scheme, engine, precision), g in sorted(groups.items(), key=lambda kv:
                                                        order(kv[0])):
        any_row = next(iter(g.values()))
        vals = [g.get(("64", t)) for t in threads] + [g.get(("1", t)) for t in threads]
        cells = [f"{float(v['sentences_per_s']):.1f}" if v and i < len(threads) else
                 f"{float(v['ms_per_sentence']):.2f}" if v else "-" for i, v in enumerate(vals)]
        base = g.get(("64", "1"))
        label = f"{engine} {precision}" if engine == CT2 else "fairseq + plugin"
        seed = any_row["seed"] or "-"
        if any_row.get("train_status") not in (None, "", "trained", "untrained"):
            seed += f" ({any_row['train_status']})"  # no seed of the cell trained
        lines.append(f"| {shape} | {scheme} | {seed} | {label} | "
                     + " | ".join(cells) + f" | {(base or {}).get('ratio_to_6l6l') or '-'} |")
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
    lines = ["", f"`--plan {WARMUP_PLAN}`: the paper's Admin and the closed form at issue 22's "
             f"longer warmup ({recipe}; the {WARMUP_REFERENCE} rows are `--plan "
             f"admin-warmup`'s, the same recipe), and stock Post-LN at 12L-1L (Kasai et al.'s "
             "scheme, which fails here at the demo recipe), beside the same cell at the demo "
             f"recipe ({demo_recipe}); `python benchmarks/depth_study.py --plan {WARMUP_PLAN} --out "
             "runs/depth_study --threads 1 --jobs 2`:", "",
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


def block(groups, speed_rows, shape_rows, figure: bool, warmup=None, courses=()) -> str:
    """The markdown between the markers; ``warmup``: ``(warmup_cells(rows), the same cells'
    rows at the demo recipe)``, the warmup table's input, or None; ``courses``: the lines of
    ``courses.course_lines`` (the encoder token cosine while training), or none."""
    speed = {(r["kind"], r["scheme"], r["shape"], r["engine"], r["precision"], r["batch"],
              r["threads"]): r for r in speed_rows}
    n_runs = sum(len(rs) for rs in groups.values())
    n_planned = len(PLANS[PLAN])
    lines = [f"`--plan {PLAN}` (demo recipe; sacreBLEU on test2016, beam 4): {n_runs} of "
             f"{n_planned} planned runs recorded. BLEU and best valid nll: mean +- sample "
             "std over the seeds recorded; failures: runs whose status is not `trained`, and "
             f"runs whose decoder {SOURCE_BLIND} (source gain under {SOURCE_BLIND_BITS} bits "
             "per token: their validation nll barely changes when each sentence is given another's "
             "source). "
             f"Deployed: sentences/s of the cell's timed model, {X_LABEL} "
             "(fairseq-generate with the plugin, batch 64, 1 thread, where the scheme cannot "
             "be exported). Distinct: the fewest different translations of the 1000 test "
             "sentences over the seeds (a few hundred or less: the decoder ignores most of the "
             "source, whatever the status says). Encoder cos: the highest over the seeds "
             "probed of the mean cosine between the encoder outputs of two different source "
             "tokens (200 validation sentences; 1: a collapsed encoder that gives the decoder "
             "one vector whatever the source).", "",
             "| shape | scheme | seeds | n | BLEU | best valid nll (bits) | failures | "
             "deployed sentences/s | ratio to 6L-6L | distinct | encoder cos |",
             "|---|---|---|---:|---|---|---|---:|---:|---:|---:|"]
    for (scheme, depth, _pos), rs in groups.items():
        x, key = cell_speed(speed, scheme, depth)
        shown = "-" if x is None else f"{x:.1f}" + ("" if key == X_SPEED else " (plugin)")
        own = cell_ratio(speed, scheme, depth)
        ratio = "-" if own is None else f"{own:.2f}"
        if not rs:
            lines.append(f"| {depth} | {scheme} | - | 0 | not run yet | - | - | {shown} | "
                         f"{ratio} | - | - |")
            continue
        lines.append(f"| {depth} | {scheme} | {','.join(r['seed'] for r in rs)} | {len(rs)} | "
                     f"{fmt_mean([r['bleu'] for r in rs], 2)} | "
                     f"{fmt_mean([r['best_valid_nll'] for r in rs], 3)} | {failures(rs)} | "
                     f"{shown} | {ratio} | {fewest_distinct(rs)} | {most_collapsed(rs)} |")
    lines += ["", fastest_line(groups, speed), ""]
    if speed_rows:
        cpu = sorted({r["cpu"] for r in speed_rows})
        refused = sorted({f"{r['scheme']} ({r['note']})" for r in speed_rows
                          if r["engine"] == PLUGIN and "not exported" in r["note"]})
        lines += ["Deployed speed of every cell (one seed's model each; test2016, beam 4, "
                  f"length penalty 0.6, median of {speed_rows[0]['rounds']} rounds in rotating "
                  f"order; {'; '.join(cpu)}):", ""] + _speed_table(speed_rows)
        if refused:
            lines += ["", "Plugin speed only (CTranslate2 export refused): " +
                      "; ".join(refused) + "."]
        if figure:
            lines += ["", f"![speed against BLEU]({FIGURE}) x: {X_LABEL} (plugin where the "
                      "scheme cannot be exported; log scale); y: mean BLEU over seeds, error "
                      "bars one sample std."]
    else:
        lines += ["Deployed speed: not measured yet (`" + COMMANDS[1] + "`)."]
    if shape_rows:
        lines += ["", "The same shapes at WMT base width (d 512, FFN 2048, 8 heads, a joined "
                  f"vocabulary of {shape_rows[0]['vocab']} symbols), CTranslate2: **untrained "
                  "models with the output length held to each sentence's reference length** "
                  "(min = max decoding length; the synthetic vocabulary and inputs are described "
                  "in benchmarks/deployspeed/shapes.py), so the figures are the cost of the "
                  "shape and not of what a model emits; batches hold one output length (mean "
                  "size at batch 64: "
                  f"{next((r['mean_batch'] for r in shape_rows if r['batch'] == '64'), '-')}). "
                  f"{'; '.join(sorted({r['cpu'] for r in shape_rows}))}:", ""]
        lines += _speed_table(shape_rows)
    if warmup:
        lines += warmup_lines(*warmup)
    if courses:
        lines += [""] + list(courses)
    lines += ["", "Reproduce (the study, then the two speed runs, then this block):", "",
              "```bash"] + COMMANDS + ["```"]
    return "\n".join(lines) + "\n"


def plot_points(groups, speed_rows):
    """One point per cell with a BLEU and a speed: x the speed of :func:`cell_speed`, y the
    mean BLEU, yerr its sample std (0 for one seed)."""
    speed = {(r["kind"], r["scheme"], r["shape"], r["engine"], r["precision"], r["batch"],
              r["threads"]): r for r in speed_rows}
    points = []
    for (scheme, depth, _pos), rs in groups.items():
        m, s, n = mean_std(r["bleu"] for r in rs)
        x, key = cell_speed(speed, scheme, depth)
        if m is None or x is None:
            continue
        points.append(dict(scheme=scheme, shape=depth, x=x, y=m, yerr=s or 0.0, n=n,
                           exported=key == X_SPEED))
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
    speed_rows = [r for r in read_speed(dest / CELLS_CSV).values() if r["kind"] == "cells"]
    shape_rows = list(read_speed(dest / SHAPES_CSV).values())
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
