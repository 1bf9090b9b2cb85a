"""The depth table at the converged schedule (``--plan converged``), read from the CSV.

Four parts, each a markdown block of ``docs/depth_converged.md`` between its marker lines,
rewritten by ``--publish`` (and ``--report-only --publish``) from the rows alone:

* ``check``: the convergence check: Admin 6L-6L and 18L-18L (seed 1) at the schedule's
  length and at twice it (the longer run continues the shorter one), BLEU and validation nll
  at both, and the length the grid uses (twice the length wherever doubling added 0.5 BLEU or
  more);
* ``table``: schemes by depths at the grid's length, BLEU mean +- sample std over seeds, the
  paper's WMT14 En-De BLEU beside each cell for the shape of the curve (Liu et al. 2020,
  Table 1; tokenized BLEU on another corpus: not the level);
* ``nll``: per run, the final training nll, the best and the last validation nll and the
  update of the best: a validation nll rising after its best while the training nll still
  falls is over-fitting; both still falling at the end is under-training;
* ``collapse``: the 48L-1L runs' encoder token cosine course (the training monitor's
  ``enc_tok_cos``) and the update the monitor's collapse warning fired at, if it did;
* ``speed``: the deployed speed of the grid's models (``docs/deploy_speed_converged.csv``,
  ``deploy_speed.py --plan converged``): CTranslate2 int8 and float32 at batch 64 and 1, one
  thread, each ratio against the same timing run's 6L-6L, and the fastest model within
  0.5 BLEU of the best;
* ``readme``: the README's headline, the table and the three answers (:func:`answer_lines`).

A difference of two cells is called one only when both have two seeds or more and it exceeds
both 0.5 BLEU and the larger of the two cells' seed standard deviations; otherwise the answer
says it is within the seeds' spread, or that the cells are not measured yet. A cell gets a
third seed (:func:`third_seeds`) where its first two differ by more than 1 BLEU, disagree on
failure, or decide an answer.
"""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from .courses import continued_keys, course
from .deepshallow import failure
from .plan import (CONVERGED_LENGTHS, CONVERGED_LONG, CONVERGED_RECIPE, CONVERGED_UPDATES,
                   PLANS, POST_LN_DEEP)
from .report import _mean_spread, _num, curve_path

SCHEMES = ("post-ln", "pre-ln", "admin")
DEPTHS = ("6L-6L", "12L-12L", "18L-18L", "12L-1L", "48L-1L")
#: Liu et al. 2020, Table 1, WMT14 En-De (tokenized BLEU; ../shared/reference/anchors.md)
PAPER = {("post-ln", "6L-6L"): "27.80", ("post-ln", "12L-12L"): "failed",
         ("post-ln", "18L-18L"): "failed", ("pre-ln", "6L-6L"): "27.27",
         ("pre-ln", "12L-12L"): "28.26", ("pre-ln", "18L-18L"): "28.38",
         ("admin", "6L-6L"): "27.90", ("admin", "12L-12L"): "28.58",
         ("admin", "18L-18L"): "29.03"}
#: the length doubling must add this much BLEU to set the grid's length to the longer one
GAIN_BLEU = 0.5
MARK = "<!-- depth_converged {}: {} -->"


def converged_rows(rows):
    """The rows of ``--plan converged``'s recipe (any length)."""
    r0 = CONVERGED_RECIPE
    return [r for r in rows
            if r["lr"] == f"{r0['lr']:g}" and r["warmup"] == str(r0["warmup"])
            and r.get("validate_every") == str(r0["validate_every"])
            and r["embed_dim"] == "128" and r["positions"] == "sinusoidal"
            and r["dropout"] in ("0.1", "") and not float(r["clip_norm"] or 0)]


def _cell(rows, scheme, depth, updates):
    return sorted((r for r in rows if (r["scheme"], r["depth"], r["max_update"]) ==
                   (scheme, depth, str(updates))), key=lambda r: int(r["seed"]))


