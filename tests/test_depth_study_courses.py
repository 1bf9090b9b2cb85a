"""benchmarks/depthstudy/courses.py: the course of the training monitor's ``enc_tok_cos``.

* :func:`course` on seeded random curves against a second, plainly written reading of the
  same points (peak = the first highest value, the last point at or before the warmup, the
  last update above 0.9 scanned from the end), with missing and non-finite values left out;
* through ``--publish`` (``publish.publish``) on hand-made rows and curve files laid out as
  ``depth_study.py`` writes them: one table line per run logged with the value (none for a
  run recorded before the monitor logged it), its outcome by ``deepshallow.failure``, and
  the sentence's shares of the updates recomputed here; a curve kept only in the docs
  folder (a study started again in a new folder) still counts.
"""
from __future__ import annotations

import json
import math
import random
import re
import sys

import pytest

from fairseq_cli_utils import REPO
from study_utils import publish_folders, published_block

sys.path.insert(0, str(REPO / "benchmarks"))

from depthstudy import courses  # noqa: E402
from depthstudy.deepshallow import END, START, failure  # noqa: E402
from depthstudy.plan import run_key  # noqa: E402
from depthstudy.deepshallow import plan_args  # noqa: E402


def random_curve(seed: int, n: int = 70, step: int = 10):
    rng = random.Random(seed)
    pts = []
    for i in range(1, n + 1):
        p = {"update": i * step, "loss": 10.0 - i * 0.1}
        roll = rng.random()
        if roll < 0.05:
            pass  # a line without the value (a run logged before the monitor had it)
        elif roll < 0.08:
            p["enc_tok_cos"] = float("nan")  # one real token: no pair, NaN
        else:
            p["enc_tok_cos"] = round(rng.uniform(0.1, 1.0), 4)
        pts.append(p)
    return pts


def plain_reading(pts, warmup):
    """The same numbers, read the long way round."""
    kept = [(p["update"], p["enc_tok_cos"]) for p in pts
            if "enc_tok_cos" in p and not math.isnan(p["enc_tok_cos"])]
    if not kept:
        return None
    best = max(v for _, v in kept)
    peak = next((u, v) for u, v in kept if v == best)
    at_warmup = None
    for u, v in kept:
        if u <= warmup:
            at_warmup = (u, v)
    last_above = None
    for u, v in reversed(kept):
        if v > 0.9:
            last_above = u
            break
    # the monitor warns at the first interval that starts after the warmup above the line
    starts = [1] + [u + 1 for u, _ in kept[:-1]]
    warned = next((u for (u, v), start in zip(kept, starts) if warmup > 0 and start > warmup
                   and v > 0.9), None)
    return dict(first=kept[0], peak=peak, warmup=at_warmup, end=kept[-1],
                last_above=last_above, warned=warned)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("warmup", [0, 5, 400, 10_000])
def test_course_is_the_plain_reading_of_the_points(seed, warmup):
    pts = random_curve(seed)
    assert courses.course(pts, warmup) == plain_reading(pts, warmup)


def test_course_orders_points_and_drops_what_is_not_a_value():
    pts = [{"update": 30, "enc_tok_cos": 0.5}, {"update": 10, "enc_tok_cos": 0.95},
           {"update": 20, "enc_tok_cos": "nan"}, {"update": 40, "enc_tok_cos": ""},
           {"update": 50}, {"update": 60, "enc_tok_cos": "0.95"}]
    c = courses.course(pts, 25)
    # the first of two equal highest values; "nan" and "" are not values
    # update 60's interval starts after update 10's, the last value logged before it: 11-60,
    # wholly after the 25-update warmup and above the line, so the monitor warns there
    assert c == dict(first=(10, 0.95), peak=(10, 0.95), warmup=(10, 0.95), end=(60, 0.95),
                     last_above=60, warned=60)
    assert courses.course(pts, 0)["warned"] is None  # no warmup, no warning
    assert courses.course([{"update": 10, "loss": 3.0}], 400) is None
    assert courses.course([], 400) is None
    # exactly at the line is not above it
    assert courses.course([{"update": 10, "enc_tok_cos": 0.9}], 400)["last_above"] is None


