"""Shared helpers for the tests of benchmarks/depth_study.py: the tiny recipe and running it."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from fairseq_cli_utils import REPO, env

STUDY = REPO / "benchmarks" / "depth_study.py"
TINY = ["--depths", "2L-1L", "--embed-dim", "16", "--ffn-dim", "32", "--heads", "2",
        "--vocab", "60", "--max-update", "4", "--warmup", "2", "--max-tokens", "600",
        "--validate-every", "2", "--log-interval", "1", "--threads", "1"]


def study(*args, check=True, fresh=False):
    """``python benchmarks/depth_study.py args``; its fairseq commands forked from a process
    that has imported torch and fairseq (``study_forked.py``) unless ``fresh``."""
    script = STUDY if fresh else Path(__file__).with_name("study_forked.py")
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def load_study_module():
    spec = importlib.util.spec_from_file_location("depth_study", STUDY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schedule_row(scheme: str, seed: int, max_update: int, lr: str, warmup: int) -> dict:
    """A finished d=128 24L-3L row of the given schedule, as a plan's report reads it."""
    return {"key": f"{scheme}|24L-3L|seed{seed}|{max_update}upd|d128|lr{lr}|wu{warmup}|mt4096",
            "study": f"d128-{max_update}upd", "scheme": scheme, "positions": "sinusoidal",
            "depth": "24L-3L", "seed": str(seed), "embed_dim": "128",
            "max_update": str(max_update), "lr": lr, "warmup": str(warmup),
            "status": "trained", "bleu": "20.00", "best_valid_nll": "4.000"}


def publish_folders(tmp_path, page: str):
    """``(out, docs)`` as ``--publish`` finds them after the report step: ``docs/results.md``
    holding ``page``, and the table and figure the report writes into ``out``."""
    out, docs = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    docs.mkdir()
    (docs / "results.md").write_text(page)
    (out / "results_table.md").write_text("new table\n")
    (out / "depth_study_loss.png").write_bytes(b"png")
    return out, docs


def published_block(docs, start: str, end: str) -> str:
    """The text of ``docs/results.md`` between the lines ``start`` and ``end``."""
    return (docs / "results.md").read_text().split(start + "\n")[1].split(end)[0]
