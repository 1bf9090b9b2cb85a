"""The 2025 placements in the docs: Peri-LN, Mix-LN and DyT (in Pre-LN, ``--plan norms-2025``;
in Post-, Peri- and Mix-LN, ``--plan norms-2025-dyt``) next to Admin, Pre-LN and Post-LN on the
study's deep cells (24L-3L, 12L-12L) at the demo schedule, and their training speed against
stock.

``--publish DIR`` (``publish.publish``) calls :func:`fill_block`: the block between
:data:`START` and :data:`END` of the result page that holds them (``DIR/results.md`` or a
``DIR/results-*.md``) is rewritten when either plan has a row
of its own schemes, and left as it is otherwise (also when the page lacks the markers). Every
figure in the block is computed here from the rows and from the JSON files that
``benchmarks/speed_vs_stock.py --json DIR/speed_norms_2025_<name>.json`` writes (one table per
file: words/s of each variant over stock's and over Pre-LN's, measured in one run).

The baselines are the demo-scale study's rows with the same recipe (a row already in
``results.csv`` is not run again), so ``admin`` is shown although the plan has no admin run:
the question is where each new scheme stands against Admin at depth. A run counts as failed by
``report.outcome``: its status, or a decoder that ignores the source (a source gain under the
line, or, never probed, one translation for every input).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .deepshallow import cell_rows, fewest_distinct, fmt_mean, mean_std
from .plan import PLANS
from .report import SOURCE_BLIND, SOURCE_BLIND_BITS, outcome

PLAN = "norms-2025"
#: the placements' grid, then DyT in the other placements (same recipe, same block)
PLAN_NAMES = (PLAN, "norms-2025-dyt")
START = "<!-- norms_2025 table: start -->"
END = "<!-- norms_2025 table: end -->"
SPEED_GLOB = "speed_norms_2025*.json"
#: shown first at each depth: the scheme the others are compared with, then the placements
#: the new ones sit between
BASELINES = ("admin", "pre-ln", "post-ln")
SPEED_COMMAND = (
    "python benchmarks/speed_vs_stock.py --data runs/depth_study/data/bin --preset tiny "
    "--variants admin,pre-ln,peri-ln,mix-ln,pre-ln-dyt --json docs/speed_norms_2025_tiny.json")
COMMANDS = [
    "python benchmarks/depth_study.py --plan norms-2025 --out runs/depth_study --threads 1 "
    "--jobs 2",
    "python benchmarks/depth_study.py --plan norms-2025-dyt --out runs/depth_study --threads 1 "
    "--jobs 2",
    SPEED_COMMAND,
    "python benchmarks/depth_study.py --plan norms-2025 --out runs/depth_study "
    "--report-only --publish docs",
]


def failures(rs) -> str:
    """The runs that failed, counted by ``report.outcome`` (``none`` when every run trained)."""
    bad = Counter(f for f in map(outcome, rs) if f)
    return ", ".join(f"{n} {why}" for why, n in sorted(bad.items())) or "none"


def plan_cells():
    """``(scheme, depth, positions)``: per depth of the plans (their order), the baselines,
    then the plans' other schemes in their order."""
    plan = [run for name in PLAN_NAMES for run in PLANS[name]]
    depths = list(dict.fromkeys(d for _, d, _, _ in plan))
    schemes = list(BASELINES) + [s for s in dict.fromkeys(s for s, _, _, _ in plan)
                                 if s not in BASELINES]
    return [(s, d, "sinusoidal") for d in depths for s in schemes]


def _speed_tables(files):
    """A table per speed JSON: words/s over stock and over Pre-LN for each variant and
    depth, from the file's own figures."""
    lines = []
    for path in files:
        summary = json.loads(path.read_text())
        hw, s = summary["hardware"], summary["settings"]
        where = (f"{hw.get('gpu')}" if summary["device"] == "cuda" else
                 f"{hw['cpu']}, {hw['cores']} cores, {s['threads']} thread(s)")
        lines += ["", f"Training speed (`{path.name}`; {where}, torch {hw['torch']}; d={s['dim']},"
                  f" max-tokens {s['max_tokens']}, {s['steps']} timed steps, medians; "
                  "fairseq's Trainer on the same batches):", "",
                  "| dtype | depth | variant | words/s | x stock | x pre-ln |",
                  "|---|---|---|---:|---:|---:|"]
        for res in summary["results"]:
            for layers in sorted({r["layers"] for r in res["rows"]}):
                rows = {r["variant"]: r for r in res["rows"] if r["layers"] == layers}
                stock, pre = rows.get("stock"), rows.get("pre-ln")
                for name, r in rows.items():
                    x = r["words_per_s"]
                    over = [f"{x / b['words_per_s']:.3f}" if b and x and b["words_per_s"]
                            else "-" for b in (stock, pre)]
                    lines.append(f"| {res['dtype']} | {layers}L-{layers}L | {name} | "
                                 f"{x:,.0f} | {over[0]} | {over[1]} |")
    return lines