def _best_by(curve, updates):
    """The lowest validation nll logged at or before each of ``updates`` (None: none yet)."""
    valid = curve.get("valid", []) if curve else []
    return [min((p["nll"] for p in valid if p["update"] <= u), default=None) for u in updates]


def check_lines(rows, curve_of=lambda r: None):
    """Both lengths of the check per shape, then the validation course by doublings (read
    from the longest run's curve): what each doubling of the schedule bought."""
    lines = ["| shape (Admin, seed 1) | BLEU at 2400 | BLEU at 4800 | gain | checkpoint_best "
             "valid nll 2400 / 4800 | final train nll 2400 / 4800 |", "|---|---|---|---|---|---|"]
    doublings = (600, 1200, 2400, 4800)
    course_ = ["", "Lowest validation nll (bits) by update, from the longest run's curve: each "
               "doubling's gain, the course a further doubling would continue:", "",
               "| shape | " + " | ".join(f"by {u}" for u in doublings) + " |",
               "|---|" + "---|" * len(doublings)]
    for depth in ("6L-6L", "18L-18L"):
        a, b = (next(iter([r for r in _cell(rows, "admin", depth, n) if r["seed"] == "1"]),
                     None) for n in (2400, 4800))
        gain = (f"{float(b['bleu']) - float(a['bleu']):+.2f}"
                if a and b and _num(a["bleu"]) is not None and _num(b["bleu"]) is not None
                else "-")
        lines.append(f"| {depth} | {a['bleu'] if a else 'not run yet'} | "
                     f"{b['bleu'] if b else 'not run yet'} | {gain} | "
                     f"{a['best_valid_nll'] if a else '-'} / {b['best_valid_nll'] if b else '-'}"
                     f" | {a['final_train_nll'] if a else '-'} / "
                     f"{b['final_train_nll'] if b else '-'} |")
        path = curve_of(b or a) if (b or a) else None
        if path:
            best = _best_by(json.loads(path.read_text()), doublings)
            last = max(p["update"] for p in json.loads(path.read_text())["valid"])
            cells = [f"{x:.3f}" if x is not None and u <= last else "-"
                     for x, u in zip(best, doublings)]
            course_.append(f"| {depth} | " + " | ".join(cells) + " |")
    return lines + (course_ if len(course_) > 5 else [])


def grid_cells(updates=CONVERGED_UPDATES):
    """The (scheme, depth) cells the plan trains to ``updates``."""
    return {(s, d) for s, d, _, _, n in PLANS["converged"] if n == updates}


def _shorter(rows, scheme, depth, updates):
    """The cell's runs at the longest length of the plan below ``updates`` that has any."""
    lengths = [n for n in CONVERGED_LENGTHS if n < updates and _cell(rows, scheme, depth, n)]
    return _cell(rows, scheme, depth, max(lengths)) if lengths else []


def _cell_text(rs, paper, in_grid=True, shorter=(), updates=None):
    if not rs and shorter and in_grid:
        text = (f"not at {updates} yet (at {shorter[0]['max_update']}: "
                f"{_cell_text(shorter, None)})")
    elif not rs:
        text = "not run yet" if in_grid else "not in the grid"
    else:
        text = _mean_spread([r["bleu"] for r in rs]).split(" (")[0] + f" (n={len(rs)})"
        failed = [failure(r) for r in rs if failure(r)]
        if failed:
            text += f", {len(failed)} {'/'.join(sorted(set(failed)))}"
    return text + (f"; paper {paper}" if paper else "")


def table_lines(rows, updates=CONVERGED_UPDATES):
    lines = ["| scheme | " + " | ".join(DEPTHS) + " |", "|---|" + "---|" * len(DEPTHS)]
    for s in SCHEMES:
        cells = [_cell_text(_cell(rows, s, d, updates), PAPER.get((s, d)),
                            (s, d) in grid_cells(updates), _shorter(rows, s, d, updates), updates)
                 for d in DEPTHS]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def _valid_course(curve):
    valid = curve.get("valid", []) if curve else []
    if not valid:
        return None
    best = min(valid, key=lambda p: p["nll"])
    return best, valid[-1]


