"""What every part of the depth study shares: the repository's paths, logging, running a
command with its output streamed to a log file, the depth syntax, fairseq's environment."""
from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER_DIR = REPO / "fairseq_admin_pos"


def log(msg: str) -> None:
    print(f"[depth_study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def relative(text: str, out: Path | None = None) -> str:
    """A command as the docs show it: relative to the repository root, no machine paths
    (this interpreter -> ``python``, the output folder -> ``OUT``)."""
    text = re.sub(r"\S*/\.venv/bin/python\b", "python", text)
    text = text.replace(sys.executable, "python")
    if out is not None:
        text = text.replace(str(out), "OUT")
    text = text.replace(str(REPO) + "/", "")
    # rows recorded by other checkouts (an earlier study ran from another folder)
    text = re.sub(r"/\S*?/(fairseq_admin_pos|benchmarks)\b", r"\1", text)
    text = re.sub(r"/\S*/runs/depth_study\b", "OUT", text)
    return text


def show(cmd) -> str:
    text = " ".join(shlex.quote(str(c)) for c in cmd)
    print(f"\n$ {text}", flush=True)
    return text


def run_checked(cmd, env, log_file: Path | None = None, echo: bool = False):
    """Run ``cmd``; stream its output into ``log_file``; return (rc, output text)."""
    text = show(cmd)
    out = []
    with subprocess.Popen(
        [str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, cwd=REPO,
    ) as proc:
        fh = open(log_file, "w") if log_file else None
        try:
            for line in proc.stdout:
                out.append(line)
                if fh:
                    fh.write(line)
                    fh.flush()
                if echo:
                    sys.stdout.write(line)
        finally:
            if fh:
                fh.close()
        rc = proc.wait()
    return rc, "".join(out), text


def capture(cmd, env) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root; its stdout and stderr as text. With
    :func:`run_checked`, the one place the study starts a process."""
    return subprocess.run([str(c) for c in cmd], env=env, cwd=REPO, capture_output=True,
                          text=True)


def parse_depth(depth: str):
    m = re.fullmatch(r"(\d+)L-(\d+)L", depth)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise SystemExit(
            f"--depths: {depth!r} is not of the form <enc>L-<dec>L with at least one layer "
            "per side, e.g. 6L-6L, 12L-12L, 24L-1L"
        )
    return int(m.group(1)), int(m.group(2))


def fairseq_env(threads: int):
    env = dict(os.environ)
    # fairseq does not set torch's thread count; OMP/MKL decide it.
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path`` (created if missing), held for the ``with`` block: study
    processes sharing one output folder take turns at what they must not do at once."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
