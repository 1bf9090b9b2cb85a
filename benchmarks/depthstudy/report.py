"""The study's results: the CSV (one row per run), the markdown table (summary over seeds,
every run, what is missing), and publishing them into the docs."""
from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from pathlib import Path

from .common import file_lock, parse_depth, relative
from .data import TGT
from .plan import POSITIONS, PRESETS, SCHEMES

CSV_FIELDS = [
    "key", "study", "scheme", "positions", "depth", "encoder_layers", "decoder_layers", "seed",
    "max_update",
    "embed_dim", "ffn_dim", "heads", "lr", "warmup", "max_tokens", "dropout",
    "status", "reason", "updates", "final_train_loss", "final_train_nll", "min_train_nll",
    "best_valid_loss", "best_valid_nll", "best_valid_ppl", "unigram_entropy_bits",
    "bleu", "bleu_signature", "distinct_hyps", "train_wall_s", "updates_per_s", "generate_wall_s",
    "threads", "cpu", "finished_utc", "study_command", "train_command",
    "generate_command", "curve_file", "final_shortcuts",
    # issue 22: omegas per sub-layer at initialisation and at the end, per-stack gradient
    # norms, and whether the decoder uses the source (depthstudy.probe)
    "init_omegas", "final_omegas", "gnorms", "probe_valid_nll", "valid_nll_other_source",
    "source_gain",
    # fairseq --clip-norm (rows written before this column: 0, the demo recipe's)
    "clip_norm",
    # issue 41: how alike the encoder makes different source tokens (depthstudy.probe)
    "encoder_cos", "encoder_cos_init", "encoder_cos_layers",
    # the validation / checkpoint interval when fixed ('' : max_update / 4), and the updates
    # a run was resumed or continued at (depthstudy.segments; '' : one process, no resume)
    "validate_every", "resumed_at",
]


def distinct_translations(hyp_file: Path) -> str:
    """How many different sentences the test translations are ("" without the file): a
    model that learned only the German side (a language model that ignores the source)
    passes the loss-based verdict but gives the same sentence for every input."""
    if not hyp_file.is_file():
        return ""
    return str(len(set(hyp_file.read_text().splitlines())))


def read_rows(path: Path):
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:  # rows written before a column existed
        for f in CSV_FIELDS:
            r.setdefault(f, "")
        if not r["distinct_hyps"] and r["curve_file"]:  # counted from the run if still there
            r["distinct_hyps"] = distinct_translations(
                path.parent / Path(r["curve_file"]).parent / f"test.hyp.{TGT}")
        for f in ("train_command", "generate_command", "study_command"):
            r[f] = relative(r[f], path.parent)
        r["study"] = r["study"] or f"d{r['embed_dim']}-{r['max_update']}upd"
        r["positions"] = r["positions"] or "sinusoidal"
    return rows


def append_row(path: Path, row) -> None:
    """Add ``row``; the file is rewritten (atomically) so older rows gain new columns. Two
    study processes may share one output folder (e.g. two learning rates at once): the
    read-and-rewrite holds an exclusive lock on ``results.csv.lock`` so no row is lost."""
    with csv_lock(path):
        write_rows(path, read_rows(path) + [row])


def csv_lock(path: Path):
    """An exclusive lock on ``<path>.lock`` for a read-and-rewrite of the CSV."""
    return file_lock(path.with_name(path.name + ".lock"))