def nll_lines(rows, curve_of):
    """Per run with a curve: the final training nll, the curve's lowest validation nll and its
    update, the last validation nll, and the nll of ``checkpoint_best.pt`` (the CSV's
    ``best_valid_nll``: chosen by the label-smoothed validation loss, so it can sit above the
    curve's lowest nll), with the reading the first three give."""
    lines = ["| scheme | depth | seed | updates | final train nll | lowest valid nll (update) | "
             "last valid nll | checkpoint_best valid nll | reading |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (SCHEMES.index(r["scheme"]) if r["scheme"] in SCHEMES
                                         else 9, DEPTHS.index(r["depth"]) if r["depth"] in
                                         DEPTHS else 9, int(r["max_update"]), int(r["seed"]))):
        path = curve_of(r)
        course_ = _valid_course(json.loads(path.read_text())) if path else None
        if course_ is None:
            continue
        best, last = course_
        reading = ("over-fitting: validation nll rose after its best"
                   if last["nll"] > best["nll"] + 0.02 else
                   "still improving at the end" if best["update"] == last["update"] else
                   "flat after its best")
        lines.append(f"| {r['scheme']} | {r['depth']} | {r['seed']} | {r['max_update']} | "
                     f"{r['final_train_nll']} | {best['nll']:.3f} ({best['update']}) | "
                     f"{last['nll']:.3f} | {r['best_valid_nll']} | {reading} |")
    return lines


def collapse_lines(rows, curve_of):
    """The 48L-1L runs' courses, then the monitor's rule replayed over every course of the
    page, one per training course: a run that a longer run continues from its checkpoint is
    counted once, in the longer run (whose logged course holds the shorter one's)."""
    lines = ["| scheme | seed | updates | BLEU | outcome | peak enc_tok_cos (update) | at the end "
             "| monitor warned at |", "|---|---|---|---|---|---|---|---|"]
    continued = continued_keys(rows)
    courses = []
    key = lambda r: (r["depth"] != "48L-1L", r["scheme"], int(r["seed"]), int(r["max_update"]))
    for r in sorted(rows, key=key):
        path = curve_of(r)
        c = course(json.loads(path.read_text())["train"], int(r["warmup"])) if path else None
        if c is None:
            continue
        if r.get("key") not in continued:
            courses.append((bool(failure(r)), c["warned"] is not None))
        if r["depth"] == "48L-1L":
            lines.append(f"| {r['scheme']} | {r['seed']} | {r['max_update']} | {r['bleu']} | "
                         f"{failure(r) or 'trained'} | {c['peak'][1]:.3f} ({c['peak'][0]}) | "
                         f"{c['end'][1]:.3f} | {c['warned'] or 'not warned'} |")
    failed = [w for f, w in courses if f]
    trained = [w for f, w in courses if not f]
    lines += ["", f"The rule replayed over every logged training course of this page, a run "
              f"continued by a longer one counted once, at the longer run's end ({len(courses)} "
              f"courses, none of them among those the rule was set on): it warned for "
              f"{sum(failed)} of {len(failed)} that failed and for {sum(trained)} of "
              f"{len(trained)} that trained."]
    return lines


#: two seeds of a cell further apart than this get a third
THIRD_SEED_BLEU = 1.0


def _bleus(rs):
    return [x for x in (_num(r["bleu"]) for r in rs) if x is not None]


def _line(a, b):
    """The difference two cells' BLEU (lists of two or more seeds) must exceed to count."""
    return max(GAIN_BLEU, statistics.stdev(a), statistics.stdev(b))


def _verdict(diff, line):
    """1 higher, -1 lower, 0 within the seeds' spread."""
    return 0 if abs(diff) <= line else (1 if diff > 0 else -1)


