"""The converged-schedule page (benchmarks/depthstudy/converged.py): every number of its
blocks recomputed here from the rows and curves it was given."""
import json
import statistics
import sys

import pytest

from fairseq_cli_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from depthstudy import converged  # noqa: E402


def _row(scheme, depth, seed, updates, bleu, status="trained", lr="0.001", ve="200"):
    key = f"{scheme}|{depth}|seed{seed}|{updates}upd|d128|lr{lr}|wu2000|mt4096|ve{ve}"
    return {"key": key, "scheme": scheme, "depth": depth, "seed": str(seed),
            "max_update": str(updates), "lr": lr, "warmup": "2000", "validate_every": ve,
            "embed_dim": "128", "positions": "sinusoidal", "dropout": "0.1",
            "clip_norm": "0", "status": status, "bleu": f"{bleu:.2f}",
            "best_valid_nll": "3.100", "final_train_nll": "2.900",
            "curve_file": f"runs/{key.replace('|', '_')}/curve.json"}


@pytest.fixture
def page(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    docs.mkdir()
    text = "# t\n" + "".join(f"{converged.MARK.format(n, 'start')}\nold\n"
                             f"{converged.MARK.format(n, 'end')}\n"
                             for n in ("check", "table", "nll", "collapse", "readme", "speed"))
    (docs / "depth_converged.md").write_text(text)
    rows = [_row("admin", "6L-6L", 1, 2400, 31.0), _row("admin", "6L-6L", 1, 4800, 31.8),
            _row("admin", "6L-6L", 2, 2400, 30.2), _row("pre-ln", "48L-1L", 1, 2400, 12.0),
            _row("admin", "48L-1L", 1, 2400, 1.5, status="stuck"),
            # another schedule: not part of the page
            _row("admin", "6L-6L", 3, 2400, 10.0, lr="0.002"),
            _row("admin", "6L-6L", 3, 2400, 10.0, ve=""),
            # 18L-18L beyond 6L-6L's spread; 12L-1L within it; pre-ln 12L-1L one seed
            _row("admin", "18L-18L", 1, 2400, 32.9), _row("admin", "18L-18L", 2, 2400, 32.1),
            _row("admin", "12L-1L", 1, 2400, 30.1), _row("admin", "12L-1L", 2, 2400, 31.3),
            _row("pre-ln", "12L-1L", 1, 2400, 29.0),
            dict(_row("pre-ln", "48L-1L", 1, 4800, 13.0),
                 resumed_at=f"2400 (continues {_row('pre-ln', '48L-1L', 1, 2400, 0)['key']})")]
    curves = {
        # validation nll rises after its best: over-fitting
        rows[0]["key"]: dict(train=[], valid=[dict(update=u, nll=n, loss=n, ppl=1) for u, n in
                                              ((200, 5.0), (400, 3.0), (600, 3.2))]),
        # best at the last validation: still improving
        rows[1]["key"]: dict(train=[], valid=[dict(update=u, nll=n, loss=n, ppl=1) for u, n in
                                              ((200, 5.0), (400, 3.0), (4800, 2.8))]),
        # the encoder cosine above 0.9 for every logged interval after the warmup
        rows[4]["key"]: dict(train=[dict(update=u, loss=1, nll=1, enc_tok_cos=c) for u, c in
                                    ((1990, 0.5), (2000, 0.6), (2010, 0.97), (2020, 0.99),
                                     (2400, 0.98))],
                             valid=[dict(update=2400, nll=7.0, loss=7.0, ppl=1)]),
        rows[3]["key"]: dict(train=[dict(update=u, loss=1, nll=1, enc_tok_cos=c) for u, c in
                                    ((1000, 0.95), (2010, 0.5), (2400, 0.4))],
                             valid=[dict(update=2400, nll=3.5, loss=3.5, ppl=1)]),
        rows[-1]["key"]: dict(train=[dict(update=u, loss=1, nll=1, enc_tok_cos=c) for u, c in
                                     ((1000, 0.95), (2010, 0.5), (2400, 0.4), (4800, 0.3))],
                              valid=[dict(update=4800, nll=3.4, loss=3.4, ppl=1)]),
    }
    for r in rows:
        if r["key"] in curves:
            path = out / r["curve_file"]
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(curves[r["key"]]))
    _speed_csv(docs / converged.SPEED_CSV)
    # the grid's length given: the blocks' numbers do not depend on the check's verdict
    converged.fill(docs / "depth_converged.md", rows, out, docs, updates=2400)
    return (docs / "depth_converged.md").read_text()