PAGE = ("# page\n\n<!-- depth_study table: start -->\nold\n<!-- depth_study table: end -->\n\n"
        f"{START}\nplaceholder\n{END}\n\nafter\n")

# (scheme, shape, seed, status, source gain, encoder cos, curve): curve values by update
RUNS = [
    ("admin", "24L-1L", 1, "trained", "2.24", "0.2573",
     {10: 0.40, 140: 0.98, 250: 0.91, 260: 0.85, 400: 0.76, 700: 0.28}),
    ("post-ln", "48L-1L", 1, "trained", "-0.0000", "1.0000",   # ignores the source
     {10: 0.80, 130: 0.96, 400: 0.94, 700: 0.92}),
    ("admin-paper", "48L-1L", 1, "diverged", "", "",
     {10: 0.74, 170: 0.99, 350: 0.97}),
    ("pre-ln", "12L-1L", 1, "trained", "3.90", "0.1500", None),  # no enc_tok_cos logged
]


def folder(key: str) -> str:
    return "runs/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def publish_courses(tmp_path, only_in_docs=()):
    from depthstudy.publish import publish
    from depthstudy.report import write_rows

    out, docs = publish_folders(tmp_path, PAGE)
    rows = []
    for scheme, shape, seed, status, gain, cos, values in RUNS:
        key = run_key(scheme, shape, seed, plan_args("deep-shallow"))
        n = max(values) if values else 700
        row = dict(key=key, study="d128-700upd", scheme=scheme, positions="sinusoidal",
                   depth=shape, seed=seed, status=status, bleu="1.00", best_valid_nll="5.000",
                   source_gain=gain, encoder_cos=cos, embed_dim=128, max_update=700,
                   updates=n, lr="0.002", warmup=400, curve_file=f"{folder(key)}/curve.json")
        rows.append(row)
        train = [{"update": u, "loss": 5.0, "nll": 5.0} for u in range(10, n + 1, 10)]
        for p in train:
            if values and p["update"] in values:
                p["enc_tok_cos"] = values[p["update"]]
        if (scheme, shape) in only_in_docs:
            # an earlier study folder's run: its curve survives only as published
            path = docs / "depth_study_curves" / f"{folder(key).split('/')[1]}.json"
        else:
            path = out / row["curve_file"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"train": train, "valid": []}))
    write_rows(out / "results.csv", rows)
    publish(out, docs)
    return published_block(docs, START, END), rows


@pytest.mark.parametrize("only_in_docs", [(), (("admin", "24L-1L"),)])
def test_publish_lists_every_logged_course(tmp_path, only_in_docs):
    block, rows = publish_courses(tmp_path, only_in_docs)
    lines = {tuple(x.split(" | ")[:3]): x for x in block.splitlines()
             if x.startswith("| ") and " updates | " in x}
    assert len(lines) == 3  # pre-ln logged no enc_tok_cos: no line
    for (scheme, shape, seed, status, gain, cos, values), row in zip(RUNS, rows):
        if values is None:
            assert not any(k[1] == scheme for k in lines)
            continue
        pts = sorted(values.items())
        peak = max(pts, key=lambda uv: (uv[1], -uv[0]))
        warm = [uv for uv in pts if uv[0] <= 400][-1]
        above = [u for u, v in pts if v > 0.9]
        starts = [1] + [u + 1 for u, _ in pts[:-1]]
        warned = [u for (u, v), start in zip(pts, starts) if start > 400 and v > 0.9]
        outcome = failure(row) or "trained"
        assert outcome == {"admin": "trained", "post-ln": "ignores the source",
                           "admin-paper": "diverged"}[scheme]
        f = lambda uv: f"{uv[1]:.2f} ({uv[0]})"  # noqa: E731
        expect = (f"| {shape} | {scheme} | {seed} | lr 0.002, warmup 400, 700 updates | "
                  f"{outcome} | {f(pts[0])} | {f(peak)} | {f(warm)} | "
                  f"{above[-1] if above else 'never'} | {f(pts[-1])} | "
                  f"{warned[0] if warned else 'no'} | {f'{float(cos):.2f}' if cos else '-'} |")
        assert lines[(f"| {shape}", scheme, str(seed))] == expect
    # the trained run was last above 0.9 at update 250 of 700 (36%); both failed runs at
    # their last update (100%)
    assert ("Of the runs logged, 1 run that trained: last above 0.9 at 36% of the run's "
            "updates; 2 runs that failed: last above 0.9 at 100% of the run's updates. The "
            "monitor's collapse warning fires for 1 of the 2 runs that failed (at update 700); "
            "for 0 of the 1 run that trained.") in block


