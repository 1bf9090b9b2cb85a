"""The speed CSVs' timing runs: a run merged into a CSV replaces that run's rows of the same
measurement and keeps every other row, its ratios taken within it; a CSV without a run column
is refused; in the published CSVs (docs/deploy_speed_cells.csv, docs/deploy_speed_shapes.csv)
every ``ratio_to_6l6l`` is recomputed from the file as the row's sentences/s over the 6L-6L
row of its own run (empty where that run has none), and every run is in docs/deployment.md.
"""
from __future__ import annotations

import pytest

from deploy_speed_utils import bench, read_csv  # noqa: F401
from fairseq_cli_utils import REPO


# -- merging runs into a CSV ------------------------------------------------------------------
def test_merge_replaces_a_runs_rows_and_keeps_the_others(bench, tmp_path):
    """A run's rows replace that run's rows of the same measurement; rows of other runs, and
    of the same run's other measurements, stay as they were, in their order; the ratios of a
    run are taken within it, one 6L-6L per scheme."""
    from deployspeed.timing import add_ratios, merge_csv, read_csv as read

    def row(run, shape, sps, batch="64"):
        return dict(run=run, kind="cells", shape=shape, scheme="admin", seed="1",
                    engine="CTranslate2", precision="int8", batch=batch, threads="1",
                    sentences_per_s=str(sps))

    path = tmp_path / "speed.csv"
    first = [row("r1", "6L-6L", 100), row("r1", "12L-1L", 150), row("r1", "12L-1L", 20, "1")]
    add_ratios(first)
    assert [r["ratio_to_6l6l"] for r in first] == ["1.000", "1.500", ""]  # no batch-1 6L-6L
    merge_csv(path, first)
    second = [row("r2", "6L-6L", 50), row("r2", "24L-1L", 40)]
    add_ratios(second)
    merge_csv(path, second)
    again = [row("r1", "12L-1L", 160)]
    merged = merge_csv(path, again)
    key = [(r["run"], r["shape"], r["batch"], r["sentences_per_s"], r["ratio_to_6l6l"])
           for r in read(path)]
    assert key == [(r["run"], r["shape"], r["batch"], r["sentences_per_s"], r["ratio_to_6l6l"])
                   for r in merged] == [
        ("r1", "6L-6L", "64", "100", "1.000"), ("r1", "12L-1L", "1", "20", ""),
        ("r2", "6L-6L", "64", "50", "1.000"), ("r2", "24L-1L", "64", "40", "0.800"),
        ("r1", "12L-1L", "64", "160", "")]
    with pytest.raises(ValueError, match="two 6L-6L rows"):
        add_ratios([row("r3", "6L-6L", 1), row("r3", "6L-6L", 2)])


def test_merge_refuses_a_csv_without_runs(bench, tmp_path):
    from deployspeed.timing import merge_csv

    path = tmp_path / "old.csv"
    path.write_text("kind,shape,sentences_per_s\ncells,6L-6L,10\n")
    with pytest.raises(SystemExit, match=f"--csv {path}: no run column"):
        merge_csv(path, [])
    assert path.read_text() == "kind,shape,sentences_per_s\ncells,6L-6L,10\n"


# -- the published CSVs -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deploy_speed_cells.csv", "deploy_speed_shapes.csv"])
def test_published_ratios_are_over_the_6l6l_of_their_own_run(name):
    """Every ratio recomputed from the file alone: the row's sentences/s over the 6L-6L row of
    the same run, kind, scheme, engine, precision, batch and threads, to 3 decimals; empty
    where the run has no such row. One row per measurement and run."""
    rows = read_csv(REPO / "docs" / name)
    assert rows and all(r["run"] for r in rows)

    def base_key(r):
        return r["run"], r["kind"], r["scheme"], r["engine"], r["precision"], r["batch"], \
            r["threads"]

    measured = [base_key(r) + (r["shape"], r["seed"]) for r in rows]
    assert len(set(measured)) == len(measured)
    base = {}
    for r in rows:
        if r["shape"] == "6L-6L":
            assert base_key(r) not in base, base_key(r)
            base[base_key(r)] = float(r["sentences_per_s"])
    for r in rows:
        b = base.get(base_key(r))
        want = "" if b is None else f"{float(r['sentences_per_s']) / b:.3f}"
        assert r["ratio_to_6l6l"] == want, (r["run"], r["shape"], r["scheme"], r["engine"],
                                            r["precision"], r["batch"], r["threads"])


def test_published_runs_are_documented():
    """Each run of the published CSVs has a line of docs/deployment.md's run table;
    CTranslate2's fallback was not recorded before the columns existed (empty), the plugin
    and the fixed-length shapes have none (0)."""
    page = (REPO / "docs" / "deployment.md").read_text()
    for name in ("deploy_speed_cells.csv", "deploy_speed_shapes.csv"):
        rows = read_csv(REPO / "docs" / name)
        for run_id in {r["run"] for r in rows}:
            assert f"| `{run_id}` |" in page, run_id
        for r in rows:
            if r["engine"] == "fairseq + plugin" or r["kind"] == "wmt-shapes":
                assert (r["fallback_sentences"], r["fallback_seconds"]) == ("0", "0")
            else:
                assert r["fallback_sentences"] == r["fallback_seconds"] == ""