SPEED = [  # scheme, shape, precision, batch, sentences/s, ms/sentence, ratio, BLEU, status
    ("admin", "6L-6L", "int8", "64", "200.0", "5.0", "1.000", "31.00", "trained"),
    ("admin", "6L-6L", "float32", "64", "120.0", "8.3", "1.000", "31.00", "trained"),
    ("admin", "6L-6L", "int8", "1", "40.0", "25.0", "1.000", "31.00", "trained"),
    ("admin", "12L-1L", "int8", "64", "380.0", "2.6", "1.900", "30.60", "trained"),
    ("admin", "48L-1L", "int8", "64", "500.0", "2.0", "2.500", "1.50", "stuck"),
    ("admin", "18L-18L", "int8", "64", "70.0", "14.3", "0.350", "32.90", "trained"),
]


def _speed_csv(path, run="20261207T0000Z-cells"):
    import csv

    fields = ["run", "scheme", "shape", "seed", "engine", "precision", "batch", "threads",
              "sentences_per_s", "ms_per_sentence", "ratio_to_6l6l", "bleu", "train_status",
              "cpu"]
    rows = [dict(zip(fields, (r, s, d, "1", "CTranslate2", p, b, "1", sps, ms, ratio, bleu,
                              status, "cpu x 2")))
            for r in ("20261201T0000Z-cells", run)
            for s, d, p, b, sps, ms, ratio, bleu, status in SPEED]
    # an older run with other numbers, and a 2-thread row: neither is shown
    rows[0]["sentences_per_s"] = "999.0"
    rows.append(dict(rows[-1], threads="2", sentences_per_s="140.0"))
    # the model's own BLEU comes from its fairseq + plugin row (int8 may differ)
    rows.append(dict(rows[-1], engine="fairseq + plugin", shape="6L-6L", precision="float32",
                     threads="1", batch="64",
                     sentences_per_s="60.0", bleu="31.10", ratio_to_6l6l="1.000"))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def _block(text, name):
    return text.split(converged.MARK.format(name, "start"))[1].split(
        converged.MARK.format(name, "end"))[0]


def test_check_gives_both_lengths_and_the_gain(page):
    line = next(l for l in _block(page, "check").splitlines() if l.startswith("| 6L-6L"))
    assert "| 31.00 | 31.80 | +0.80 |" in line
    assert "| 18L-18L | 32.90 | not run yet | - | 3.100 / - |" in _block(page, "check")
    # the longest run's curve by doublings: best so far at each; nothing logged past 4800
    assert "| 6L-6L | 3.000 | 3.000 | 3.000 | 2.800 |" in _block(page, "check")


