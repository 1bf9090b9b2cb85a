"""``depth_study.py``'s publish (``publish.publish``) of the deep-shallow block on hand-made
rows: the cells with means and sample stds recomputed here with ``statistics``, the "fastest
within 0.5 BLEU" line of a constructed case (picked by within-run ratio where the absolute
speeds of two runs would pick another cell; a failed timed model left out; the BLEU given up
is the timed models' own, not the cells' means), the speed tables (one line per run, failed
timed models marked, the WMT shapes' batch a cap with its real mean), the figure's points;
nothing changed without the plan's rows; the warmup plan's table beside the demo recipe's
rows, with the distances recomputed.
"""
from __future__ import annotations

import csv
import statistics

import pytest

from deploy_speed_utils import FIELDS, bench, recipe_key  # noqa: F401
from study_utils import publish_folders, published_block


# -- publishing ----------------------------------------------------------------------------
PAGE = ("# page\n\n<!-- depth_study table: start -->\nold\n<!-- depth_study table: end -->\n\n"
        "## Deep encoder, shallow decoder\n\n<!-- deep_shallow table: start -->\n"
        "placeholder\n<!-- deep_shallow table: end -->\n\nafter\n")

# (scheme, shape): [(seed, status, bleu, best valid nll)]
CELLS = {
    ("admin", "6L-6L"): [(1, "trained", 28.0, 3.40), (2, "trained", 28.6, 3.38)],
    ("admin", "12L-3L"): [(1, "trained", 30.2, 3.30), (2, "trained", 29.6, 3.36),
                          (3, "trained", 30.2, 3.31)],
    ("admin", "12L-1L"): [(1, "trained", 29.9, 3.35), (2, "trained", 29.5, 3.39)],
    ("admin", "24L-1L"): [(1, "trained", 29.7, 3.37)],
    ("pre-ln", "12L-3L"): [(1, "trained", 29.9, 3.32)],
    ("pre-ln", "48L-1L"): [(1, "trained", 29.4, 3.50)],
    ("post-ln", "12L-1L"): [(1, "diverged", 2.1, 5.10), (2, "stuck", 0.5, 7.80),
                            (3, "trained", 20.0, 4.00)],
}
# (scheme, shape, seed): source gain in bits; post-ln's seed 3 and pre-ln 12L-3L "trained"
# but read no source
GAINS = {("post-ln", "12L-1L", 3): 0.65, ("pre-ln", "48L-1L", 1): 2.05,
         ("admin", "24L-1L", 1): 1.5, ("pre-ln", "12L-3L", 1): 0.4}
# (scheme, shape, seed): encoder cos of the probed runs (the others were not probed)
COLLAPSE = {("post-ln", "12L-1L", 3): 0.9987, ("pre-ln", "48L-1L", 1): 0.5912,
            ("admin", "12L-1L", 1): 0.4021, ("admin", "12L-1L", 2): 0.4556}
# CTranslate2 int8, batch 64, 1 thread: (run, scheme, shape, timed seed, sentences/s, BLEU of
# the timed output). Run r2 ran on a slower machine: admin 24L-1L is the fastest by its ratio
# to its own run's 6L-6L (3.00) though admin 12L-1L (r1) is faster in sentences/s; pre-ln
# 12L-3L is faster still, but its timed model failed; pre-ln 48L-1L's run r3 timed no 6L-6L.
SPEED = [("r1", "admin", "6L-6L", 1, 200.0, 28.10), ("r1", "admin", "12L-3L", 1, 250.0, 30.15),
         ("r1", "admin", "12L-1L", 1, 400.0, 29.85), ("r1", "pre-ln", "6L-6L", 1, 198.0, 28.00),
         ("r1", "pre-ln", "12L-3L", 1, 990.0, 29.90), ("r2", "admin", "6L-6L", 2, 100.0, 30.50),
         ("r2", "admin", "24L-1L", 1, 300.0, 29.70), ("r3", "pre-ln", "48L-1L", 1, 900.0, 29.40)]


def distinct(seed, status):
    """The hand-made rows' count of different test translations."""
    return 1000 - seed if status == "trained" else 3 + seed


