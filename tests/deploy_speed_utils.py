"""What the deploy-speed tests share: the speed CSVs' columns, benchmarks/deploy_speed.py
loaded as a module (which puts benchmarks/ on sys.path), a CSV reader, and the deep-shallow
plan's run keys and folders."""
from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path

import pytest

from fairseq_cli_utils import REPO

BENCH = REPO / "benchmarks" / "deploy_speed.py"
FIELDS = ["run", "kind", "shape", "encoder_layers", "decoder_layers", "embed_dim", "ffn_dim",
          "heads", "vocab", "scheme", "seed", "train_status", "engine", "precision", "batch",
          "threads", "sentences", "mean_batch", "rounds", "sentences_per_s", "ms_per_sentence",
          "ratio_to_6l6l", "round_values", "fallback_sentences", "fallback_seconds", "bleu",
          "note", "cpu", "checkpoint"]


def load_bench():
    spec = importlib.util.spec_from_file_location("deploy_speed", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path: depthstudy, deployspeed
    return module


def read_csv(path: Path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def recipe_key(scheme, depth, seed):
    from depthstudy.deepshallow import plan_args
    from depthstudy.plan import run_key

    return run_key(scheme, depth, seed, plan_args("deep-shallow"))


def run_folder(key: str) -> str:
    return "runs/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


@pytest.fixture(scope="module")
def bench():
    return load_bench()