def test_table_cells_are_mean_and_sample_std_over_the_recipes_seeds(page):
    line = next(l for l in _block(page, "table").splitlines() if l.startswith("| admin"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    mean, std = statistics.mean([31.0, 30.2]), statistics.stdev([31.0, 30.2])
    assert cells[0] == f"{mean:.2f} +- {std:.2f} (n=2); paper 27.90"
    assert cells[4] == "1.50 (n=1), 1 stuck"
    assert cells[1] == "not run yet; paper 28.58"
    # the missing runs are the plan's: seed 3 only where seeds 1 and 2 differ by over 1 BLEU
    assert "admin 6L-6L seed 3" not in page
    assert "admin 18L-18L seed 1 (4800)" in _block(page, "table")
    assert "admin 18L-18L seed 1 (2400)" not in _block(page, "table")


def test_nll_block_tells_over_fitting_from_under_training(page):
    block = _block(page, "nll")
    # the curve's lowest nll beside checkpoint_best's (the CSV's, chosen by validation loss)
    assert ("| admin | 6L-6L | 1 | 2400 | 2.900 | 3.000 (400) | 3.200 | 3.100 | over-fitting"
            in block)
    assert ("| admin | 6L-6L | 1 | 4800 | 2.900 | 2.800 (4800) | 2.800 | 3.100 | still improving"
            in block)


def test_collapse_block_replays_the_monitor_warning(page):
    block = _block(page, "collapse")
    # whole logged intervals above 0.9 after the 2000-update warmup start at update 2010
    assert "| admin | 1 | 2400 | 1.50 | stuck | 0.990 (2020) | 0.980 | 2010 |" in block
    assert "| pre-ln | 1 | 2400 | 12.00 | trained | 0.950 (1000) | 0.400 | not warned |" in block
    # pre-ln 48L-1L's 4800-update run continues its 2400-update run: one course, its own row
    assert "| pre-ln | 1 | 4800 | 13.00 | trained | 0.950 (1000) | 0.300 | not warned |" in block
    # the 6L-6L courses have no enc_tok_cos: two courses replayed, one failed and warned
    assert ("(2 courses, none of them among those the rule was set on): it warned for 1 of 1 "
            "that failed and for 0 of 1 that trained.") in block


def test_readme_answers_follow_the_rule_on_the_cells(page):
    block = _block(page, "readme")
    a6, a18, a121 = [31.0, 30.2], [32.9, 32.1], [30.1, 31.3]
    m = statistics.mean
    spread = max(statistics.stdev(a6), statistics.stdev(a18))
    assert 0.5 < m(a18) - m(a6) and spread < m(a18) - m(a6)
    assert (f"admin 18L-18L {m(a18):.2f} (n=2) vs 6L-6L {m(a6):.2f} (n=2): "
            f"{m(a18) - m(a6):+.2f}, higher beyond the seeds' spread (std {spread:.2f})."
            in block)
    spread = max(statistics.stdev(a6), statistics.stdev(a121))
    assert abs(m(a121) - m(a6)) <= 0.5
    assert (f"admin 12L-1L {m(a121):.2f} (n=2) vs 6L-6L {m(a6):.2f} (n=2): "
            f"{m(a121) - m(a6):+.2f}, within the seeds' spread (std {spread:.2f})." in block)
    assert "pre-ln 12L-1L vs 6L-6L: not measured yet." in block
    assert "admin 48L-1L: 1 of 1 runs failed (BLEU 1.50)." in block
    assert "pre-ln 48L-1L: 0 of 1 runs failed (BLEU 12.00)." in block
    assert "admin 12L-12L vs 6L-6L: not measured yet." in block
    # the paper's Post-LN fails from 12 layers on: the grid's deepest Post-LN cell
    assert "**Does depth pay?** Post-LN 18L-18L (failed in the paper): not run yet." in block


def test_one_seed_a_side_is_not_concluded():
    rows = [_row("admin", "6L-6L", 1, 2400, 30.0), _row("admin", "18L-18L", 1, 2400, 35.0)]
    text = converged.compare(rows[:1], rows[1:], "6L-6L", "admin 18L-18L")
    assert text.endswith("(n=1): +5.00, not concluded (one seed)")


def test_speed_block_shows_the_latest_runs_one_thread_rows(page):
    block = _block(page, "speed")
    assert "`20261207T0000Z-cells`" in block and "999.0" not in block and "140.0" not in block
    line = next(l for l in block.splitlines() if l.startswith("| admin | 12L-1L"))
    assert line == "| admin | 12L-1L | 1 | - | 30.60 | trained | 380.0 (x 1.900) | - | - |"
    line = next(l for l in block.splitlines() if l.startswith("| admin | 6L-6L"))
    assert line == ("| admin | 6L-6L | 1 | 31.10 | 31.00 | trained | 200.0 (x 1.000) | "
                    "120.0 (x 1.000) | 25.00 (x 1.000) |")
    # best BLEU 32.90 (18L-18L); within 0.5 of it only 18L-18L itself; 48L-1L failed
    assert ("Best int8 BLEU: admin 18L-18L 32.90. Fastest within 0.5 BLEU of it (CTranslate2 "
            "int8, batch 64): admin 18L-18L, 32.90 BLEU, 70.0 sentences/s.") in block


def test_a_cell_not_yet_at_the_grid_length_answers_from_its_shorter_runs():
    rows = [_row("admin", "48L-1L", 1, 2400, 31.5),
            _row("pre-ln", "48L-1L", 1, 2400, 1.2, status="stuck"),
            _row("pre-ln", "48L-1L", 1, 4800, 1.4, status="stuck")]
    text = "\n".join(converged.answer_lines(rows, updates=4800))
    assert ("admin 48L-1L: not run to 4800 updates yet; at 2400: 0 of 1 runs failed "
            "(BLEU 31.50).") in text
    # a run at the grid's length is answered from alone
    assert "pre-ln 48L-1L: 1 of 1 runs failed (BLEU 1.40)." in text
    assert "Post-LN 18L-18L (failed in the paper): not run yet." in text
    # the table says the same
    admin, pre = (next(l for l in converged.table_lines(rows, updates=4800)
                       if l.startswith(f"| {s} |")) for s in ("admin", "pre-ln"))
    assert admin.endswith("| not at 4800 yet (at 2400: 31.50 (n=1)) |")
    assert pre.endswith("| 1.40 (n=1), 1 stuck |")


def test_fastest_within_half_a_bleu_is_the_fastest_near_model():
    rows = [dict(precision="int8", batch="64", train_status=s, bleu=b, sentences_per_s=v,
                 scheme="admin", shape=d)
            for d, b, v, s in (("6L-6L", "31.00", "200.0", "trained"),
                               ("12L-1L", "30.60", "380.0", "trained"),
                               ("24L-1L", "30.40", "450.0", "trained"),
                               ("48L-1L", "1.00", "900.0", "stuck"))]
    assert converged.fastest_line(rows).endswith("admin 12L-1L, 30.60 BLEU, 380.0 sentences/s.")


def test_every_cell_trains_its_first_length_before_a_longer_one():
    from depthstudy.plan import CONVERGED_LONG, CONVERGED_RECIPE, CONVERGED_UPDATES, PLANS

    grid = PLANS["converged"]
    assert len(set(grid)) == len(grid)
    first = CONVERGED_RECIPE["max_update"]
    for i, item in enumerate(grid):
        if item[4] > first:
            assert item[:4] + (first,) in grid[:i]
    cells = {(s, d) for s, d, seed, _, n in grid if n == CONVERGED_UPDATES}
    # at a longer length 12L-12L is Admin's alone
    assert len(cells) == (11 if CONVERGED_LONG else 13) and all(
        (s, d, seed, "sinusoidal", CONVERGED_UPDATES) in grid for s, d in cells for seed in (1, 2))


def test_grid_length_agrees_with_the_published_check():
    """CONVERGED_UPDATES is the check's verdict: twice the length once doubling added
    0.5 BLEU or more to either shape (docs/depth_study_results.csv)."""
    from depthstudy.plan import CONVERGED_RECIPE, CONVERGED_UPDATES
    from depthstudy.report import read_rows

    rows = converged.converged_rows(read_rows(REPO / "docs" / "depth_study_results.csv"))
    n = CONVERGED_RECIPE["max_update"]
    gains = []
    for depth in ("6L-6L", "18L-18L"):
        a, b = ([r for r in converged._cell(rows, "admin", depth, k) if r["seed"] == "1"]
                for k in (n, 2 * n))
        if a and b:
            gains.append(float(b[0]["bleu"]) - float(a[0]["bleu"]))
    if any(g >= converged.GAIN_BLEU for g in gains):
        assert CONVERGED_UPDATES == 2 * n
    elif len(gains) == 2:
        assert CONVERGED_UPDATES == n


def test_a_run_that_ignores_the_source_counts_as_failed():
    blind = dict(_row("admin", "48L-1L", 2, 2400, 2.0), source_gain="0.10")
    rows = [_row("admin", "48L-1L", 1, 2400, 30.0, status="trained"), blind]
    line = next(l for l in converged.table_lines(rows, 2400) if l.startswith("| admin"))
    assert "| 16.00 +- 19.80 (n=2), 1 ignores the source |" in line
    assert "  - admin 48L-1L: 1 of 2 runs failed (BLEU 30.00, 2.00)." in \
        converged.answer_lines(rows, 2400)


def test_a_third_seed_where_the_first_two_differ_by_more_than_one_bleu():
    from depthstudy.plan import CONVERGED_UPDATES as n

    rows = [_row("admin", "12L-1L", 1, n, 30.0), _row("admin", "12L-1L", 2, n, 31.2),
            _row("pre-ln", "12L-1L", 1, n, 30.0), _row("pre-ln", "12L-1L", 2, n, 31.0),
            _row("admin", "6L-6L", 1, n, 30.0)]
    items = converged.third_seeds(rows)
    assert [i[:3] for i in items] == [("admin", "12L-1L", 3)] * len(items)
    assert items[-1][4] == n
    assert f"admin 12L-1L seed 3 ({n})" in converged.missing_line(converged.converged_rows(rows))


# (6L-6L seeds, 18L-18L seeds, cells given a third seed). The line a difference must pass is
# max(0.5, larger std); a cell turns the verdict when one of its seeds in place of its mean
# moves the difference across that line:
@pytest.mark.parametrize("base,deep,third", [
    # -0.90, line 0.50; one seed in place of a mean: -0.70 or -1.10, lower every time
    ((36.0, 36.4), (35.1, 35.5), set()),
    # -0.60, line 0.50; 35.60 - 36.00 = -0.40 and 35.80 - 36.20 = -0.40 are within: both turn
    ((36.0, 36.4), (35.4, 35.8), {"6L-6L", "18L-18L"}),
    # -0.65, line 0.50 (stds 0.07 and 0.35); 6L-6L's seeds give -0.60 and -0.70, lower;
    # 18L-18L's give -0.90, lower, and -0.40, within: only 18L-18L's seeds turn it
    ((36.0, 36.1), (35.15, 35.65), {"18L-18L"}),
    # +0.00, within the spread, and within it for every seed (+-0.10)
    ((36.0, 36.2), (36.1, 36.1), set()),
])
def test_a_third_seed_where_a_comparison_turns_on_one_seed(base, deep, third):
    from depthstudy.plan import CONVERGED_UPDATES as n

    rows = [_row("admin", d, seed, n, bleu) for d, bleus in (("6L-6L", base), ("18L-18L", deep))
            for seed, bleu in enumerate(bleus, 1)]
    assert {i[1] for i in converged.third_seeds(rows) if i[0] == "admin"} == third


def test_a_third_seed_where_two_seeds_disagree_on_failure():
    from depthstudy.plan import CONVERGED_UPDATES as n

    rows = [_row("admin", "48L-1L", 1, n, 34.0), _row("admin", "48L-1L", 2, n, 33.5,
                                                      status="diverged")]
    assert {i[:3] for i in converged.third_seeds(rows)} == {("admin", "48L-1L", 3)}


@pytest.mark.parametrize("statuses,skips", [(("stuck", "diverged"), True),
                                            (("stuck", "trained"), False), (("stuck",), False)])
def test_post_ln_18l_is_skipped_only_where_12l_failed_with_both_seeds(statuses, skips):
    from depthstudy.plan import CONVERGED_LONG, CONVERGED_UPDATES as n

    rows = [_row("post-ln", "12L-12L", seed, n, 1.0 if st != "trained" else 25.0, status=st)
            for seed, st in enumerate(statuses, 1)]
    skipped = converged.skipped(rows)
    if skips and not CONVERGED_LONG:
        assert {g[:3] for g in skipped} == {("post-ln", "18L-18L", 1), ("post-ln", "18L-18L", 2)}
        line = converged.missing_line(converged.converged_rows(rows))
        assert "post-ln 18L-18L" not in line.split(":", 1)[1].split(". ")[0]
        assert line.endswith("Post-LN 12L-12L failed with both seeds.")
    else:
        assert skipped == []


def test_post_ln_18l_is_last_only_where_it_may_be_skipped():
    from depthstudy.plan import CONVERGED_LONG, PLANS

    grid = PLANS["converged"]
    first = min(i for i, g in enumerate(grid) if g[:2] == ("post-ln", "18L-18L"))
    after = [g[:2] == ("post-ln", "18L-18L") for g in grid[first:]]
    # always run where 12L-12L is Admin's alone: its seed 1 comes before every seed 2
    assert all(after) != CONVERGED_LONG
    assert (grid[first][2], grid[first - 1][2]) == (1, 1 if CONVERGED_LONG else 2)
    assert {g[2] for g in grid if g[:2] == ("post-ln", "18L-18L")} == {1, 2}


def test_cells_outside_the_grid_say_so():
    from depthstudy.plan import CONVERGED_LONG, CONVERGED_UPDATES as n

    lines = converged.table_lines([], n)
    post = next(l for l in lines if l.startswith("| post-ln"))
    assert "| not in the grid |" in post  # Post-LN at 12L-1L is not part of the grid
    pre = next(l for l in lines if l.startswith("| pre-ln"))
    # at a longer length 12L-12L is Admin's alone
    assert ("not in the grid; paper 28.26" in pre) == CONVERGED_LONG
    answers = "\n".join(converged.answer_lines([], n))
    assert ("pre-ln 12L-12L vs 6L-6L" in answers) != CONVERGED_LONG
    post = "18L-18L" if CONVERGED_LONG else "12L-12L"
    assert f"Post-LN {post} (failed in the paper): not run yet." in answers