def speed_row(kind, run_id, scheme, shape, engine, precision, sps, seed=1, bleu=None,
              batch="64", threads="1"):
    return dict(run=run_id, kind=kind, shape=shape, scheme=scheme, seed=str(seed),
                engine=engine, precision=precision, batch=batch, threads=threads,
                sentences="1000", rounds="3", sentences_per_s=f"{sps:.3f}",
                ms_per_sentence=f"{1000 / sps:.3f}", bleu="" if bleu is None else f"{bleu:.2f}",
                fallback_sentences="" if engine == "CTranslate2" else "0",
                fallback_seconds="" if engine == "CTranslate2" else "0", note="",
                cpu="Test CPU x 2", vocab="32000",
                mean_batch="20.0" if kind == "wmt-shapes" else "")  # fixed lengths: mean < cap


def speed_rows():
    """The constructed case's rows, their ratios within their runs."""
    from deployspeed.timing import add_ratios

    rows = [speed_row("cells", run_id, s, d, "CTranslate2", "int8", x, seed, bleu)
            for run_id, s, d, seed, x, bleu in SPEED]
    rows += [speed_row("cells", run_id, s, d, "fairseq + plugin", "float32", x / 3, seed, bleu)
             for run_id, s, d, seed, x, bleu in SPEED]
    rows += [speed_row("cells", "r1", "post-ln", "12L-1L", "fairseq + plugin", "float32", 90.0,
                       bleu=2.1),
             speed_row("cells", "r1", "admin", "12L-1L", "CTranslate2", "int8", 50.0,
                       bleu=29.85, batch="1")]
    fast = next(r for r in rows if (r["shape"], r["engine"]) == ("24L-1L", "CTranslate2"))
    fast.update(fallback_sentences="3", fallback_seconds="0.25")
    add_ratios(rows)
    return rows


