"""depth_study.py's publishing of the 2025 placements' block (``depthstudy.norms2025``) on
hand-made rows and a hand-made speed JSON: every cell's mean and sample std, its difference to
Admin's mean and the standing line recomputed here with ``statistics``; the speed ratios divided
here; the rows of another recipe left out; the page unchanged without a run of the plan's own
schemes.
"""
from __future__ import annotations

import json
import statistics

import pytest

from study_utils import load_study_module, publish_folders, published_block

PAGE = ("# page\n\n<!-- depth_study table: start -->\nold\n<!-- depth_study table: end -->\n\n"
        "## Peri-LN, Mix-LN and DyT\n\n<!-- norms_2025 table: start -->\nplaceholder\n"
        "<!-- norms_2025 table: end -->\n\nafter\n")

# (scheme, depth): [(seed, status, bleu, best valid nll, distinct translations)]
CELLS = {
    ("admin", "24L-3L"): [(1, "trained", 25.5, 3.72, 999), (2, "trained", 21.8, 3.89, 998),
                          (3, "trained", 25.2, 3.74, 1000)],
    ("pre-ln", "24L-3L"): [(1, "trained", 22.9, 3.88, 997), (2, "trained", 21.2, 3.95, 999)],
    ("post-ln", "24L-3L"): [(1, "trained", 2.5, 5.10, 1)],
    ("peri-ln", "24L-3L"): [(1, "trained", 24.0, 3.80, 990), (2, "trained", 23.1, 3.85, 995)],
    ("pre-ln-dyt", "24L-3L"): [(1, "diverged", 0.3, 7.90, "")],
    ("admin", "12L-12L"): [(1, "trained", 30.7, 3.29, 1000)],
    ("mix-ln", "12L-12L"): [(2, "stuck", 0.4, 7.85, 4)],
    ("post-ln-dyt", "12L-12L"): [(3, "stuck", 0.5, 7.80, 3)],
}
DYT_ELSEWHERE = ("peri-ln-dyt", "mix-ln-dyt", "post-ln-dyt")
SPEED = {"stock": 1000.0, "admin": 1010.0, "pre-ln": 1020.0, "peri-ln": 960.0,
         "pre-ln-dyt": 930.0}


@pytest.fixture(scope="module")
def study():
    return load_study_module()  # puts benchmarks/ on sys.path (depthstudy)


def key(scheme, depth, seed, lr="0.002"):
    from depthstudy.deepshallow import plan_args
    from depthstudy.plan import run_key

    return run_key(scheme, depth, seed, plan_args("norms-2025")).replace("lr0.002", f"lr{lr}")


def publish_case(tmp_path, cells=CELLS, speed=True):
    from depthstudy.publish import publish
    from depthstudy.report import write_rows

    out, docs = publish_folders(tmp_path, PAGE)
    rows = [dict(key=key(s, d, seed), study="d128-700upd", scheme=s, positions="sinusoidal",
                 depth=d, seed=seed, status=st, bleu=f"{b:.2f}", best_valid_nll=f"{n:.3f}",
                 distinct_hyps=dh, embed_dim=128, max_update=700, lr="0.002", warmup=400)
            for (s, d), runs in cells.items() for seed, st, b, n, dh in runs]
    # another recipe's row (lr 1e-3) is not one of the cells
    rows.append(dict(key=key("peri-ln", "24L-3L", 3, lr="0.001"), study="d128-700upd",
                     scheme="peri-ln", positions="sinusoidal", depth="24L-3L", seed=3,
                     status="trained", bleu="40.00", best_valid_nll="2.000", lr="0.001"))
    write_rows(out / "results.csv", rows)
    if speed:
        summary = {"hardware": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "python": "3"},
                   "device": "cpu",
                   "settings": {"dim": 16, "max_tokens": 256, "steps": 60, "threads": 1},
                   "results": [{"dtype": "float32", "rows": [
                       {"variant": v, "layers": 6, "words_per_s": x} for v, x in SPEED.items()]}]}
        (docs / "speed_norms_2025_tiny.json").write_text(json.dumps(summary))
    publish(out, docs)
    block = published_block(docs, "<!-- norms_2025 table: start -->",
                            "<!-- norms_2025 table: end -->")
    return block