def _turns_on(a, b):
    """Which of two cells' seed lists (two seeds each; ``a`` the base) a comparison's verdict
    turns on: those where one of the cell's seeds in place of its mean, at the same line,
    changes the verdict."""
    if min(len(a), len(b)) != 2:
        return set()
    line, ma, mb = _line(a, b), statistics.mean(a), statistics.mean(b)
    verdict = _verdict(mb - ma, line)
    return ({"base"} if any(_verdict(mb - x, line) != verdict for x in a) else set()) | \
        ({"other"} if any(_verdict(x - ma, line) != verdict for x in b) else set())


def third_seeds(rows):
    """Grid items of seed 3 for every cell of the grid (at the grid's length) whose seeds 1 and
    2 differ by more than ``THIRD_SEED_BLEU``, disagree on whether the run failed, or decide a
    comparison of the answers (:func:`comparisons`): one of its seeds in place of the cell's
    mean changes that comparison's verdict. Each length in the plan's order."""
    rows = converged_rows(rows)
    cells = dict.fromkeys((s, d) for s, d, _, _, n in PLANS["converged"]
                          if n == CONVERGED_UPDATES)
    first_two = {c: [r for r in _cell(rows, *c, CONVERGED_UPDATES) if r["seed"] in ("1", "2")]
                 for c in cells}
    third = set()
    for c, rs in first_two.items():
        bleus = _bleus(rs)
        if len(rs) == 2 and (len({bool(failure(r)) for r in rs}) == 2 or (
                len(bleus) == 2 and abs(bleus[0] - bleus[1]) > THIRD_SEED_BLEU)):
            third.add(c)
    for s, base, other in comparisons(grid_cells()):
        turns = _turns_on(_bleus(first_two.get((s, base), [])),
                          _bleus(first_two.get((s, other), [])))
        third |= {(s, base)} if "base" in turns else set()
        third |= {(s, other)} if "other" in turns else set()
    return [(s, d, 3, "sinusoidal", n) for s, d in cells if (s, d) in third
            for n in CONVERGED_LENGTHS]


def skipped(rows):
    """The Post-LN 18L-18L items of the grid, where Post-LN 12L-12L failed with both seeds (and
    12L-12L is not Admin's alone); else none."""
    rs = [r for r in _cell(converged_rows(rows), "post-ln", "12L-12L", CONVERGED_UPDATES)
          if r["seed"] in ("1", "2")]
    if CONVERGED_LONG or len(rs) < 2 or not all(failure(r) for r in rs):
        return []
    return [g for g in PLANS["converged"] if g[:2] == POST_LN_DEEP]


def missing_line(rows):
    done = {(r["scheme"], r["depth"], r["seed"], r["max_update"]) for r in rows}
    skip = skipped(rows)
    missing = [f"{s} {d} seed {seed} ({n})" for s, d, seed, _, n in
               PLANS["converged"] + third_seeds(rows)
               if (s, d, str(seed), str(n)) not in done and (s, d, seed, _, n) not in skip]
    line = (f"Runs of `--plan converged` still to run ({len(missing)}): " + ", ".join(missing)
            + "." if missing else "Every run of `--plan converged` is recorded.")
    return line + (" Post-LN 18L-18L is not run: Post-LN 12L-12L failed with both seeds."
                   if skip else "")


def fill(page: Path, rows, out: Path, published: Path, updates=CONVERGED_UPDATES) -> None:
    """Rewrite the blocks of ``page`` (those whose markers it has) from ``rows``; the table and
    the answers at the grid's length ``updates``."""
    rows = converged_rows(rows)

    def curve_of(r):
        return curve_path(out, r, published)

    blocks = {"check": check_lines(rows, curve_of),
              "table": table_lines(rows, updates) + ["", missing_line(rows)],
              "nll": nll_lines(rows, curve_of), "collapse": collapse_lines(rows, curve_of),
              "speed": speed_lines(read_speed(published / SPEED_CSV)),
              "readme": table_lines(rows, updates) + [""] + answer_lines(rows, updates)}
    text = page.read_text()
    for name, lines in blocks.items():
        start, end = MARK.format(name, "start"), MARK.format(name, "end")
        if start in text and end in text:
            head, rest = text.split(start, 1)
            text = head + start + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1]
    page.write_text(text)



