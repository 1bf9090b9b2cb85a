"""``fairseq-preprocess`` / ``-train`` / ``-generate`` (and a ``python``) for the recipe
scripts' ``FAIRSEQ_BIN`` / ``PYTHON`` that run the torch commands in a process forked from
``cli_zygote.py`` (torch and fairseq imported once) instead of a new interpreter.

Why: a recipe test runs each task's ``prepare.sh -> train.sh -> eval.sh``, and most of the CPU
of such a tiny run is the torch/fairseq import of every fairseq command (about 5 s each on
the test machine). The scripts run exactly as a user's, with ``FAIRSEQ_BIN`` and ``PYTHON``
pointing here (the variables the recipes document for another install); each shim is a
small stdlib-only Python program that sends its argv, working directory and environment
over a Unix socket, waits, then writes the command's stdout and stderr (after it ended, not
streamed) and exits with its status. The commands read no standard input (it is empty).
The ``python`` shim sends only the two torch commands of the scripts (``-m
fairseq_admin_pos.cli.average_checkpoints`` and ``examples/common/fairseq_train_bf16.py``)
and runs every other call with the real interpreter (``exec``).
"""
from __future__ import annotations

import json
import os
import queue
import socketserver
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from fairseq_cli_utils import REPO, env

TOOLS = {"fairseq-preprocess": "fairseq_cli.preprocess", "fairseq-train": "fairseq_cli.train",
         "fairseq-generate": "fairseq_cli.generate"}

# the end of every shim: send (module, argv) with the cwd and environment, print the answer
_SEND = r'''
s = socket.socket(socket.AF_UNIX)
s.connect(SOCKET)
s.sendall((json.dumps({"module": module, "argv": argv, "cwd": os.getcwd(),
                       "env": dict(os.environ)}) + "\n").encode())
data = b""
while True:
    chunk = s.recv(1 << 16)
    if not chunk:
        break
    data += chunk
r = json.loads(data)
sys.stdout.write(r["stdout"])
sys.stdout.flush()
sys.stderr.write(r["stderr"])
sys.exit(r["rc"])
'''
_HEAD = "#!{python} -IS\nimport json, os, socket, sys\nSOCKET = {socket!r}\n"
TOOL_SHIM = _HEAD + "module, argv = {module!r}, sys.argv[1:]\n"
PYTHON_SHIM = _HEAD + r'''argv = sys.argv[1:]
if argv[:2] == ["-m", "fairseq_admin_pos.cli.average_checkpoints"]:
    module, argv = argv[1], argv[2:]
elif argv and argv[0].endswith("/examples/common/fairseq_train_bf16.py"):
    module = "recipe_shim_script"
else:
    os.execv({python!r}, [{python!r}, *argv])
'''
#: the module the zygote runs for ``python SCRIPT ARGS``: the script as ``__main__``, its
#: folder first on the path (what ``python SCRIPT`` does)
SCRIPT_RUNNER = """import os, runpy, sys
del sys.argv[0]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class _Zygote:
    """One ``cli_zygote.py`` process; :meth:`run` is one command (callers take turns)."""

    def __init__(self, pythonpath: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("cli_zygote.py"))], cwd=REPO,
            env=dict(env(), PYTHONPATH=pythonpath), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE)

    def run(self, req: dict) -> dict:
        with tempfile.TemporaryDirectory(prefix="recipe_shim_") as tmp:
            paths = {k: os.path.join(tmp, k) for k in ("stdin", "stdout", "stderr")}
            Path(paths["stdin"]).write_text("")
            self.proc.stdin.write((json.dumps({**req, **paths}) + "\n").encode())
            self.proc.stdin.flush()
            json.loads(self.proc.stdout.readline())  # {"pid": ...}
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"cli_zygote.py ended (exit status {self.proc.wait()})")
            rc = json.loads(line)["rc"]
            out, err = (Path(paths[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
        return {"rc": rc, "stdout": out, "stderr": err}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RecipeShims:
    """A folder of shims served by ``zygotes`` processes (commands beyond that wait for a
    free one). Use as a context manager; ``folder`` is the ``FAIRSEQ_BIN`` to pass and
    ``python`` the ``PYTHON``."""

    def __init__(self, folder: Path, zygotes: int = 2):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.python = self.folder / "python"
        # a short path: Unix socket names are limited to about 100 bytes
        self._sock_dir = tempfile.mkdtemp(prefix="shim")
        sock = os.path.join(self._sock_dir, "s")
        (self.folder / "recipe_shim_script.py").write_text(SCRIPT_RUNNER)
        self._pool: "queue.Queue[_Zygote]" = queue.Queue()
        self._zygotes = [_Zygote(str(self.folder)) for _ in range(zygotes)]
        for z in self._zygotes:
            self._pool.put(z)
        pool = self._pool

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                req = json.loads(self.rfile.readline())
                zygote = pool.get()
                try:
                    answer = zygote.run(req)
                finally:
                    pool.put(zygote)
                self.wfile.write(json.dumps(answer).encode())

        self._server = socketserver.ThreadingUnixStreamServer(sock, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        shims = {tool: (TOOL_SHIM.format(python=sys.executable, socket=sock, module=module)
                        + _SEND) for tool, module in TOOLS.items()}
        shims["python"] = PYTHON_SHIM.format(python=sys.executable, socket=sock) + _SEND
        for name, text in shims.items():
            (self.folder / name).write_text(text)
            (self.folder / name).chmod(0o755)
        # the recipes' other tool next to fairseq: the real console script
        (self.folder / "subword-nmt").symlink_to(Path(sys.executable).parent / "subword-nmt")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        for z in self._zygotes:
            z.close()
        for name in os.listdir(self._sock_dir):
            os.unlink(os.path.join(self._sock_dir, name))
        os.rmdir(self._sock_dir)