def fmt(values, nd):
    if len(values) == 1:
        return f"{values[0]:.{nd}f}"
    return f"{statistics.mean(values):.{nd}f} +- {statistics.stdev(values):.{nd}f}"


def test_cells_with_means_stds_failures_and_distance_to_admin(tmp_path, study):
    block = publish_case(tmp_path)
    admin = {d: statistics.mean(r[2] for r in runs) for (s, d), runs in CELLS.items()
             if s == "admin"}
    for (scheme, depth), runs in CELLS.items():
        bleus, nlls = [r[2] for r in runs], [r[3] for r in runs]
        # a run the status calls trained fails when, never probed, it gives one translation
        # for every input (post-ln 24L-3L here): its output cannot depend on the source
        why = [r[1] if r[1] != "trained" else "ignores the source" if r[4] == 1 else ""
               for r in runs]
        fails = ", ".join(f"1 {w}" for w in why if w) or "none"
        vs = "-" if scheme == "admin" else f"{statistics.mean(bleus) - admin[depth]:+.2f}"
        distinct = [r[4] for r in runs if r[4] != ""]
        line = (f"| {depth} | {scheme} | {','.join(str(r[0]) for r in runs)} | {len(runs)} | "
                f"{fmt(bleus, 2)} | {fmt(nlls, 3)} | {fails} | {vs} | "
                f"{min(distinct) if distinct else '-'} |")
        assert line in block, line
    # cells without a row are listed; the lr 1e-3 row is not counted anywhere
    assert "| 12L-12L | peri-ln-dyt | - | 0 | not run yet | - | - | - | - |" in block
    assert "40.00" not in block
    # each plan's runs only (admin's demo-scale rows are in neither): the plan's 3 schemes
    # and the two LayerNorm baselines, 2 depths, 3 seeds; DyT in 3 more placements likewise
    own = sum(len(r) for (s, _), r in CELLS.items() if s != "admin" and s not in DYT_ELSEWHERE)
    dyt = sum(len(r) for (s, _), r in CELLS.items() if s in DYT_ELSEWHERE)
    assert (f"`--plan norms-2025` {own} of {5 * 2 * 3} planned runs recorded; "
            f"`--plan norms-2025-dyt` {dyt} of {3 * 2 * 3} planned runs recorded") in block


def test_standing_line_is_sorted_by_mean_bleu(tmp_path, study):
    block = publish_case(tmp_path)
    means = {s: statistics.mean(r[2] for r in runs) for (s, d), runs in CELLS.items()
             if d == "24L-3L"}
    ranked = sorted(means, key=means.get, reverse=True)
    parts = [f"{s} {means[s]:.2f}"
             + ("" if s == "admin" else f" ({means[s] - means['admin']:+.2f})") for s in ranked]
    assert ("- 24L-3L, by mean BLEU (difference to admin's mean): " + ", ".join(parts) + "."
            ) in block


def test_speed_ratios_are_the_files_own_division(tmp_path, study):
    block = publish_case(tmp_path)
    assert "Test CPU, 2 cores, 1 thread(s)" in block
    for v, x in SPEED.items():
        line = (f"| float32 | 6L-6L | {v} | {x:,.0f} | {x / SPEED['stock']:.3f} | "
                f"{x / SPEED['pre-ln']:.3f} |")
        assert line in block, line


def test_without_speed_file_says_how_to_measure(tmp_path, study):
    block = publish_case(tmp_path, speed=False)
    assert "Training speed: no `speed_norms_2025*.json` next to this page yet" in block
    assert "speed_vs_stock.py" in block


@pytest.mark.parametrize("own", ["post-ln-dyt", None])
def test_without_the_plans_own_runs_the_block_is_left(tmp_path, study, own):
    # a row of the second plan alone is enough to write the block
    cells = {c: r for c, r in CELLS.items() if c[0] in ("admin", "pre-ln", "post-ln", own)}
    block = publish_case(tmp_path, cells=cells)
    assert (block == "placeholder\n") == (own is None)