# --------------------------------------------------------------------------- the answers
def compare(base, other, base_name, other_name):
    """One clause: ``other``'s mean BLEU against ``base``'s, with the rule of the module
    docstring (two seeds each, beyond 0.5 BLEU and beyond the larger seed std)."""
    a, b = _bleus(base), _bleus(other)
    if not a or not b:
        return f"{other_name} vs {base_name}: not measured yet"
    diff = statistics.mean(b) - statistics.mean(a)
    text = (f"{other_name} {statistics.mean(b):.2f} (n={len(b)}) vs {base_name} "
            f"{statistics.mean(a):.2f} (n={len(a)}): {diff:+.2f}")
    if min(len(a), len(b)) < 2:
        return text + ", not concluded (one seed)"
    spread = max(statistics.stdev(a), statistics.stdev(b))
    verdict = _verdict(diff, _line(a, b))
    if not verdict:
        return text + f", within the seeds' spread (std {spread:.2f})"
    return text + f", {'higher' if verdict > 0 else 'lower'} beyond the seeds' spread " \
                  f"(std {spread:.2f})"


def _failed(rs, shorter=(), updates=None):
    """How many of ``rs`` failed; without any, the same of ``shorter`` (the cell's runs at
    the longest length below ``updates``), said to be at their own length."""
    if not rs:
        if not shorter:
            return "not run yet"
        return (f"not run to {updates} updates yet; at {shorter[0]['max_update']}: "
                f"{_failed(shorter)}")
    bad = [r for r in rs if failure(r)]
    return f"{len(bad)} of {len(rs)} runs failed (BLEU {', '.join(r['bleu'] for r in rs)})"


def comparisons(grid):
    """The (scheme, base depth, other depth) comparisons the answers read: each deeper shape
    of Admin and Pre-LN in ``grid`` against the same scheme's 6L-6L, then 12L-1L against it."""
    return [*((s, "6L-6L", d) for s in ("admin", "pre-ln") for d in ("12L-12L", "18L-18L")
              if (s, d) in grid),
            *((s, "6L-6L", "12L-1L") for s in ("admin", "pre-ln"))]


def answer_lines(rows, updates=CONVERGED_UPDATES):
    """The three questions of the converged table, answered from ``rows`` alone."""
    def cell(s, d):
        return _cell(rows, s, d, updates)

    def failed(s, d):
        return _failed(cell(s, d), _shorter(rows, s, d, updates), updates)

    def vs(s, base, other):
        return f"  - {compare(cell(s, base), cell(s, other), base, f'{s} {other}')}."

    grid = grid_cells(updates)
    post = "12L-12L" if ("post-ln", "12L-12L") in grid else "18L-18L"
    pairs = comparisons(grid)
    return [f"At this schedule ({updates} updates), in BLEU; a difference counts when both cells "
            f"have two seeds and it exceeds {GAIN_BLEU} and their larger std:", "",
            f"- **Does depth pay?** Post-LN {post} (failed in the paper): "
            f"{failed('post-ln', post)}.",
            *(vs(*c) for c in pairs if c[2] != "12L-1L"),
            "- **Does 12L-1L match 6L-6L?**",
            *(vs(*c) for c in pairs if c[2] == "12L-1L"),
            "- **Does Admin collapse at 48L-1L?**",
            *(f"  - {s} 48L-1L: {failed(s, '48L-1L')}." for s in ("admin", "pre-ln"))]


# --------------------------------------------------------------------------- deployed speed
#: the timing runs of the grid's models (``deploy_speed.py --plan converged``)
SPEED_CSV = "deploy_speed_converged.csv"
#: the fastest model is sought among those this close to the best BLEU
WITHIN_BLEU = 0.5