def publish_case(tmp_path, with_speed=True, rows=True):
    from depthstudy.report import write_rows
    from deployspeed.timing import add_ratios

    out, docs = publish_folders(tmp_path, PAGE)
    table = []
    for (scheme, shape), runs in (CELLS.items() if rows else []):
        for seed, status, bleu, nll in runs:
            table.append(dict(key=recipe_key(scheme, shape, seed), study="d128-700upd",
                              scheme=scheme, positions="sinusoidal", depth=shape, seed=seed,
                              status=status, bleu=f"{bleu:.2f}", best_valid_nll=f"{nll:.3f}",
                              distinct_hyps=distinct(seed, status), embed_dim=128,
                              source_gain=GAINS.get((scheme, shape, seed), ""),
                              encoder_cos=COLLAPSE.get((scheme, shape, seed), ""),
                              max_update=700, lr="0.002", warmup=400))
    # a row of another plan's recipe (lr 1e-3) must not be counted
    table.append(dict(key=recipe_key("admin", "6L-6L", 1).replace("lr0.002", "lr0.001"),
                      study="d128-700upd", scheme="admin", positions="sinusoidal",
                      depth="6L-6L", seed=1, status="trained", bleu="40.00", lr="0.001"))
    write_rows(out / "results.csv", table)
    if with_speed:
        with open(docs / "deploy_speed_cells.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(speed_rows())
        shapes = [speed_row("wmt-shapes", "w1", "admin", s, "CTranslate2", "int8", x, "")
                  for s, x in (("6L-6L", 20.0), ("12L-1L", 35.0))]
        for r in shapes:
            r.update(fallback_sentences="0", fallback_seconds="0")
        add_ratios(shapes)
        with open(docs / "deploy_speed_shapes.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(shapes)
    from depthstudy.publish import publish

    publish(out, docs)
    block = published_block(docs, "<!-- deep_shallow table: start -->",
                            "<!-- deep_shallow table: end -->")
    return block, docs


def test_publish_writes_the_cells_with_means_and_stds(tmp_path, bench):
    block, docs = publish_case(tmp_path)
    for (scheme, shape), runs in CELLS.items():
        bleus, nlls = [r[2] for r in runs], [r[3] for r in runs]
        if len(runs) > 1:
            bleu = f"{statistics.mean(bleus):.2f} +- {statistics.stdev(bleus):.2f}"
            nll = f"{statistics.mean(nlls):.3f} +- {statistics.stdev(nlls):.3f}"
        else:
            bleu, nll = f"{bleus[0]:.2f}", f"{nlls[0]:.3f}"
        # a trained run under 1.5 bits of source gain counts as one that ignores the source
        bad = sorted(r[1] if r[1] != "trained" else "ignores the source" for r in runs
                     if r[1] != "trained" or GAINS.get((scheme, shape, r[0]), 9) < 1.5)
        fails = ", ".join(f"1 {st}" for st in bad) or "none"
        seeds = ",".join(str(r[0]) for r in runs)
        line = f"| {shape} | {scheme} | {seeds} | {len(runs)} | {bleu} | {nll} | {fails} |"
        assert line in block, line
        # the last columns: the fewest different translations over the cell's seeds, the
        # highest encoder cos over its probed seeds
        full = next(x for x in block.splitlines() if x.startswith(line))
        cos = [COLLAPSE[scheme, shape, r[0]] for r in runs if (scheme, shape, r[0]) in COLLAPSE]
        assert full.endswith(f"| {min(distinct(r[0], r[1]) for r in runs)} | "
                             f"{f'{max(cos):.2f}' if cos else '-'} |"), full
    # every cell of the plan is listed, run or not; the lr 1e-3 row is not counted
    assert "| 48L-1L | admin | - | 0 | not run yet |" in block
    assert "40.00" not in block
    # 13 hand-made runs; the plan: 4 schemes x 5 shapes x 3 seeds
    assert "13 of 60 planned runs recorded" in block
    assert (tmp_path / "docs" / "results.md").read_text().startswith(
        "# page\n\n<!-- depth_study table: start -->\nnew table\n")


@pytest.mark.parametrize("status, gain, why", [
    ("trained", "0.6500", "ignores the source"), ("trained", "-0.0000", "ignores the source"),
    ("trained", "1.4999", "ignores the source"), ("trained", "1.5", ""),
    ("trained", "2.52", ""), ("trained", "", ""), ("diverged", "0.1", "diverged"),
    ("stuck", "", "stuck")])
def test_failure_is_the_status_or_a_decoder_that_ignores_the_source(bench, status, gain, why):
    from depthstudy.deepshallow import failure, failures

    assert failure({"status": status, "source_gain": gain}) == why
    rows = [{"status": status, "source_gain": gain}] * 2 + [{"status": "trained"}]
    assert failures(rows) == (f"2 {why}" if why else "none")


def test_publish_names_the_fastest_model_within_half_a_bleu(tmp_path, bench):
    """Ranked by the ratio to the 6L-6L of the cell's own run, not by sentences/s across
    runs; a failed timed model is left out; the BLEU given up is the timed models' own."""
    block, docs = publish_case(tmp_path)
    means = {c: statistics.mean(r[2] for r in runs) for c, runs in CELLS.items()}
    best = max(means, key=means.get)
    near = [c for c in means if means[c] >= means[best] - 0.5]
    int8 = {(s, d): (run_id, seed, x, bleu) for run_id, s, d, seed, x, bleu in SPEED}
    base = {run_id: (seed, x, bleu) for run_id, s, d, seed, x, bleu in SPEED
            if (s, d) == ("admin", "6L-6L")}
    trained = [c for c in near if c != ("pre-ln", "12L-3L")]  # its timed seed reads no source
    by_ratio = max(trained, key=lambda c: int8[c][2] / base[int8[c][0]][1])
    assert best == ("admin", "12L-3L") and len(near) == 4
    assert by_ratio == ("admin", "24L-1L") != max(trained, key=lambda c: int8[c][2])
    run_id, seed, x, bleu = int8[by_ratio]
    b_seed, b_x, b_bleu = base[run_id]
    assert (f"Best model of the study (mean BLEU over seeds): admin 12L-3L, "
            f"{means[best]:.2f}.") in block
    line = next(x for x in block.splitlines() if x.startswith("Best model"))
    assert line.endswith(
        "(4 cells qualify, 4 timed, 3 beside their 6L-6L; 1 left out, their timed model "
        f"failed): **admin 24L-1L** (mean BLEU {means[by_ratio]:.2f}; {x:.1f} sentences/s, "
        f"CTranslate2 int8, batch 64, 1 thread, run r2), {x / b_x:.2f} times the speed of "
        f"admin 6L-6L in the same run, for {b_bleu - bleu:.2f} BLEU less (the timed models: "
        f"seed {seed} {bleu:.2f} against 6L-6L seed {b_seed} {b_bleu:.2f})."), line
    # the cells' means would give another gap
    assert f"{abs(means[by_ratio] - means['admin', '6L-6L']):.2f} BLEU" not in line
    # the cells table: the latest run's speed, its run, the ratio within it, the timed
    # models' BLEU gap; no ratio without a 6L-6L in the run; failed timed models marked
    assert "| 300.0 | r2 | 3.00 | -0.80 |" in block and "| 100.0 | r2 | 1.00 | +0.00 |" in block
    assert "| 400.0 | r1 | 2.00 | +1.75 |" in block and "| 900.0 | r3 | - | - |" in block
    assert "| 990.0 (failed) | r1 | 5.00 | +1.90 |" in block
    assert "| 90.0 (plugin) (failed) | r1 | - | - |" in block
    # every engine, batch and thread count stays in the CSV the block links, not repeated
    cells_part = block[:block.index("The same shapes at WMT base width")]
    assert "| CTranslate2 float32 |" not in cells_part and "| fairseq + plugin |" not in cells_part
    assert "[deploy_speed_cells.csv](deploy_speed_cells.csv)" in cells_part
    assert "Failed timed models (post-ln 12L-1L, pre-ln 12L-3L):" in block
    # the WMT shapes: the batch is a cap, the mean batch what ran
    assert "untrained models with the output length held to each sentence's reference " \
           "length" in block
    assert '"batch 64" is a cap of 64, the batches it gave held 20.0 sentences on average' \
        in block
    assert "| 12L-1L | admin | - | CTranslate2 int8 | 35.0 | - | 1.750 | w1 |" in block
    shapes_table = block[block.index("The same shapes at WMT base width"):]
    assert "| batch cap 64 (mean 20.0), 1 thr: sent/s |" in shapes_table
    assert "batch cap" not in block[:block.index("The same shapes at WMT base width")]
    png = docs / "deep_shallow_speed_quality.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figure_leaves_failed_timed_models_out(bench):
    from depthstudy.deepshallow import cell_rows, plot_points

    rows = [dict(key=recipe_key(s, d, seed), scheme=s, positions="sinusoidal", depth=d,
                 seed=seed, status=status, bleu=f"{bleu:.2f}",
                 source_gain=GAINS.get((s, d, seed), ""))
            for (s, d), runs in CELLS.items() for seed, status, bleu, _ in runs]
    points = plot_points(cell_rows(rows), speed_rows())
    got = {(p["scheme"], p["shape"]): (p["x"], p["exported"]) for p in points}
    assert got == {("admin", "6L-6L"): (100.0, True), ("admin", "12L-3L"): (250.0, True),
                   ("admin", "12L-1L"): (400.0, True), ("admin", "24L-1L"): (300.0, True),
                   ("pre-ln", "48L-1L"): (900.0, True)}


def test_publish_without_speed_says_so_and_draws_nothing(tmp_path, bench):
    block, docs = publish_case(tmp_path, with_speed=False)
    assert "Deployed speed: not measured yet" in block
    assert "None of the 4 cells within 0.5 BLEU of it has a deployed speed yet" in block
    assert not (docs / "deep_shallow_speed_quality.png").exists()


def test_publish_without_the_plans_rows_leaves_the_block(tmp_path, bench):
    block, docs = publish_case(tmp_path, rows=False)
    assert block == "placeholder\n"
    assert not (docs / "deep_shallow_speed_quality.png").exists()


def test_plan_args_are_the_studys_keys(bench):
    """The keys the plan's runs get from depth_study.py's own argument handling."""
    from study_utils import load_study_module

    ds = load_study_module()
    args = ds.build_parser().parse_args(["--plan", "deep-shallow"])
    for name, value in ds.PRESETS["demo"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    assert ds.run_key("admin", "12L-1L", 1, args) == recipe_key("admin", "12L-1L", 1)


def test_publish_sets_the_warmup_plan_beside_the_demo_recipe(tmp_path, bench):
    """``--plan deep-shallow-warmup``'s rows (with the same recipe's 24L-3L pair) get their own
    table beside the same cells at the demo recipe, and per shape the paper's Admin's distance
    to the closed form at both recipes, recomputed here."""
    from depthstudy.deepshallow import plan_args
    from depthstudy.plan import run_key
    from depthstudy.publish import publish
    from depthstudy.report import write_rows

    # (scheme, shape, recipe): [(seed, status, bleu, nll, distinct)]
    runs = {("admin-paper", "12L-1L", "warmup"): [(1, "trained", 24.5, 3.80, 990)],
            ("admin", "12L-1L", "warmup"): [(1, "trained", 27.0, 3.60, 1000)],
            ("admin-paper", "24L-3L", "warmup"): [(1, "trained", 33.26, 2.984, 1000),
                                                  (2, "trained", 33.42, 3.017, 1000)],
            ("admin", "24L-3L", "warmup"): [(1, "trained", 34.08, 2.994, 1000)],
            ("admin-paper", "12L-1L", "deep-shallow"): [(1, "trained", 19.2, 4.20, 1000)],
            ("admin", "12L-1L", "deep-shallow"): [(1, "trained", 27.4, 3.70, 1000),
                                                  (2, "trained", 24.4, 3.88, 1000)],
            ("admin-paper", "24L-3L", "deep-shallow"): [(1, "stuck", 3.6, 5.03, 358)],
            ("post-ln", "12L-1L", "warmup"): [(1, "trained", 21.0, 3.90, 980)],
            ("post-ln", "12L-1L", "deep-shallow"): [(1, "trained", 1.5, 5.2, 196)]}
    table = []
    for (scheme, shape, recipe), rs in runs.items():
        args = plan_args("deep-shallow-warmup" if recipe == "warmup" else "deep-shallow")
        for seed, status, bleu, nll, dist in rs:
            table.append(dict(key=run_key(scheme, shape, seed, args), scheme=scheme,
                              positions="sinusoidal", depth=shape, seed=seed, status=status,
                              bleu=f"{bleu:.2f}", best_valid_nll=f"{nll:.3f}",
                              distinct_hyps=dist))
    out, docs = publish_folders(tmp_path, PAGE)
    write_rows(out / "results.csv", table)
    publish(out, docs)
    block = published_block(docs, "<!-- deep_shallow table: start -->",
                            "<!-- deep_shallow table: end -->")
    assert "(lr 0.001, warmup 2000, 2400 updates;" in block, block
    assert "| 12L-1L | admin-paper | 1 | 24.50 | 3.800 | none | 990 | 19.20 (seed 1) |" in block
    demo = statistics.mean([27.4, 24.4]), statistics.stdev([27.4, 24.4])
    assert (f"| 12L-1L | admin | 1 | 27.00 | 3.600 | none | 1000 | {demo[0]:.2f} +- "
            f"{demo[1]:.2f} (seeds 1,2) |") in block
    ref = statistics.mean([33.26, 33.42]), statistics.stdev([33.26, 33.42])
    assert f"| 24L-3L | admin-paper | 1,2 | {ref[0]:.2f} +- {ref[1]:.2f} |" in block
    assert "| 24L-3L | admin | 1 | 34.08 | 2.994 | none | 1000 | - |" in block
    # stock Post-LN at 12L-1L after the Admin pair; no Post-LN 24L-3L reference
    assert block.index("| 12L-1L | admin | 1 |") < block.index(
        "| 12L-1L | post-ln | 1 | 21.00 | 3.900 | none | 980 | 1.50 (seed 1) |")
    assert "| 24L-3L | post-ln |" not in block and "stock Post-LN at 12L-1L" in block
    # the plan's 24L-1L cells are listed, not run
    assert "| 24L-1L | admin-paper | - | not run yet |" in block
    assert (f"- 12L-1L: admin-paper minus admin, mean BLEU: {24.5 - 27.0:+.2f} at lr 0.001, "
            f"warmup 2000, 2400 updates; {19.2 - demo[0]:+.2f} at the demo recipe.") in block
    assert (f"- 24L-3L: admin-paper minus admin, mean BLEU: {ref[0] - 34.08:+.2f} at lr 0.001, "
            "warmup 2000, 2400 updates; not measured at the demo recipe.") in block
    # without a row of the warmup plan's own cells there is no warmup table
    table = [r for r in table if not (r["depth"] == "12L-1L" and "wu2000" in r["key"])]
    write_rows(out / "results.csv", table)
    publish(out, docs)
    assert "deep-shallow-warmup" not in published_block(
        docs, "<!-- deep_shallow table: start -->", "<!-- deep_shallow table: end -->")


def fastest_case(*timed):
    """``fastest_line`` of two cells 0.2 BLEU apart, each timed as given: (run, shape,
    scheme, sentences/s, ratio), the BLEU of the timed output 29.00."""
    from depthstudy.deepshallow import Speed, X_SPEED, fastest_line

    groups = {("admin", "6L-6L"): [{"bleu": "30.00", "seed": "1", "status": "trained"}],
              ("admin", "12L-1L"): [{"bleu": "29.80", "seed": "1", "status": "trained"}],
              ("admin-paper", "6L-6L"): [{"bleu": "29.90", "seed": "1", "status": "trained"}]}
    engine, precision, batch, threads = X_SPEED
    rows = [dict(run=run_id, kind="cells", scheme=scheme, shape=shape, seed="1",
                 engine=engine, precision=precision, batch=batch, threads=threads,
                 sentences_per_s=str(x), ratio_to_6l6l=ratio, bleu="29.00")
            for run_id, shape, scheme, x, ratio in timed]
    return fastest_line(groups, Speed(rows))


def test_fastest_line_without_a_6l6l_in_the_cells_run(bench):
    line = fastest_case(("r1", "12L-1L", "admin", 300.0, ""))
    assert line.endswith("None of the 1 timed cells within 0.5 BLEU of it was timed beside its "
                         "scheme's 6L-6L in one run, so no fastest model is named (speeds of "
                         "different runs are not compared).")


def test_fastest_line_ties_are_named_together_unless_one_run_timed_both(bench):
    """Two 6L-6L models, each the base of its own run (ratio 1.00): a tie, not compared by
    sentences/s; timed in one run, the faster one."""
    line = fastest_case(("r1", "6L-6L", "admin", 228.7, "1.000"),
                        ("r2", "6L-6L", "admin-paper", 204.9, "1.000"),
                        ("r1", "12L-1L", "admin", 190.0, "0.831"))
    assert ("**admin 6L-6L** (mean BLEU 30.00; 228.7 sentences/s, CTranslate2 int8, batch 64, "
            "1 thread, run r1) and **admin-paper 6L-6L** (mean BLEU 29.90; 204.9 sentences/s, "
            "CTranslate2 int8, batch 64, 1 thread, run r2), tied at 1.00 times their 6L-6L; "
            "their runs differ, and speeds of different runs are not compared: no cell within "
            "0.5 BLEU runs faster than its scheme's 6L-6L.") in line
    assert "(3 cells qualify, 3 timed, 3 beside their 6L-6L)" in line
    line = fastest_case(("r1", "6L-6L", "admin", 200.0, "1.000"),
                        ("r1", "6L-6L", "admin-paper", 210.0, "1.000"))
    assert line.endswith("**admin-paper 6L-6L** (mean BLEU 29.90; 210.0 sentences/s, "
                         "CTranslate2 int8, batch 64, 1 thread, run r1): no cell within 0.5 "
                         "BLEU runs faster than its scheme's 6L-6L.")