def _standing(groups, depth):
    """Per depth: the schemes with a BLEU, best first, each with its mean's distance to
    Admin's."""
    means = {s: mean_std(r["bleu"] for r in rs) for (s, d, _), rs in groups.items()
             if d == depth}
    ranked = sorted(((m, s) for s, (m, _, _) in means.items() if m is not None), reverse=True)
    if not ranked:
        return None
    admin = means.get("admin", (None,))[0]
    parts = [f"{s} {m:.2f}" + (f" ({m - admin:+.2f})" if admin is not None and s != "admin"
                               else "") for m, s in ranked]
    return f"- {depth}, by mean BLEU (difference to admin's mean): " + ", ".join(parts) + "."


def block(groups, speed_files) -> str:
    """The markdown between the markers."""
    recorded = {(s, d, int(r["seed"])) for (s, d, _), rs in groups.items() for r in rs}
    counts = []
    for name in PLAN_NAMES:
        planned = {(s, d, seed) for s, d, seed, _ in PLANS[name]}
        counts.append(f"`--plan {name}` {len(planned & recorded)} of {len(planned)} planned "
                      "runs recorded")
    lines = [f"`--plan {PLAN}` (Peri-LN, Mix-LN, DyT in Pre-LN) and `--plan "
             f"{PLAN_NAMES[1]}` (DyT in the other placements), both at the demo schedule (d=128, "
             "700 updates, lr 2e-3, warmup 400; sacreBLEU on test2016, beam 4): "
             f"{'; '.join(counts)}; admin's rows (and pre-ln's, post-ln's where they exist) "
             "are the demo-scale study's runs with the same recipe. BLEU and best valid nll: "
             "mean +- sample std over the seeds recorded; failures: runs whose status is not "
             f"`trained`, and runs whose decoder {SOURCE_BLIND} (source gain under "
             f"{SOURCE_BLIND_BITS} bits per token or, not probed, one translation for every "
             "input); vs admin: the difference of the mean BLEU "
             "to admin's at the same depth; distinct: the fewest different translations of "
             "the 1000 test sentences over the seeds (a handful: the decoder ignores the "
             "source, whatever the status says).", "",
             "| depth | scheme | seeds | n | BLEU | best valid nll (bits) | failures | "
             "vs admin (BLEU) | distinct |", "|---|---|---|---:|---|---|---|---:|---:|"]
    admin_mean = {d: mean_std(r["bleu"] for r in rs)[0] for (s, d, _), rs in groups.items()
                  if s == "admin"}
    for (scheme, depth, _pos), rs in groups.items():
        if not rs:
            lines.append(f"| {depth} | {scheme} | - | 0 | not run yet | - | - | - | - |")
            continue
        m = mean_std(r["bleu"] for r in rs)[0]
        base = admin_mean.get(depth)
        vs = "-" if scheme == "admin" or m is None or base is None else f"{m - base:+.2f}"
        lines.append(f"| {depth} | {scheme} | {','.join(r['seed'] for r in rs)} | {len(rs)} | "
                     f"{fmt_mean([r['bleu'] for r in rs], 2)} | "
                     f"{fmt_mean([r['best_valid_nll'] for r in rs], 3)} | {failures(rs)} | "
                     f"{vs} | {fewest_distinct(rs)} |")
    depths = list(dict.fromkeys(d for _, d, _ in groups))
    standing = [line for line in (_standing(groups, d) for d in depths) if line]
    if standing:
        lines += ["", "Standing (computed from the table; a difference smaller than the cells' "
                  "seed std is not a ranking):", ""] + standing
    if speed_files:
        lines += _speed_tables(speed_files)
    else:
        lines += ["", "Training speed: no `speed_norms_2025*.json` next to this page yet (`"
                  + SPEED_COMMAND + "`)."]
    lines += ["", "Reproduce (the two studies, the speed run, then this block):", "",
              "```bash"] + COMMANDS + ["```"]
    return "\n".join(lines) + "\n"


def fill_block(text: str, rows, dest: Path, log=print) -> str:
    """``text`` (results.md) with the norms-2025 block rewritten from ``rows`` and the speed
    JSON files in ``dest``; unchanged without the markers or without a run of the plan's own
    schemes."""
    if START not in text or END not in text:
        return text
    groups = cell_rows(rows, PLAN, plan_cells())
    own = {s for name in PLAN_NAMES for s, _, _, _ in PLANS[name]} - set(BASELINES)
    if not any(rs for (s, _, _), rs in groups.items() if s in own):
        log(f"no rows of --plan {PLAN}'s or {PLAN_NAMES[1]}'s schemes yet: the norms-2025 "
            "block is left as it is")
        return text
    speed_files = sorted(dest.glob(SPEED_GLOB))
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    log(f"norms-2025 block: {sum(len(v) for v in groups.values())} runs, "
        f"{len(speed_files)} speed file(s)")
    return f"{head}{START}\n{block(groups, speed_files)}{END}{tail}"
