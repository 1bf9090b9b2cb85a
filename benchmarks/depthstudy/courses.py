"""The encoder's collapse while training, run by run: the course of ``enc_tok_cos``.

The training monitor (``fairseq_admin_pos/models/monitoring.py``) logs ``enc_tok_cos``, the
mean cosine between the encoder outputs of two different real source tokens of each update's
batch (``fairseq_admin_pos/collapse.py``; 1: every token gets the same output), and the
study's curves keep it per logged update (``logs.CURVE_KEYS``). A run that trains also
passes through a near-collapse while it first learns the target language, so the value at one
update says little; what the docs read is its course. :func:`course` reduces a curve to the
numbers they quote (first value, peak, value at the end of the warmup, the last update above
:data:`COLLAPSE_LINE`, last value) and :func:`course_lines` sets every logged run's course in
one table beside whether the run failed and its trained encoder's cosine measured offline
(``probe.py``, eval mode, validation batch), with a sentence comparing the runs that trained
and those that failed. :func:`monitor_warns` replays the monitor's collapse warning
(:func:`fairseq_admin_pos.collapse.collapse_warning`, the code ``fairseq-train`` runs) over
the logged intervals, so the table shows where each run would have been warned. Runs recorded
before the monitor logged the value have no course.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from fairseq_admin_pos.collapse import COLLAPSE_COS, collapse_warning

from .report import _row_order

#: the line the docs read the courses against: above it, a near-collapse; the same line the
#: training monitor's warning uses after the warmup
COLLAPSE_LINE = COLLAPSE_COS
KEY = "enc_tok_cos"


def course(points: Iterable[dict], warmup: Optional[int]) -> Optional[dict]:
    """``points``: a curve's ``train`` list (``{"update": u, "enc_tok_cos": c, ...}``). Returns
    ``first``, ``peak`` (the first update with the highest value), ``warmup`` (the last point
    at or before update ``warmup``; None if none or without a ``warmup``), ``end`` (the last
    point), each as ``(update, value)``, and ``last_above``: the last update above
    :data:`COLLAPSE_LINE` (None if none). Points without a finite value are left out; None
    when none is left."""
    pts = []
    for p in points:
        v = p.get(KEY)
        if v is None or v == "":
            continue
        v = float(v)
        if math.isfinite(v):
            pts.append((int(p["update"]), v))
    if not pts:
        return None
    pts.sort()
    peak = max(pts, key=lambda pt: pt[1])  # max keeps the first of equal values
    before = [] if warmup is None else [pt for pt in pts if pt[0] <= warmup]
    above = [u for u, v in pts if v > COLLAPSE_LINE]
    return dict(first=pts[0], peak=peak, warmup=before[-1] if before else None, end=pts[-1],
                last_above=above[-1] if above else None, warned=monitor_warns(pts, warmup))


def monitor_warns(pts, warmup: Optional[int]) -> Optional[int]:
    """The last update of the first logging interval for which the training monitor warns of a
    collapsed encoder, or None: ``pts`` the logged ``(update, interval mean)`` in order, each
    interval running from the update after the previous logged value's (the first from update
    1; an interval whose mean was not a value, left out of ``pts``, joins the next)."""
    first = 1
    for update, value in pts:
        if collapse_warning(value, first, update, warmup or 0) is not None:
            return update
        first = update + 1
    return None


def _pt(pt) -> str:
    return "-" if pt is None else f"{pt[1]:.2f} ({pt[0]})"


def continued_keys(rows) -> set:
    """The keys of runs that a longer run continues from their checkpoint (its ``resumed_at``
    says ``U (continues KEY)``): the longer run's logged course holds theirs."""
    return {k for r in rows
            for k in re.findall(r"\(continues ([^)]+)\)", r.get("resumed_at") or "")}