def test_no_course_without_a_logged_value(tmp_path):
    assert courses.course_lines([], lambda r: None, failure) == []
    row = dict(key="k", study="d128-700upd", scheme="admin", positions="sinusoidal",
               depth="6L-6L", seed="1", warmup="400", status="trained")
    missing = tmp_path / "nope.json"
    assert courses.course_lines([row], lambda r: missing, failure) == []
    # a row without its recipe columns (hand-made, or an older study's) and no curve: skipped
    # before they are read; with a curve but no warmup: no end-of-warmup value
    assert courses.course_lines([dict(key="x", curve_file="")], lambda r: None, failure) == []
    curve = tmp_path / "c.json"
    curve.write_text(json.dumps({"train": [{"update": 10, "enc_tok_cos": 0.95},
                                           {"update": 20, "enc_tok_cos": 0.5}]}))
    row.update(warmup="", lr="0.002", max_update="20", updates="20", source_gain="3.0")
    lines = courses.course_lines([row], lambda r: curve, failure)
    assert ("| 6L-6L | admin | 1 | lr 0.002, 20 updates | trained | 0.95 (10) | "
            "0.95 (10) | - | 10 | 0.50 (20) | no | - |") in lines
    assert lines[-1] == ("Of the runs logged, 1 run that trained: last above 0.9 at 50% of the "
                         "run's updates; no run that failed was logged. The monitor's collapse "
                         "warning fires for none of the runs that failed (none logged); for 0 of "
                         "the 1 run that trained.")


def test_a_continued_run_is_one_course_at_its_longer_run(tmp_path):
    """A 4800-update run that continues a 2400-update run's checkpoint logs the shorter run's
    course inside its own: one line, counted once."""
    short = dict(key="admin|48L-1L|seed1|2400upd", study="d128", scheme="admin",
                 positions="sinusoidal",
                 depth="48L-1L", seed="1", lr="0.001", warmup="2000", max_update="2400",
                 updates="2400", status="trained", source_gain="4.9", resumed_at="1400")
    long_ = dict(short, key="admin|48L-1L|seed1|4800upd", max_update="4800", updates="4800",
                 resumed_at=f"1400; 2400 (continues {short['key']})")
    curves = {}
    for r, pts in ((short, [(180, 0.97), (2000, 0.3), (2400, 0.06)]),
                   (long_, [(180, 0.97), (2000, 0.3), (2400, 0.06), (4800, 0.04)])):
        curves[r["key"]] = tmp_path / f"{r['max_update']}.json"
        curves[r["key"]].write_text(json.dumps(
            {"train": [{"update": u, "enc_tok_cos": c} for u, c in pts]}))
    assert courses.continued_keys([short, long_]) == {short["key"]}
    lines = courses.course_lines([short, long_], lambda r: curves[r["key"]], failure)
    rows = [x for x in lines if x.startswith("| 48L-1L")]
    assert rows == ["| 48L-1L | admin | 1 | lr 0.001, warmup 2000, 4800 updates | trained | "
                    "0.97 (180) | 0.97 (180) | 0.30 (2000) | 180 | 0.04 (4800) | no | - |"]
    assert lines[-1].startswith("Of the runs logged, 1 run that trained: last above 0.9 at 4% ")
