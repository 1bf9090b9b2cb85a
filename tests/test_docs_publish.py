"""The results report as ``--publish`` writes it: an index page, ``docs/results.md``, holding the
summary of every study under a heading that names its schedule, and a page per study,
``docs/results-*.md``, each block rewritten on the page that holds its markers.

On hand-made rows published into a folder of the test's own; then the committed pages: each
generated block has its markers on exactly one result page, and every study heading of the
summary names its schedule.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from study_utils import load_study_module, schedule_row

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TABLE = ("<!-- depth_study table: start -->", "<!-- depth_study table: end -->")
NORMS = ("<!-- norms_2025 table: start -->", "<!-- norms_2025 table: end -->")
DEEP = ("<!-- deep_shallow table: start -->", "<!-- deep_shallow table: end -->")


@pytest.fixture(scope="module")
def study():
    return load_study_module()  # puts benchmarks/ on sys.path (depthstudy)


def block(text: str, markers) -> str:
    return text.split(markers[0] + "\n", 1)[1].split(markers[1], 1)[0]


def page(title: str, *marker_pairs) -> str:
    body = "".join(f"\n{a}\nplaceholder\n{b}\n" for a, b in marker_pairs)
    return f"# {title}\n{body}\nafter\n"


def norms_row(scheme, depth, seed, bleu, gain="", distinct="1000"):
    from depthstudy.deepshallow import plan_args
    from depthstudy.plan import run_key

    return dict(key=run_key(scheme, depth, seed, plan_args("norms-2025")), study="d128-700upd",
                scheme=scheme, positions="sinusoidal", depth=depth, seed=str(seed),
                status="trained", bleu=f"{bleu:.2f}", best_valid_nll="4.000",
                source_gain=gain, distinct_hyps=distinct, embed_dim="128", max_update="700",
                lr="0.002", warmup="400")


@pytest.fixture
def published(tmp_path, study):
    from depthstudy.publish import publish
    from depthstudy.report import read_rows, write_rows, write_table

    out, docs = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    docs.mkdir()
    (docs / "results.md").write_text(page("index", TABLE))
    (docs / "results-rivals.md").write_text(page("rivals", NORMS))
    (docs / "results-other.md").write_text(page("no markers"))
    (out / "depth_study_loss.png").write_bytes(b"png")
    rows = [norms_row("peri-ln", "24L-3L", 1, 18.0, gain="2.85"),
            norms_row("post-ln", "24L-3L", 1, 2.5, distinct="1"),  # never probed, one output
            schedule_row("admin", 1, 2400, "0.001", 2000)]
    write_rows(out / "results.csv", rows)
    write_table(read_rows(out / "results.csv"), out / "results_table.md")
    publish(out, docs)
    return docs, (out / "results_table.md").read_text()


def test_the_summary_goes_to_the_index_and_a_block_to_the_page_holding_it(published):
    docs, table = published
    index = (docs / "results.md").read_text()
    assert block(index, TABLE) == table and index.endswith("\nafter\n")
    rivals = (docs / "results-rivals.md").read_text()
    assert "placeholder" not in rivals and "| 24L-3L | peri-ln | 1 | 1 | 18.00 |" in rivals
    # a page without markers is left exactly as it was
    assert (docs / "results-other.md").read_text() == page("no markers")


def test_a_run_with_one_output_for_every_input_counts_as_failed(published):
    docs, table = published
    rivals = (docs / "results-rivals.md").read_text()
    line = next(l for l in rivals.splitlines() if l.startswith("| 24L-3L | post-ln |"))
    assert "| 1 ignores the source |" in line
    assert "| 24L-3L | sinusoidal | post-ln | 1 | 1 ignores the source |" in table
    assert "| 24L-3L | sinusoidal | peri-ln | 1 | 1 trained |" in table


def test_each_study_heading_names_its_schedule(published):
    _, table = published
    headings = [l for l in table.splitlines() if l.startswith("### ")]
    assert headings == ["### d=128, 2400 updates, lr 1e-3, warmup 2000",
                        "### d=128, 700 updates, lr 2e-3, warmup 400: the demo schedule"]
    assert "train: `" not in table  # per-run commands stay in the CSV


def test_the_committed_result_pages_hold_each_block_once():
    pages = [DOCS / "results.md"] + sorted(DOCS.glob("results-*.md"))
    texts = {p.name: p.read_text(encoding="utf-8") for p in pages}
    for start, end in (TABLE, NORMS, DEEP):
        holders = [name for name, text in texts.items() if start in text]
        assert len(holders) == 1, (start, holders)
        assert texts[holders[0]].count(start) == texts[holders[0]].count(end) == 1
    assert TABLE[0] in texts["results.md"]


def test_the_committed_summary_names_the_schedule_of_every_study():
    summary = block((DOCS / "results.md").read_text(encoding="utf-8"), TABLE)
    headings = [l for l in summary.splitlines() if l.startswith("### ")]
    assert headings
    for heading in headings:
        assert re.fullmatch(r"### d=\d+, \d+ updates, lr \de-\d, warmup \d+(: .+)?", heading), \
            heading
    assert "| # |" not in summary  # no row per run: that is the CSV
