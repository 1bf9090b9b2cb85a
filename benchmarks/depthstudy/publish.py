"""``--publish DIR``: the study's rows, figures and tables copied into the docs folder.

Above the parts it gathers (imports flow one way: report <- plot, courses <- deepshallow <- norms2025
<- publish): the CSV and the curves (:mod:`.report`), the figures (:mod:`.plot`), the
depth-study table block of ``results.md``, issue 41's deep-shallow block (:mod:`.deepshallow`)
and issue 39's norms-2025 block (:mod:`.norms2025`).
"""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

from .common import log
from . import deepshallow, norms2025
from .report import CSV_FIELDS, TABLE_END, TABLE_START, published_curve, read_rows


def publish(out: Path, dest: Path) -> None:
    """Copy the CSV and figure into ``dest`` and refresh the table block of results.md, and
    the deep-shallow and norms-2025 blocks (``deepshallow.fill_block``,
    ``norms2025.fill_block``) where the page has them."""
    page = dest / "results.md"
    if not page.is_file():
        raise SystemExit(f"--publish {dest}: {page} does not exist")
    text = page.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"--publish {dest}: {page} lacks the lines {TABLE_START!r} and "
                         f"{TABLE_END!r} that delimit the table")
    # the rows as read (commands relative to the repository root, no machine paths)
    rows = read_rows(out / "results.csv")
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
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    table = (out / "results_table.md").read_text()
    text = f"{head}{TABLE_START}\n{table}{TABLE_END}{tail}"
    # issue 41: the deep-shallow cells with their deployed speed (benchmarks/deploy_speed.py's
    # CSVs in dest) and the speed-quality figure, where the page has that block's markers
    text = deepshallow.fill_block(text, rows, dest, log)
    # issue 39: the new placements and DyT against Admin at depth, with their training speed
    # (benchmarks/speed_vs_stock.py's JSON files in dest)
    page.write_text(norms2025.fill_block(text, rows, dest, log))
    log(f"published to {page}, {dest/'depth_study_results.csv'}, {dest/'depth_study_loss.png'}")
