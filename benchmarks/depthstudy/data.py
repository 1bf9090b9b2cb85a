"""The study's data: Multi30k Task 1 raw text -> joint sentencepiece -> fairseq binary
(cached), and the unigram entropy that the "stuck" verdict is measured against."""
from __future__ import annotations

import gzip
import json
import math
import shutil
import sys
from collections import Counter
from pathlib import Path

from .common import fairseq_env, file_lock, log, run_checked

SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
LANGS = ("en", "de")
SRC, TGT = "en", "de"


def raw_path(data: Path, split: str, lang: str) -> Path:
    return data / f"{SPLITS[split]}.{lang}.gz"


def check_data(data: Path) -> None:
    if not data.is_dir():
        raise SystemExit(
            f"--data {data}: not a directory. It must hold Multi30k Task 1 raw text: "
            + ", ".join(f"{SPLITS[s]}.{l}.gz" for s in SPLITS for l in LANGS)
        )
    missing = [str(raw_path(data, s, l).name) for s in SPLITS for l in LANGS
               if not raw_path(data, s, l).is_file()]
    if missing:
        raise SystemExit(
            f"--data {data}: missing {', '.join(missing)} (expected the gzip files of "
            "multi30k/dataset data/task1/raw: train, val, test_2016_flickr x .en/.de)"
        )


def read_gz(path: Path):
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh]


def prepare_data(data: Path, out: Path, vocab: int, threads: int, workers: int) -> Path:
    """Raw text -> sentencepiece -> fairseq binary, in ``out/data``; cached. Study processes
    sharing ``out`` take turns (``out/data.lock``): the first prepares, the others reuse."""
    with file_lock(out / "data.lock"):
        return _prepare_data(data, out, vocab, threads, workers)


def _prepare_data(data: Path, out: Path, vocab: int, threads: int, workers: int) -> Path:
    root = out / "data"
    bin_dir = root / "bin"
    stamp = root / "COMPLETE.json"
    settings = {"data": str(data.resolve()), "vocab": vocab, "model_type": "unigram"}
    if stamp.is_file() and json.loads(stamp.read_text()).get("settings") == settings:
        log(f"data ready in {root} (delete {stamp} to rebuild)")
        return root
    if root.exists():
        shutil.rmtree(root)
    counts = _write_raw(data, root)
    prefix = _train_and_encode(root, vocab, threads)
    log("encoded all splits with " + str(prefix) + ".model")
    _binarize(root, bin_dir, threads, workers)
    stamp.write_text(json.dumps({"settings": settings, "sentences": counts}, indent=1))
    return root


def _write_raw(data: Path, root: Path):
    """Multi30k's gzipped splits as plain text under ``root/raw``; sentences per split."""
    (root / "raw").mkdir(parents=True)
    counts = {}
    for split in SPLITS:
        lines = {lang: read_gz(raw_path(data, split, lang)) for lang in LANGS}
        if len(lines["en"]) != len(lines["de"]):
            raise SystemExit(
                f"--data {data}: {SPLITS[split]}.en has {len(lines['en'])} lines but "
                f"{SPLITS[split]}.de has {len(lines['de'])}"
            )
        counts[split] = len(lines["en"])
        for lang in LANGS:
            (root / "raw" / f"{split}.{lang}").write_text("\n".join(lines[lang]) + "\n")
    log(f"sentences: {counts}")
    return counts


def _train_and_encode(root: Path, vocab: int, threads: int) -> Path:
    """A joint unigram sentencepiece model on the training side only (valid/test never
    seen), and every split encoded with it under ``root/spm``; the model's prefix."""
    import sentencepiece as spm

    (root / "spm").mkdir()
    prefix = root / "spm" / f"spm{vocab}"
    spm_args = dict(
        input=f"{root/'raw'/'train.en'},{root/'raw'/'train.de'}",
        model_prefix=str(prefix), vocab_size=vocab, model_type="unigram",
        character_coverage=1.0, num_threads=max(1, threads), seed_sentencepiece_size=1000000,
        # fairseq's dictionary adds its own <s> <pad> </s> <unk>; keep spm's ids out of the text
        bos_id=-1, eos_id=-1, unk_id=0,
    )
    print("\n$ sentencepiece.SentencePieceTrainer.train(" +
          ", ".join(f"{k}={v!r}" for k, v in spm_args.items()) + ")", flush=True)
    spm.SentencePieceTrainer.train(**spm_args, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    for split in SPLITS:
        for lang in LANGS:
            src = (root / "raw" / f"{split}.{lang}").read_text().splitlines()
            pieces = sp.encode(src, out_type=str)
            (root / "spm" / f"{split}.{lang}").write_text(
                "\n".join(" ".join(p) for p in pieces) + "\n"
            )
    return prefix


def _binarize(root: Path, bin_dir: Path, threads: int, workers: int) -> None:
    """``fairseq-preprocess`` of the encoded splits into ``bin_dir`` (joined dictionary)."""
    cmd = [
        sys.executable, "-m", "fairseq_cli.preprocess",
        "--source-lang", SRC, "--target-lang", TGT,
        "--trainpref", root / "spm" / "train", "--validpref", root / "spm" / "valid",
        "--testpref", root / "spm" / "test", "--destdir", bin_dir,
        "--joined-dictionary", "--workers", str(workers),
    ]
    rc, text, _ = run_checked(cmd, fairseq_env(threads), root / "preprocess.log")
    if rc != 0:
        raise SystemExit(f"fairseq-preprocess failed (rc {rc}); see {root/'preprocess.log'}\n"
                         + text[-2000:])


def unigram_entropy_bits(root: Path) -> float:
    """Entropy (bits/token) of the target training side's piece frequencies, one </s> per
    sentence included: the nll_loss of a model that ignores the source and the prefix."""
    counts = Counter()
    n_sent = 0
    for line in (root / "spm" / f"train.{TGT}").read_text().splitlines():
        counts.update(line.split())
        n_sent += 1
    counts["</s>"] += n_sent
    total = sum(counts.values())
    return -sum(c / total * math.log2(c / total) for c in counts.values())
