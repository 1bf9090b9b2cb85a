"""The child processes of ``make gpu-check``: :func:`run_process` runs a command in its own
process group with its output to files and stops the whole group past its time limit;
:func:`interrupt` stops them all on Ctrl-C; :func:`child_env` puts the checkout first on
``PYTHONPATH``; :func:`tool_shims` writes the ``fairseq-*`` commands the recipes call.
Standard library only."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from .environment import REPO

#: processes running now (their own process groups, so Ctrl-C does not reach them:
#: :func:`interrupt` stops them)
_LIVE = set()
_STOPPING = threading.Event()


def run_process(cmd: Sequence[str], *, cwd: Path, env: dict, stdout: Path, timeout: float,
                stderr: Optional[Path] = None) -> dict:
    """Run ``cmd`` in its own process group with output to files; past ``timeout`` the
    whole group (train.sh, fairseq-train, tee) is stopped. Returns rc (None when timed
    out), seconds and the limit."""
    cmd = [str(c) for c in cmd]
    if _STOPPING.is_set():
        raise RuntimeError("gpu-check was interrupted")
    t0 = time.monotonic()
    with open(stdout, "w") as out, open(stderr or os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out,
                                stderr=err if stderr else subprocess.STDOUT,
                                start_new_session=True)
        _LIVE.add(proc)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc = None
        except BaseException:  # Ctrl-C while waiting in the main thread
            _stop_group(proc)
            raise
        finally:
            _LIVE.discard(proc)
    return {"command": " ".join(cmd), "rc": rc, "seconds": round(time.monotonic() - t0, 1),
            "timeout": round(timeout, 1)}


def stop_all() -> None:
    for proc in list(_LIVE):
        _stop_group(proc)


def interrupt() -> None:
    """Ctrl-C: no process starts from now on, and the running ones are stopped (they run in
    their own sessions, so the interrupt reached only this process)."""
    _STOPPING.set()
    stop_all()


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def child_env(**extra) -> dict:
    env = dict(os.environ)
    # the checkout first, so that the plugin is this repository's even when not installed
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    env.setdefault("OMP_NUM_THREADS", "4")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def tool_shims(folder: Path) -> Path:
    """``fairseq-train`` / ``-generate`` / ``-preprocess`` that run this Python's fairseq,
    for the recipes' ``FAIRSEQ_BIN`` (console scripts may be absent or another install's)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tool in ("train", "generate", "preprocess", "interactive", "validate"):
        shim = folder / f"fairseq-{tool}"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fairseq_cli.{tool} "$@"\n')
        shim.chmod(0o755)
    return folder
