"""A run trained in segments: resumed from its own ``checkpoint_last.pt`` after its process
was stopped (a session ends every process it started), or continued from the checkpoint of
the same configuration's shorter run (the convergence check: a 4800-update run is the
2400-update run trained on). Either way it is one run: fairseq reloads the weights, the
optimizer, the learning-rate schedule, the data iterator's position and the best validation
loss; the dropout seed of an update depends on the update number alone.

Each segment's fairseq log is kept (``train.log``, ``train.2.log``, ...) and listed in the run
folder's ``segments.json`` with the update it started from. The curve of the run takes from
each segment the points up to the update the next one started from (what a stopped process
logged after its last checkpoint was trained again)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from .logs import LOG_RE, parse_curve

INDEX = "segments.json"
#: fairseq's line after a checkpoint is written: "Saved checkpoint <path> (epoch E @ N updates"
SAVED_RE = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates")
DONE_RE = re.compile(r"done training in ([0-9.]+) seconds")


def read(run_dir: Path) -> list:
    """The run's segments (``[{"log", "start", "from"}]``; one ``train.log`` from update 0
    for a run folder written before segments existed)."""
    path = run_dir / INDEX
    if path.is_file():
        return json.loads(path.read_text())
    return [{"log": "train.log", "start": 0, "from": None}]


def write(run_dir: Path, segments: list) -> None:
    (run_dir / INDEX).write_text(json.dumps(segments, indent=1))


def saved_update(log_text: str) -> int | None:
    """The update of the last checkpoint a segment's log says it wrote (None: none)."""
    found = SAVED_RE.findall(log_text)
    return int(found[-1]) if found else None


def next_log(run_dir: Path, start: int, source: str | None = None) -> Path:
    """Add a segment starting at update ``start`` and return its log file's path."""
    started = (run_dir / INDEX).is_file() or (run_dir / "train.log").is_file()
    segments = read(run_dir) if started else []
    last = segments[-1] if segments else None
    if last and last["start"] == start and not _trained(run_dir / last["log"]):
        # a process stopped before its first logged update: that segment is this one
        segments.pop()
        source = source or last["from"]
    name = "train.log" if not segments else f"train.{len(segments) + 1}.log"
    segments.append({"log": name, "start": start, "from": source})
    write(run_dir, segments)
    return run_dir / name


def _trained(log_file: Path) -> bool:
    """Whether a segment's log holds a logged training update."""
    return log_file.is_file() and any(
        (m := LOG_RE.search(line)) and m.group(1) == "train_inner"
        for line in log_file.read_text().splitlines())


def _ends(segments) -> list:
    return [s["start"] for s in segments[1:]] + [None]


def texts(run_dir: Path) -> list:
    """``(segment, log text)`` of every segment whose log exists."""
    out = []
    for seg in read(run_dir):
        path = run_dir / seg["log"]
        if path.is_file():
            out.append((seg, path.read_text()))
    return out


def curve(run_dir: Path) -> dict:
    """The run's curve over its segments: each segment's points up to the next one's start."""
    segments = read(run_dir)
    ends = dict(zip((s["log"] for s in segments), _ends(segments)))
    out = {"train": [], "valid": []}
    for seg, text in texts(run_dir):
        end = ends[seg["log"]]
        part = parse_curve(text)
        for tag in out:
            out[tag] += [p for p in part[tag] if end is None or p["update"] <= end]
    return out


def wall_seconds(run_dir: Path) -> float:
    """Training seconds over the segments: a finished segment's "done training in" time; a
    stopped one's fairseq wall clock at its last logged update kept in the curve."""
    segments = read(run_dir)
    ends = dict(zip((s["log"] for s in segments), _ends(segments)))
    total = 0.0
    for seg, text in texts(run_dir):
        done = DONE_RE.search(text)
        if done and ends[seg["log"]] is None:
            total += float(done.group(1))
            continue
        end = ends[seg["log"]]
        walls = []
        for line in text.splitlines():
            m = LOG_RE.search(line)
            if m and m.group(1) == "train_inner":
                stats = json.loads(m.group(2))
                if end is None or int(float(stats.get("num_updates", 0))) <= end:
                    walls.append(float(stats.get("wall", 0.0)))
        total += max(walls, default=0.0)
    return total


def resumed_at(run_dir: Path) -> str:
    """The updates the run was resumed or continued at, ``;``-separated ("" for one segment),
    with the shorter run's key where it continued one."""
    parts = []
    for seg in read(run_dir)[1:]:
        parts.append(f"{seg['start']}" + (f" (continues {seg['from']})" if seg["from"] else ""))
    return "; ".join(parts)


def continue_from(shorter: Path, run_dir: Path) -> int:
    """Start ``run_dir`` as the continuation of the finished shorter run in ``shorter``: its
    checkpoints (last and best) and its segments' logs are copied; returns the update it
    continues from (the caller adds the new segment with :func:`next_log`)."""
    start = saved_update("".join(t for _, t in texts(shorter)))
    (run_dir / "ckpt").mkdir(parents=True)
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        shutil.copy2(shorter / "ckpt" / name, run_dir / "ckpt" / name)
    segments = read(shorter)
    for seg in segments:
        if (shorter / seg["log"]).is_file():
            shutil.copy2(shorter / seg["log"], run_dir / seg["log"])
    write(run_dir, segments)
    return start
