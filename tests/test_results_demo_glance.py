"""docs/results.md's at-a-glance table of the demo schedule (lr 2e-3, warmup 400, 700 updates):
every cell recomputed from docs/depth_study_results.csv, the rows of that recipe alone."""
import csv
import statistics

import pytest

from fairseq_cli_utils import REPO

HEADING = "## The demo-schedule grid (lr 2e-3, warmup 400, 700 updates)"
SCHEMES = {"Post-LN": "post-ln", "Pre-LN": "pre-ln", "`admin`": "admin",
           "`admin-paper`": "admin-paper"}
#: the study's line between a failed and a trained model (docs/results.md, "What failed means")
FAILS_BELOW = 6.0


def _table():
    text = (REPO / "docs" / "results.md").read_text()
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    depths = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    return {(SCHEMES[cells[0]], d): c for cells in
            ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])
            for d, c in zip(depths, cells[1:])}


def _demo_rows():
    with open(REPO / "docs" / "depth_study_results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return [r for r in rows if (r["max_update"], r["lr"], r["warmup"], r["embed_dim"],
                                r["positions"]) == ("700", "0.002", "400", "128", "sinusoidal")
            and not r["validate_every"] and r["dropout"] in ("0.1", "")
            and not float(r["clip_norm"] or 0)]


TABLE = _table()


@pytest.mark.parametrize("cell", sorted(TABLE))
def test_cell_is_the_csv_rows_mean_and_std(cell):
    bleus = [float(r["bleu"]) for r in _demo_rows() if (r["scheme"], r["depth"]) == cell]
    assert bleus, cell
    mean = statistics.mean(bleus)
    if mean < FAILS_BELOW:
        expected = f"**fails** ({mean:.2f}" + (", one seed)" if len(bleus) == 1 else ")")
    else:
        expected = f"{mean:.2f} +- {statistics.stdev(bleus):.2f}"
        assert len(bleus) == 3
    assert TABLE[cell] == expected


def test_table_has_every_scheme_and_depth():
    assert len(TABLE) == 4 * 5