def read_speed(path: Path):
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def speed_lines(speed_rows):
    """The latest timing run's rows at one thread: the model's BLEU (fairseq + plugin, the
    study's decoding) beside CTranslate2 int8's, sentences/s at batch 64 and ms per sentence
    at batch 1, each with its speed ratio to the run's 6L-6L of the same scheme."""
    rows = [r for r in speed_rows if r["threads"] == "1"]
    ct2 = [r for r in rows if r["engine"].startswith("CTranslate2")]
    if not ct2:
        return ["Not timed yet: `python benchmarks/deploy_speed.py --study-out runs/depth_study "
                "--plan converged --threads 1` times the grid's models once they are trained."]
    run = max(r["run"] for r in ct2)
    rows, ct2 = ([r for r in x if r["run"] == run] for x in (rows, ct2))
    by = {(r["scheme"], r["shape"], r["engine"].startswith("CTranslate2"), r["precision"],
           r["batch"]): r for r in rows}
    lines = [f"Timing run `{run}` ({ct2[0]['cpu']}, one thread, alone on the machine):", "",
             "| scheme | shape | seed | BLEU | int8 BLEU | status | int8 sent/s (x 6L-6L) | "
             "float32 sent/s (x 6L-6L) | int8 ms/sentence at batch 1 (speed x 6L-6L) |",
             "|---|---|---|---:|---:|---|---|---|---|"]
    cells = sorted({(r["scheme"], r["shape"]) for r in ct2},
                   key=lambda c: (SCHEMES.index(c[0]) if c[0] in SCHEMES else 9,
                                  DEPTHS.index(c[1]) if c[1] in DEPTHS else 9))
    for s, d in cells:
        plugin = by.get((s, d, False, "float32", "64"))
        i8, f32, lat = (by.get((s, d, True, p, b)) for p, b in
                        (("int8", "64"), ("float32", "64"), ("int8", "1")))
        any_ = i8 or f32 or lat
        lines.append(f"| {s} | {d} | {any_['seed']} | {plugin['bleu'] if plugin else '-'} | "
                     f"{i8['bleu'] if i8 else '-'} | {any_['train_status']} | "
                     f"{_speed(i8, 'sentences_per_s', 1)} | {_speed(f32, 'sentences_per_s', 1)} "
                     f"| {_speed(lat, 'ms_per_sentence', 2)} |")
    lines += ["", "BLEU: sacreBLEU of the model's own test translations (fairseq-generate with "
              "the plugin); int8 BLEU: of the timed CTranslate2 int8 translations.", "",
              fastest_line(ct2)]
    return lines


def _speed(row, field: str, digits: int) -> str:
    """``row[field]`` rounded, with the row's speed ratio to 6L-6L; ``-`` without a row."""
    if not row:
        return "-"
    return f"{float(row[field]):.{digits}f} (x {row['ratio_to_6l6l'] or '-'})"


def fastest_line(rows):
    """The fastest trained model (int8, batch 64) within ``WITHIN_BLEU`` of the best BLEU."""
    int8 = [r for r in rows if (r["precision"], r["batch"]) == ("int8", "64")
            and r["train_status"] == "trained" and _num(r["bleu"]) is not None]
    if not int8:
        return "No trained model timed yet."
    best = max(int8, key=lambda r: float(r["bleu"]))
    near = [r for r in int8 if float(r["bleu"]) >= float(best["bleu"]) - WITHIN_BLEU]
    fast = max(near, key=lambda r: float(r["sentences_per_s"]))
    return (f"Best int8 BLEU: {best['scheme']} {best['shape']} {best['bleu']}. Fastest within "
            f"{WITHIN_BLEU} BLEU of it (CTranslate2 int8, batch 64): {fast['scheme']} "
            f"{fast['shape']}, {fast['bleu']} BLEU, {float(fast['sentences_per_s']):.1f} "
            "sentences/s.")