def write_rows(path: Path, rows) -> None:
    """Write every row (atomically: a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def depth_order(depth: str):
    enc, dec = parse_depth(depth)
    return (enc + dec, enc)


SCHEME_ORDER = {s: i for i, s in enumerate(SCHEMES)}
POS_ORDER = {p: i for i, p in enumerate(POSITIONS)}
STUDY_TITLES = {
    "d128-700upd": "Demo scale: d=128, 700 updates (the `make demo` recipe)",
    "d64-200upd": "The first study: d=64, 200 updates (issue 6)",
    "d128-2400upd": "d=128, 2400 updates (issue 22's longer warmup, `--plan admin-warmup`)",
}


def _study_order(study: str):
    m = re.fullmatch(r"d(\d+)-(\d+)upd", study)
    return (-int(m.group(1)), -int(m.group(2))) if m else (0, 0)


def _row_order(r):
    return (_study_order(r["study"]), depth_order(r["depth"]),
            POS_ORDER.get(r["positions"], 99), SCHEME_ORDER.get(r["scheme"], 99),
            int(r["seed"]))


def _num(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _mean_spread(values, nd=2):
    """``mean +- sample std (min-max)`` of the finite values."""
    xs = [v for v in (_num(v) for v in values) if v is not None]
    if not xs:
        return "-"
    # + 0.0 after rounding: a source gain of -0.00001 is printed 0.000, not -0.000
    f = lambda x: f"{round(x, nd) + 0.0:.{nd}f}"  # noqa: E731
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return f(mean)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return f"{f(mean)} +- {f(std)} ({f(min(xs))}-{f(max(xs))})"


def recipe_label(r) -> str:
    """The row's scheme, with its learning rate and warmup when they are not those of its
    study's preset (or of the preset of its model size) and its gradient clipping when it
    has any (issue 22's schedule rows and issue 21's clipped rows must not be averaged with
    the preset's)."""
    changed = []
    # the study's preset, else the preset of the same model size (issue 22's longer warmup,
    # d=128 with 2400 updates, is compared with the demo's schedule)
    same = [p for p in PRESETS.values() if str(p["embed_dim"]) == r["embed_dim"]]
    preset = next((p for p in same if str(p["max_update"]) == r["max_update"]),
                  same[0] if same else None)
    if preset and (f"{preset['lr']:g}", str(preset["warmup"])) != (r["lr"], r["warmup"]):
        changed.append(f"lr {r['lr']}, warmup {r['warmup']}")
    if float(r["clip_norm"] or 0.0):
        changed.append(f"clip-norm {r['clip_norm']}")
    return f"{r['scheme']} ({', '.join(changed)})" if changed else r["scheme"]


def summary_lines(rows):
    """One line per (depth, positions, scheme and recipe): seeds, statuses, BLEU and valid
    nll as mean +- sample standard deviation (min-max) over the seeds, the distinct
    translations of each seed, and the mean source gain (``depthstudy.probe``)."""
    groups = {}
    for r in sorted(rows, key=_row_order):
        groups.setdefault((r["depth"], r["positions"], recipe_label(r)), []).append(r)
    lines = [
        "| depth | positions | scheme | seeds | status | BLEU mean +- std (min-max) | "
        "best valid nll (bits) mean +- std (min-max) | distinct translations | "
        "source gain (bits) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (depth, pos, scheme), rs in groups.items():
        statuses = Counter(r["status"] for r in rs)
        status = ", ".join(f"{n} {st}" for st, n in sorted(statuses.items()))
        lines.append(
            f"| {depth} | {pos} | {scheme} | {','.join(r['seed'] for r in rs)} | {status} | "
            f"{_mean_spread([r['bleu'] for r in rs])} | "
            f"{_mean_spread([r['best_valid_nll'] for r in rs], 3)} | "
            f"{', '.join(r['distinct_hyps'] or '-' for r in rs)} | "
            f"{_mean_spread([r.get('source_gain') for r in rs], 3)} |"
        )
    return lines


def _gnorm_cell(gnorms: str) -> str:
    g = json.loads(gnorms) if gnorms else {}
    if "enc_gnorm" not in g or "dec_gnorm" not in g:
        return "-"
    return "; ".join(f"{e:.2f} / {d:.2f}" if e is not None and d is not None else "-"
                     for e, d in zip(g["enc_gnorm"], g["dec_gnorm"]))


def _collapse_cell(r) -> str:
    if not r.get("encoder_cos"):
        return "-"
    init = f"{float(r['encoder_cos_init']):.3f}" if r.get("encoder_cos_init") else "-"
    return f"{init}; {float(r['encoder_cos']):.3f}"


def write_table(rows, path: Path, planned=()) -> None:
    """Per study: the summary over seeds, every row, and (for the running plan) the rows
    still missing; then the commands of every row."""
    rows = sorted(rows, key=_row_order)
    studies = sorted({r["study"] for r in rows}, key=_study_order)
    lines = []
    n = 0
    numbered = []
    for study in studies:
        rs = [r for r in rows if r["study"] == study]
        lines += [f"### {STUDY_TITLES.get(study, study)}", "",
                  "Summary over seeds:", ""] + summary_lines(rs)
        lines += [
            "", "Every run:", "",
            "| # | depth | positions | scheme | seed | updates | status | final train nll (bits) | "
            "best valid nll (bits) / ppl | BLEU | distinct translations | source gain (bits) | "
            "encoder cos (init; trained) | grad norm enc / dec (warmup; after) | "
            "final shortcut weights / position scale | train wall (s) | updates/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rs:
            n += 1
            numbered.append(r)
            shortcuts = json.loads(r["final_shortcuts"]) if r["final_shortcuts"] else {}
            shown = "; ".join(
                f"{k} " + ("/".join(f"{x:g}" for x in v) if isinstance(v, list) else f"{v:g}")
                for k, v in sorted(shortcuts.items())) or "-"
            lines.append(
                f"| {n} | {r['depth']} | {r['positions']} | {recipe_label(r)} | {r['seed']} | "
                f"{r['updates']} | **{r['status']}** | {r['final_train_nll']} | "
                f"{r['best_valid_nll']} / {r['best_valid_ppl']} | {r['bleu'] or '-'} | "
                f"{r['distinct_hyps'] or '-'} | {_mean_spread([r['source_gain']], 4)} | "
                f"{_collapse_cell(r)} | {_gnorm_cell(r['gnorms'])} | {shown} | "
                f"{r['train_wall_s']} | {r['updates_per_s']} |"
            )
        missing = [m for m in planned if m[0] == study]
        if missing:
            lines += ["", f"Still missing from the plan ({len(missing)} runs): " + ", ".join(
                f"{scheme} {depth} seed {seed}" + ("" if pos == "sinusoidal" else f" ({pos})")
                for _, scheme, depth, seed, pos in missing) + "."]
        lines.append("")
    ents = sorted({r["unigram_entropy_bits"] for r in rows})
    sigs = sorted({r["bleu_signature"] for r in rows if r["bleu_signature"]})
    lines += [f"Unigram entropy of the German training side: {', '.join(ents)} bits/token.",
              f"sacreBLEU signature: {'; '.join(sigs) or '-'}", "",
              "Omega columns: mean/min/max over every omega entry of the stack after the last "
              "update; position scale: the learned scalar of the scaled sinusoid. Source gain: "
              "validation nll with each sentence given the next sentence's source minus the "
              "nll with its own (about 0: the decoder ignores the source; benchmarks/"
              "depthstudy/probe.py). Grad norm: the training monitor's encoder / decoder "
              "gradient norms, mean over the warmup updates; after them. Distinct "
              "translations: different sentences among the test set's translations (1 means "
              "the same sentence for every source: the model ignores the source; '-' where "
              "the run's translations were lost).", "",
              "Commands per row:", ""]
    for i, r in enumerate(numbered, 1):
        lines.append(f"{i}. `{r['study_command']}`  \n   train: `{r['train_command']}`  \n"
                     f"   status reason: {r['reason']}")
    path.write_text("\n".join(lines) + "\n")


def published_curve(dest: Path, row) -> Path:
    """Where ``--publish DEST`` keeps a row's curve, so that a study started again in a new
    output folder still draws the rows recorded before: ``DEST/depth_study_curves/<run>.json``."""
    return dest / "depth_study_curves" / f"{Path(row['curve_file']).parent.name}.json"


def curve_path(out: Path, row, published: Path) -> Path | None:
    """The row's ``curve.json`` under ``out``, else its published copy, else None."""
    for path in (out / row["curve_file"], published_curve(published, row)):
        if path.is_file():
            return path
    return None


TABLE_START = "<!-- depth_study table: start -->"
TABLE_END = "<!-- depth_study table: end -->"
