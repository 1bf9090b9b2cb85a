"""The study's results: the CSV (one row per run, every figure of the run) and the markdown
summary that ``--publish`` puts into the docs (per study, headed by its schedule: each cell
over its seeds, and what is missing). Per-run detail stays in the CSV and the curves."""
from __future__ import annotations

import csv
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
    # diagnostics: omegas per sub-layer at initialisation and at the end, per-stack gradient
    # norms, and whether the decoder uses the source (depthstudy.probe)
    "init_omegas", "final_omegas", "gnorms", "probe_valid_nll", "valid_nll_other_source",
    "source_gain",
    # fairseq --clip-norm (rows written before this column: 0, the demo recipe's)
    "clip_norm",
    # how alike the encoder makes different source tokens (depthstudy.probe)
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
#: the preset a study's schedule is named after, when its model and schedule are that preset's
PRESET_NAMES = {"demo": "the demo schedule", "d64": "the first study's schedule"}


def _lr(value) -> str:
    """``0.002`` -> ``2e-3``; a value that is not a number as it is."""
    try:
        mant, exp = f"{float(value):.0e}".split("e")
    except ValueError:
        return str(value)
    return f"{mant}e{int(exp)}"


def study_title(rows) -> str:
    """A study's heading, naming its schedule: width, updates, and the learning rate and warmup
    of most of its rows (rows at another one are labelled in the scheme column), and the
    preset's name where they are a preset's (``d=128, 700 updates, lr 2e-3, warmup 400: the
    demo schedule``)."""
    r0 = rows[0]
    lr, warmup = Counter((r["lr"], r["warmup"]) for r in rows).most_common(1)[0][0]
    title = f"d={r0['embed_dim']}, {r0['max_update']} updates, lr {_lr(lr)}, warmup {warmup}"
    for key, preset in PRESETS.items():
        if (str(preset["embed_dim"]), str(preset["max_update"]), f"{preset['lr']:g}",
                str(preset["warmup"])) == (r0["embed_dim"], r0["max_update"], lr, warmup):
            return f"{title}: {PRESET_NAMES.get(key, key)}"
    return title


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
    study's preset (or of the preset of its model size), its gradient clipping when it has
    any and its validation interval when fixed (which picks checkpoint_best among other
    updates): rows at another schedule, with clipping or validated at other updates are never
    averaged together."""
    changed = []
    # the study's preset, else the preset of the same model size (d=128 with 2400 updates is
    # compared with the demo's schedule)
    same = [p for p in PRESETS.values() if str(p["embed_dim"]) == r["embed_dim"]]
    preset = next((p for p in same if str(p["max_update"]) == r["max_update"]),
                  same[0] if same else None)
    if preset and (f"{preset['lr']:g}", str(preset["warmup"])) != (r["lr"], r["warmup"]):
        changed.append(f"lr {r['lr']}, warmup {r['warmup']}")
    if float(r["clip_norm"] or 0.0):
        changed.append(f"clip-norm {r['clip_norm']}")
    if r.get("validate_every"):
        changed.append(f"valid every {r['validate_every']}")
    return f"{r['scheme']} ({', '.join(changed)})" if changed else r["scheme"]


#: bits per target token: a run whose source gain (``probe.py``: validation nll with another
#: sentence's source minus with its own) is below this translates without reading the source,
#: whatever its loss did (the line and the gap it sits in: docs/results.md, "What failed means")
SOURCE_BLIND_BITS = 1.5
SOURCE_BLIND = "ignores the source"


def outcome(r) -> str:
    """Why a run failed, '' if it trained: its status when that is not ``trained``; else
    ``SOURCE_BLIND`` when its source gain is under ``SOURCE_BLIND_BITS`` or, never probed, when
    it gives one translation for every test input (an output that is the same for every source
    cannot depend on it)."""
    if r["status"] != "trained":
        return r["status"]
    gain = _num(r.get("source_gain"))
    if gain is not None:
        return SOURCE_BLIND if gain < SOURCE_BLIND_BITS else ""
    return SOURCE_BLIND if str(r.get("distinct_hyps") or "") == "1" else ""


def outcomes(rs) -> str:
    """``2 trained, 1 ignores the source``: the runs counted by :func:`outcome`."""
    counts = Counter(outcome(r) or "trained" for r in rs)
    return ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))


def summary_lines(rows):
    """One line per (depth, positions, scheme and recipe): seeds, outcomes (:func:`outcome`),
    BLEU and valid nll as mean +- sample standard deviation (min-max) over the seeds, the
    distinct translations of each seed, and the mean source gain (``depthstudy.probe``)."""
    groups = {}
    for r in sorted(rows, key=_row_order):
        groups.setdefault((r["depth"], r["positions"], recipe_label(r)), []).append(r)
    lines = [
        "| depth | positions | scheme | seeds | outcome | BLEU | best valid nll (bits) | "
        "distinct translations | source gain (bits) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (depth, pos, scheme), rs in groups.items():
        lines.append(
            f"| {depth} | {pos} | {scheme} | {','.join(r['seed'] for r in rs)} | "
            f"{outcomes(rs)} | {_mean_spread([r['bleu'] for r in rs])} | "
            f"{_mean_spread([r['best_valid_nll'] for r in rs], 3)} | "
            f"{', '.join(r['distinct_hyps'] or '-' for r in rs)} | "
            f"{_mean_spread([r.get('source_gain') for r in rs], 3)} |"
        )
    return lines


def write_table(rows, path: Path, planned=()) -> None:
    """The summary ``--publish`` puts into results.md: per study (its heading names the
    schedule) one line per cell over its seeds, and the runs of the running plan still
    missing. Every run's own figures and commands are in the CSV, its course in the curves."""
    rows = sorted(rows, key=_row_order)
    studies = sorted({r["study"] for r in rows}, key=_study_order)
    lines = []
    for study in studies:
        rs = [r for r in rows if r["study"] == study]
        lines += [f"### {study_title(rs)}", ""] + summary_lines(rs)
        missing = [m for m in planned if m[0] == study]
        if missing:
            lines += ["", f"Still missing from the plan ({len(missing)} runs): " + ", ".join(
                f"{scheme} {depth} seed {seed}" + ("" if pos == "sinusoidal" else f" ({pos})")
                for _, scheme, depth, seed, pos in missing) + "."]
        lines.append("")
    ents = sorted({r["unigram_entropy_bits"] for r in rows})
    sigs = sorted({r["bleu_signature"] for r in rows if r["bleu_signature"]})
    lines += [f"Outcome: the status rule's verdict, a run it calls trained counted as ignoring "
              f"the source when its source gain is under {SOURCE_BLIND_BITS:g} bits or, not "
              "probed, when it gives one translation for every input. BLEU and best valid nll "
              "(bits): mean +- sample std (min-max) over the seeds. Unigram entropy of the "
              f"German training side: {', '.join(ents)} bits/token; sacreBLEU signature "
              f"{'; '.join(sigs) or '-'}. Distinct translations: different sentences among the "
              "test translations, per seed ('-': lost). Source gain: validation nll with each "
              "sentence given the next sentence's source minus with its own (about 0: the "
              "decoder ignores the source; benchmarks/depthstudy/probe.py). Every run with its "
              "commands, omegas, gradient norms and encoder cosine: "
              "[depth_study_results.csv](depth_study_results.csv)."]
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
