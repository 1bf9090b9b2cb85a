"""``--publish DIR``: the study's rows, figures and tables copied into the docs folder.

Above the parts it gathers (imports flow one way: report <- plot, courses <- deepshallow
<- norms2025 <- publish): the CSV and the curves (:mod:`.report`), the figures
(:mod:`.plot`), the summary block of ``results.md``, the deep-shallow block
(:mod:`.deepshallow`) and the norms-2025 block (:mod:`.norms2025`). The results are one index page, ``DIR/results.md``, which holds the
summary block, and a page per study, ``DIR/results-*.md``: each block is rewritten on whichever
of these pages holds its markers.
"""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

from .common import log
from . import deepshallow, norms2025
from .report import CSV_FIELDS, TABLE_END, TABLE_START, published_curve, read_rows


def result_pages(dest: Path):
    """The index page ``results.md`` first, then the study pages ``results-*.md``."""
    return [dest / "results.md"] + sorted(dest.glob("results-*.md"))


def _replace_block(text: str, start: str, end: str, block: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}{end}{tail}"


def _copy_rows_and_figures(out: Path, dest: Path, rows) -> None:
    """The CSV (commands relative to the repository root, no machine paths), the figures and
    every curve still in ``out``."""
    with open(dest / "depth_study_results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    shutil.copyfile(out / "depth_study_loss.png", dest / "depth_study_loss.png")
    if (out / "depth_study_omegas.png").is_file():
        shutil.copyfile(out / "depth_study_omegas.png", dest / "depth_study_omegas.png")
    (dest / "depth_study_curves").mkdir(exist_ok=True)
    for r in rows:
        if (out / r["curve_file"]).is_file():
            shutil.copyfile(out / r["curve_file"], published_curve(dest, r))


def publish(out: Path, dest: Path) -> None:
    """Copy the CSV, curves and figures into ``dest``; rewrite the summary block of
    ``results.md`` from ``out/results_table.md``, and the deep-shallow and norms-2025 blocks
    (``deepshallow.fill_block``, ``norms2025.fill_block``) on the result page that holds
    their markers, if any does."""
    index = dest / "results.md"
    if not index.is_file():
        raise SystemExit(f"--publish {dest}: {index} does not exist")
    if TABLE_START not in index.read_text() or TABLE_END not in index.read_text():
        raise SystemExit(f"--publish {dest}: {index} lacks the lines {TABLE_START!r} and "
                         f"{TABLE_END!r} that delimit the table")
    rows = read_rows(out / "results.csv")
    _copy_rows_and_figures(out, dest, rows)
    table = (out / "results_table.md").read_text()
    for page in result_pages(dest):
        text = page.read_text()
        new = text
        if page == index:
            new = _replace_block(new, TABLE_START, TABLE_END, table)
        if deepshallow.START in new and deepshallow.END in new:
            # the deep-shallow cells with their deployed speed (benchmarks/deploy_speed.py's
            # CSVs in dest) and the speed-quality figure
            new = deepshallow.fill_block(new, rows, dest, log)
        if norms2025.START in new and norms2025.END in new:
            # the 2025 placements and DyT against Admin at depth, with their training speed
            # (benchmarks/speed_vs_stock.py's JSON files in dest)
            new = norms2025.fill_block(new, rows, dest, log)
        if new != text:
            page.write_text(new)
            log(f"published to {page}")
    log(f"published {dest/'depth_study_results.csv'} and {dest/'depth_study_loss.png'}")
