"""A process that has imported torch and fairseq once and forks a child per fairseq command.

Why: every ``python -m fairseq_cli.train`` pays about 5 s of CPU importing torch, fairseq and
the scikit-learn/scipy that fairseq's task registry pulls in; the suite runs about a hundred
such commands, on two cores. A child forked from this process runs the command exactly as
``python -m MODULE ARGS`` would (``runpy`` as ``__main__``, the given cwd, environment and
argv, stdout/stderr to files, an uncaught exception given to ``sys.excepthook``, atexit
handlers run, the exit status of ``sys.exit``), with
the imports already done. The plugin itself is *not* imported here, so each command imports
it through its own ``--user-dir`` as a user's run does.

Protocol (one JSON object per line): the client writes ``{"module", "argv", "cwd", "env",
"stdin", "stdout", "stderr"}`` (the three are files; ``stderr`` null sends it into the stdout
file, as ``stderr=subprocess.STDOUT`` does); this process answers ``{"pid": N}`` at once and
``{"rc": N}`` when the child has ended. Started by ``fairseq_cli_utils`` (for ``run``, and for
the depth study's commands in ``study_forked.py``); ends when its stdin closes.
"""
import atexit
import importlib.util
import json
import logging
import os
import runpy
import sys
import traceback

# this script's folder is not on a user's path
del sys.path[0]

import torch  # noqa: E402,F401  (the imports a forked command no longer pays)
import fairseq  # noqa: E402,F401
import fairseq.options  # noqa: E402,F401
import fairseq_cli  # noqa: E402,F401

# fairseq.tasks.text_to_speech calls logging.basicConfig when imported; a fresh
# ``python -m fairseq_cli.train`` configures the root logger first (its own format, on stdout),
# which makes that call a no-op. Leave the root logger as a new interpreter has it.
for _handler in logging.root.handlers[:]:
    logging.root.removeHandler(_handler)
logging.root.setLevel(logging.WARNING)


def _exit_status(e: SystemExit) -> int:
    # the interpreter's rules for sys.exit's argument
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _uncaught(e: BaseException) -> int:
    """What the interpreter does with an exception nobody caught: ``sys.excepthook`` (which
    the command may have replaced) prints it and the status is 1, unless the hook raises
    SystemExit (then its code)."""
    try:
        sys.excepthook(type(e), e, e.__traceback__)
    except SystemExit as exit_:
        return _exit_status(exit_)
    except BaseException:
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exc()
        print("\nOriginal exception was:", file=sys.stderr)
        traceback.print_exception(type(e), e, e.__traceback__)
    return 1


def _child(req) -> None:
    rc = 1
    try:
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        f = os.open(req["stdin"], os.O_RDONLY)
        os.dup2(f, 0)
        os.close(f)
        sys.stdin = open(0, encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)
        f = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, 1)
        os.close(f)
        if req["stderr"] is None:  # stderr=subprocess.STDOUT: one file, one offset
            os.dup2(1, 2)
        else:
            f = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, 2)
            os.close(f)
        if req["env"].get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        # what ``python -m`` puts first, then the PYTHONPATH entries a new interpreter adds
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep)
                 if p and p not in sys.path]
        sys.path[0:0] = [req["cwd"], *extra]
        # what ``python -m`` leaves in argv[0] (runpy sets it while the module runs, and
        # restores this value before an uncaught exception reaches sys.excepthook)
        sys.argv = [importlib.util.find_spec(req["module"]).origin, *req["argv"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as e:
        rc = _exit_status(e)
    except BaseException as e:
        rc = _uncaught(e)
    finally:
        try:
            atexit._run_exitfuncs()  # logging.shutdown, tensorboard writers, ...
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