def course_lines(rows, curve_of: Callable[[dict], Optional[Path]],
                 failure: Callable[[dict], str]) -> List[str]:
    """The markdown table of every training course whose curve logged ``enc_tok_cos``
    (``curve_of(row)``: its curve file or None; ``failure(row)``: why it failed, '' if it
    trained), one per course: a run continued by a longer run is left to the longer one; and
    the sentence comparing the last update above the line; ``[]`` when no row has a course."""
    logged = []
    continued = continued_keys(rows)
    for r in rows:
        if r.get("key") in continued:
            continue
        path = curve_of(r)
        if path is None or not path.is_file():
            continue  # checked first: hand-made and older rows may lack the recipe columns
        warmup = str(r.get("warmup") or "").strip()
        c = course(json.loads(path.read_text()).get("train", []),
                   int(warmup) if warmup else None)
        if c is not None:
            logged.append((r, c))
    if not logged:
        return []
    logged.sort(key=lambda rc: _row_order(rc[0]))
    lines = [f"The encoder token cosine while training (`{KEY}`, the training monitor's, "
             "the mean over each 10-update logging interval of its batches in train mode; "
             "value (last update of the interval)), for every training course logged "
             "with it (a run continued to a longer length is shown once, at its longer run); "
             f"last above {COLLAPSE_LINE:g}: the last logged update whose value was "
             f"above {COLLAPSE_LINE:g}; warned: the update at whose log line the monitor "
             f"warns of a collapsed encoder (the first interval wholly after the warmup above "
             f"{COLLAPSE_LINE:g}; `fairseq_admin_pos/collapse.py` replayed over the curve); "
             "offline: the trained encoder's cosine from the probe (eval mode, validation "
             "batch):", "",
             "| shape | scheme | seed | recipe | outcome | first | peak | end of warmup | "
             f"last above {COLLAPSE_LINE:g} | last | warned | offline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    spans = {"trained": [], "failed": []}
    warned = {"trained": [], "failed": []}
    for r, c in logged:
        why = failure(r)
        n = int(r["updates"] or r["max_update"])
        # the share of the run's updates before its last value above the line (None: never)
        spans["failed" if why else "trained"].append(
            None if c["last_above"] is None else c["last_above"] / n)
        warned["failed" if why else "trained"].append(c["warned"])
        lines.append(
            f"| {r['depth']} | {r['scheme']} | {r['seed']} | {_recipe(r)} | {why or 'trained'} | "
            f"{_pt(c['first'])} | {_pt(c['peak'])} | {_pt(c['warmup'])} | "
            f"{c['last_above'] if c['last_above'] is not None else 'never'} | "
            f"{_pt(c['end'])} | {c['warned'] if c['warned'] is not None else 'no'} | "
            f"{_offline(r)} |")
    lines += ["", _spans_sentence(spans) + " " + _warned_sentence(warned)]
    return lines


def _warned_sentence(warned) -> str:
    def part(label, updates):
        if not updates:
            return f"none of the runs that {label} (none logged)"
        hit = [u for u in updates if u is not None]
        text = f"{len(hit)} of the {len(updates)} run{'s' if len(updates) > 1 else ''} that {label}"
        if hit:
            lo, hi = min(hit), max(hit)
            text += f" (at update {lo}" + (f"-{hi}" if hi != lo else "") + ")"
        return text
    return (f"The monitor's collapse warning fires for {part('failed', warned['failed'])}; "
            f"for {part('trained', warned['trained'])}.")


def _spans_sentence(spans) -> str:
    def part(label, shares):
        if not shares:
            return f"no run {label} was logged"
        seen = [s for s in shares if s is not None]
        never = len(shares) - len(seen)
        text = f"{len(shares)} run{'s' if len(shares) > 1 else ''} {label}"
        if seen:
            lo, hi = min(seen), max(seen)
            text += (f": last above {COLLAPSE_LINE:g} at {_pct(lo)}"
                     + (f"-{_pct(hi)}" if hi != lo else "") + " of the run's updates")
        if never:
            text += f"{',' if seen else ':'} {never} never above it"
        return text
    return (f"Of the runs logged, {part('that trained', spans['trained'])}; "
            f"{part('that failed', spans['failed'])}.")


def _recipe(r) -> str:
    parts = [f"{key} {r[key]}" for key in ("lr", "warmup") if str(r.get(key) or "").strip()]
    if str(r.get("max_update") or "").strip():
        parts.append(f"{r['max_update']} updates")
    return ", ".join(parts) or "-"


def _offline(r) -> str:
    v = r.get("encoder_cos") or ""
    return f"{float(v):.2f}" if v else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"
