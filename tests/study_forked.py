"""``python tests/study_forked.py ARGS`` is ``python benchmarks/depth_study.py ARGS`` with the
fairseq commands the study starts forked from ``cli_zygote.py`` instead of new interpreters.

Why: a tiny run of the study is some fifteen ``python -m`` commands (fairseq-train's
``--help``, preprocess, and per run train, generate and the probe), and each new interpreter
spends about 9 s of CPU on a 2-core AMD EPYC importing torch and fairseq, nearly all of what
the study's tests cost. The study itself still runs as the script, as ``__main__``, with its
own argv; only its two ways of starting a process (``depthstudy.common.run_checked`` and
``capture``) are replaced, before any part of the study imports them, and only for
``[sys.executable, "-m", MODULE, ...]`` commands. A command goes to a new interpreter as
before when the zygote is busy (``--jobs 2``: one run at a time is forked) or when it asks
for more torch threads than the zygote started with, whose thread count a fork keeps. Each
forked command imports the plugin through its own ``--user-dir``, as a user's run does;
``study_utils.study(..., fresh=True)`` runs the script itself, and
``tests/test_depth_study.py`` checks that both give the same row.
"""
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from fairseq_cli_utils import _ZYGOTE, env as zygote_env

STUDY = Path(__file__).resolve().parents[1] / "benchmarks" / "depth_study.py"
sys.path[0] = str(STUDY.parent)  # what ``python benchmarks/depth_study.py`` puts first

from depthstudy import common  # noqa: E402

_run_checked, _capture = common.run_checked, common.capture
_THREADS = {k: zygote_env()[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def _forkable(cmd, env):
    """``(module, argv)`` of a ``python -m`` command the zygote can run, else None."""
    cmd = [str(c) for c in cmd]
    if cmd[:2] != [sys.executable, "-m"] or len(cmd) < 3:
        return None
    if any(env.get(k) != v for k, v in _THREADS.items()):
        return None
    if not _ZYGOTE.lock.acquire(blocking=False):
        return None
    return cmd[2], cmd[3:]


def _forked(module, argv, env, stdout, stderr) -> int:
    try:
        with tempfile.TemporaryDirectory(prefix="study_forked_") as tmp:
            stdin = Path(tmp, "stdin")
            stdin.write_text("")
            return _ZYGOTE.call(module, argv, common.REPO, env, stdin, stdout, stderr)
    finally:
        _ZYGOTE.lock.release()


def run_checked(cmd, env, log_file=None, echo=False):
    """``common.run_checked``: the output written into ``log_file`` as the command runs."""
    job = _forkable(cmd, env)
    if job is None:
        return _run_checked(cmd, env, log_file, echo)
    text = common.show(cmd)
    with tempfile.TemporaryDirectory(prefix="study_forked_") as tmp:
        out = Path(log_file) if log_file else Path(tmp, "output")
        rc = _forked(*job, env, out, None)
        output = out.read_text(errors="replace")
    if echo:
        sys.stdout.write(output)
        sys.stdout.flush()
    return rc, output, text


def capture(cmd, env) -> subprocess.CompletedProcess:
    """``common.capture``: stdout and stderr apart."""
    job = _forkable(cmd, env)
    if job is None:
        return _capture(cmd, env)
    with tempfile.TemporaryDirectory(prefix="study_forked_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        rc = _forked(*job, env, out, err)
        return subprocess.CompletedProcess([str(c) for c in cmd], rc,
                                           out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


common.run_checked, common.capture = run_checked, capture

if __name__ == "__main__":
    sys.argv = [str(STUDY), *sys.argv[1:]]
    try:
        runpy.run_path(str(STUDY), run_name="__main__")
    finally:
        _ZYGOTE.close()
        sys.stdout.flush()
