"""Shared helpers for tests that go through fairseq's command-line tools.

Tiny, seeded, generated data (a reversal task) so tests never depend on ../shared or the
network; the CLIs run as child processes (``python -m fairseq_cli.*`` semantics) with
``--user-dir`` pointing at the package, the path a user takes. ``run`` forks them from a
process that has imported torch and fairseq once (``cli_zygote.py``: the imports are most of
a tiny run's CPU); ``run(..., fresh=True)`` starts a new interpreter instead, for the tests
about importing itself.
"""
from __future__ import annotations

import atexit
import gzip
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
USER_DIR = str(REPO / "fairseq_admin_pos")

TINY_MODEL = [
    "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--encoder-layers", "2",
    "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "2", "--decoder-layers", "2",
]

TRAIN_COMMON = [
    "--cpu", "--seed", "3", "--optimizer", "adam", "--lr", "1e-3",
    "--max-tokens", "400", "--no-progress-bar", "--log-interval", "1",
    "--log-format", "simple", "--num-workers", "0", "--disable-validation",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
]


def env() -> Dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["MKL_NUM_THREADS"] = "1"
    # make sure no test relies on the unsafe escape hatch
    e.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    e.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
    return e


def write_reversal_corpus(folder: Path, n_train=240, n_valid=24, n_test=24, vocab=30, seed=0,
                          max_len=9) -> None:
    """target = source reversed; small enough that a 2-layer model learns something."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        with open(folder / f"{split}.src", "w") as s, open(folder / f"{split}.tgt", "w") as t:
            for _ in range(n):
                sent = [rng.choice(words) for _ in range(rng.randint(3, max_len))]
                s.write(" ".join(sent) + "\n")
                t.write(" ".join(reversed(sent)) + "\n")


class _Zygote:
    """The client of one ``cli_zygote.py`` process (started on first use, one per test
    process; it ends when this process closes its stdin)."""

    def __init__(self):
        self.proc = None
        self.buffer = b""  # read from the pipe, not yet returned as lines
        self.lock = threading.Lock()

    def call(self, module, argv, cwd, child_env, stdin, stdout, stderr, timeout=None) -> int:
        """Run ``python -m module argv`` forked, in ``cwd`` with ``child_env``, its three
        streams the given files (``stderr`` None: into ``stdout``); the exit status. The
        caller holds ``lock``."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("cli_zygote.py"))], cwd=REPO,
                env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
            self.buffer = b""
            atexit.register(self.close)
        req = dict(module=module, argv=[str(a) for a in argv], cwd=str(cwd), env=child_env,
                   stdin=str(stdin), stdout=str(stdout),
                   stderr=None if stderr is None else str(stderr))
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        pid = json.loads(self._line(None))["pid"]
        try:
            return json.loads(self._line(timeout))["rc"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._line(None)
            raise subprocess.TimeoutExpired([module, *argv], timeout) from None

    def run(self, module, argv, cwd, timeout, stdin) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="cli_run_") as tmp:
            files = [os.path.join(tmp, k) for k in ("stdin", "stdout", "stderr")]
            Path(files[0]).write_text(stdin or "")
            rc = self.call(module, argv, cwd, env(), *files, timeout=timeout)
            out, err = (Path(f).read_text(errors="replace") for f in files[1:])
        return subprocess.CompletedProcess([module, *argv], rc, out, err)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # its loop ends
            self.proc.wait(timeout=60)

    def _line(self, timeout) -> str:
        # unbuffered reads, so that select() sees every byte not yet consumed
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("cli_zygote", timeout)
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"cli_zygote.py ended (exit status {self.proc.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


_ZYGOTE = _Zygote()  # also used by study_forked.py


