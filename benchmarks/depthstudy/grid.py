"""Scheduling the study's grid: ``--jobs`` worker threads take the missing runs in grid order,
one fairseq-train each (:func:`depthstudy.runner.one_run`), and record a CSV row per finished
run. A lock file per run keeps two study processes on one output folder apart."""
from __future__ import annotations

import contextlib
import re
import threading
import time
import traceback
from pathlib import Path

from .common import REPO, fairseq_env, log
from .plan import item_args, item_key, study_name
from .plot import write_plot
from .report import append_row, read_rows, write_table
from .runner import one_run, unsupported_flags

#: seconds before a variant passed over (flags unknown to this checkout) is asked about
#: again: code landing while a long grid runs is picked up
ASK_AGAIN_S = 600
#: seconds a worker waits for a longer run whose shorter run is still training
WAIT_S = 30


@contextlib.contextmanager
def claim(out: Path, key: str):
    """Yield whether this process holds the run ``key`` (an exclusive, non-blocking lock on
    ``OUT/runs/<run>.lock`` for as long as the run takes): two study processes on one output
    folder never train the same run; the lock goes with the process, however it ends."""
    import fcntl

    path = out / "runs" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


class GridRun:
    """One call's pass over a grid: the runs not yet in the CSV, in grid order.

    A longer run of a cell (its fifth item, the updates) continues the cell's shorter run,
    so it waits until that one is recorded, and is left for a later call when the shorter
    one failed or another study process holds it. A variant whose flags this checkout's
    fairseq-train does not know is passed over and asked about again after
    :data:`ASK_AGAIN_S`; what is left is listed as missing and a later call runs it."""

    def __init__(self, args, root, grid, unigram_bits, study_cmd, csv_path):
        self.args, self.root, self.grid = args, root, grid
        self.unigram_bits, self.study_cmd, self.csv_path = unigram_bits, study_cmd, csv_path
        done = {r["key"] for r in read_rows(csv_path)}
        self.pending = [g for g in grid if item_key(g, args) not in done]
        self.running, self.failed, self.elsewhere = [], [], []
        self.lock = threading.Lock()
        self.env = fairseq_env(args.threads)
        self.known = {}  # (scheme, positions) -> (time asked, missing flags)
        self.helps = {}  # chosen optimizer -> fairseq-train's help text, dropped when asked again

    def waits(self, item) -> bool:
        return any(o[:4] == item[:4] and len(o) > 4 and len(item) > 4 and o[4] < item[4]
                   for o in self.pending + self.running + self.failed + self.elsewhere)

    def missing_flags(self, item) -> list:
        variant = (item[0], item[3])
        asked, missing = self.known.get(variant, (None, None))
        if asked is None or (missing and time.time() - asked > ASK_AGAIN_S):
            if asked is not None:
                self.helps.clear()
            missing = unsupported_flags(*variant, self.env, self.helps)
            self.known[variant] = (time.time(), missing)
            if missing:
                log(f"passing over {variant[0]} / {variant[1]}: this checkout's "
                    f"fairseq-train does not know {', '.join(missing)}")
        return missing

    def next_item(self):
        """The first pending run that can start now; None when nothing is left to start
        (waiting while a run it depends on is still training)."""
        while True:
            with self.lock:
                blocked = False
                for item in list(self.pending):
                    if self.waits(item):
                        blocked = True
                    elif not self.missing_flags(item):
                        self.pending.remove(item)
                        self.running.append(item)
                        return item
                if not (blocked and self.running):
                    return None
            time.sleep(WAIT_S)

    def record(self, row) -> None:
        with self.lock:
            append_row(self.csv_path, row)
            rows = read_rows(self.csv_path)
            done = {r["key"] for r in rows}
            missing = [(study_name(item_args(self.args, g)), *g[:4]) for g in self.grid
                       if item_key(g, self.args) not in done]
            write_table(rows, self.args.out / "results_table.md", missing)
            write_plot(rows, self.args.out, self.args.out / "depth_study_loss.png",
                       self.args.publish or REPO / "docs")

    def run_one(self, item) -> None:
        scheme, depth, seed, pos = item[:4]
        key = item_key(item, self.args)
        # the claim is held until the row is in the CSV: another process that reaches this
        # run sees either the lock or the row
        with claim(self.args.out, key) as mine:
            if not mine or key in {r["key"] for r in read_rows(self.csv_path)}:
                log(f"run {key}: running or done in another study process; skipped")
                if not mine:
                    self.elsewhere.append(item)
                return
            row = one_run(item_args(self.args, item), self.root, scheme, depth, seed,
                          self.unigram_bits, self.study_cmd, pos)
            if row is not None:
                self.record(row)
            else:
                self.failed.append(item)

    def worker(self) -> None:
        while (item := self.next_item()) is not None:
            try:
                self.run_one(item)
            except Exception:  # one broken run must not end the grid; it stays missing
                self.failed.append(item)
                log(f"run {item} failed, not recorded (a rerun retries it):\n"
                    + traceback.format_exc())
            finally:
                with self.lock:
                    self.running.remove(item)


def run_grid(args, root, grid, unigram_bits, study_cmd, csv_path) -> None:
    """Run the grid's missing runs, ``--jobs`` at a time, in grid order (:class:`GridRun`)."""
    run = GridRun(args, root, grid, unigram_bits, study_cmd, csv_path)
    log(f"grid: {len(grid)} runs, {len(grid) - len(run.pending)} already in {csv_path}")
    threads = [threading.Thread(target=run.worker) for _ in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