def run(module: str, args: Sequence[str], cwd=None, check=True, timeout=600, fresh=False,
        input=None):
    """``python -m module args`` in ``cwd`` (default: the repository) with ``env()`` and
    ``input`` (text) on stdin; forked from the zygote unless ``fresh`` (or another thread is
    using it)."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if not fresh and _ZYGOTE.lock.acquire(blocking=False):
        try:
            proc = _ZYGOTE.run(module, cmd[3:], cwd or REPO, timeout, input)
        finally:
            _ZYGOTE.lock.release()
        proc.args = cmd
    else:
        proc = subprocess.run(cmd, cwd=cwd or REPO, env=env(), capture_output=True, text=True,
                              timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def preprocess(raw: Path, dest: Path) -> Path:
    run("fairseq_cli.preprocess", [
        "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test",
        "--destdir", dest, "--joined-dictionary", "--workers", "1",
    ])
    return dest


def train(data: Path, save_dir: Path, arch: str, extra: Sequence[str] = (), max_update=3,
          check=True):
    return run("fairseq_cli.train", [
        data, "--user-dir", USER_DIR, "--arch", arch, *TRAIN_COMMON,
        "--max-update", str(max_update), "--save-dir", save_dir, *extra,
    ], check=check)


def generate(data: Path, ckpt: Path, extra: Sequence[str] = (), check=True):
    return run("fairseq_cli.generate", [
        data, "--user-dir", USER_DIR, "--path", ckpt, "--beam", "3", "--cpu",
        "--batch-size", "8", "--num-workers", "0", *extra,
    ], check=check)


def hypotheses(generate_stdout: str) -> List[str]:
    """``H-<id>\\tscore\\ttokens`` lines, sorted by sentence id."""
    rows = []
    for line in generate_stdout.splitlines():
        if line.startswith("H-"):
            sid, score, text = line.split("\t")
            rows.append((int(sid[2:]), score, text))
    return [f"{s}\t{t}" for _, s, t in sorted(rows)]


def train_losses(stdout_and_err: str) -> List[str]:
    """Per-update training losses as printed (fairseq logs to stderr): fairseq-train's
    ``| train_inner |`` lines and fairseq-hydra-train's ``[train_inner]`` ones."""
    return re.findall(r"train_inner\b.*? loss=([0-9.]+)", stdout_and_err)


def load_checkpoint(ckpt: Path) -> dict:
    """The whole checkpoint (model, optimizer history, extra state), loaded the way the
    plugin lets torch >= 2.6 load it (``weights_only=True`` with fairseq's allow-list)."""
    import fairseq_admin_pos

    fairseq_admin_pos.register()  # the allow-list for weights_only loading
    return torch.load(ckpt, map_location="cpu")


def cos_by_matrix(x: torch.Tensor) -> float:
    """Mean cosine over the pairs of different rows of ``x`` ``(N, C)``, from the full N x N
    matrix: the independent check of the package's encoder token cosine."""
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    c = u @ u.T
    return ((c.sum() - c.diagonal().sum()) / (c.size(0) * (c.size(0) - 1))).item()


def load_model_state(ckpt: Path) -> Dict[str, torch.Tensor]:
    return load_checkpoint(ckpt)["model"]


def free_port() -> int:
    """A loopback TCP port nobody listens on (for torch.distributed's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MULTI30K_SPLITS = {"train": 300, "val": 20, "test_2016_flickr": 20}


def write_fake_multi30k(folder, gz=True):
    """A Multi30k-shaped corpus (``{train,val,test_2016_flickr}.{en,de}[.gz]``): word-by-word
    English -> German over 11 words, so a tiny model can learn it in a few updates."""
    rng = random.Random(0)
    en_words = ["a", "man", "woman", "dog", "runs", "sits", "on", "the", "grass", "street", "red"]
    to_de = dict(zip(en_words, ["ein", "Mann", "Frau", "Hund", "läuft", "sitzt", "auf", "dem",
                                "Gras", "Straße", "rot"]))
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in MULTI30K_SPLITS.items():
        en, de = [], []
        for _ in range(n):
            s = [rng.choice(en_words) for _ in range(rng.randint(3, 7))]
            en.append(" ".join(s).capitalize() + ".")
            de.append(" ".join(to_de[w] for w in s).capitalize() + ".")
        for lang, lines in (("en", en), ("de", de)):
            text = "\n".join(lines) + "\n"
            if gz:
                with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as fh:
                    fh.write(text)
            else:
                (folder / f"{split}.{lang}").write_text(text, encoding="utf-8")


# -- one-line errors (fairseq_admin_pos/fairseq_fixes/flag_errors.py) -------------------


def assert_one_line_error(proc, prog: str, message: str) -> None:
    """Exit status 2, the message as the last line of stderr, the only error line, no
    traceback."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-4000:])
    assert "Traceback" not in err, err[-4000:]
    lines = err.strip().splitlines()
    assert lines[-1] == f"{prog}: error: {message}"
    assert sum(": error: " in line for line in lines) == 1, err[-4000:]


def files_under(folder: Path):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None
