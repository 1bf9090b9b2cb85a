"""``deploy_speed.py --wmt-shapes``: what the encoder/decoder allocation costs at the papers'
width, measured on untrained models.

Speed at width 128 says little about WMT base, so each shape (default 6L-6L, 12L-3L, 12L-1L,
24L-1L) is built at WMT14 base width (d 512, FFN 2048, 8 heads; ``--arch admin_transformer``
with the sizes as flags, so it does not depend on the named presets) with the closed-form
Admin of the depth study (``admin``: exported as a stock Post-LN transformer), a **joined
vocabulary of 32000 symbols** and shared embeddings. The vocabulary is synthetic: fairseq's
four special symbols and ``w0`` ... ``w31995``; no data is trained on, the weights are
fairseq's initialisation (seed 1). Each model is written as a checkpoint by fairseq's own
``Trainer`` (as ``fairseq-train`` writes one), exported with the package's
``fairseq_admin_pos.export.checkpoint.export`` (what ``fairseq-admin-export`` runs) to
CTranslate2 float32 and int8, and translated by CTranslate2 (beam 4, length penalty 0.6).

An untrained model emits whatever it emits (often the length limit), so the output length
is held fixed instead: every sentence's translation has exactly its reference's length
(``min_decoding_length = max_decoding_length``, checked on every output). The inputs are
Multi30k test2016: each sentencepiece piece of the English side (the depth study's 8000-piece
model, ``OUT/data/spm/test.en``) becomes the synthetic symbol ``w<crc32(piece) mod 31996>``
(source lengths and repeats kept), and the reference length is the number of pieces of the
German reference under the same sentencepiece model (a 32k vocabulary would cut a little
fewer). CTranslate2 takes one output length per call, so a batch holds sentences of one
reference length only: sentences sorted by (reference length, source length), at most
``--batches`` (e.g. 64) per batch, a new batch at each new length. The CSV's ``batch`` is
that cap; the batches it gives are smaller: ``mean_batch`` is their mean size (at batch 1
it is 1), and it, not the cap, is the batch a row measured (docs/deployment.md gives the
published run's). The figure is the cost of the shape, not of a trained model.
"""
from __future__ import annotations

import logging
import shutil
import statistics
import time
import warnings
import zlib
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .timing import BEAM, CT2, LENPEN, add_ratios, cpu_name, ct2_translator, rotating_rounds, \
    speed_fields

WMT = dict(embed_dim=512, ffn_dim=2048, heads=8, vocab=32000)
QUICK = dict(embed_dim=16, ffn_dim=32, heads=2, vocab=64)
SHAPES = ("6L-6L", "12L-3L", "12L-1L", "24L-1L")
SCHEME_FLAGS = ["--admin-init", "closed-form", "--admin-omega", "parameter"]  # study's admin
SRC, TGT = "en", "de"
N_SPECIAL = 4  # fairseq's <s> <pad> </s> <unk>
CT2_PAD, EOS = "<blank>", "</s>"
NOTE = ("untrained (fairseq init, seed 1), synthetic joined vocabulary of {vocab} symbols; "
        "output held to each sentence's reference length (min = max decoding length); "
        "batches of one output length, at most {batch} sentence(s) each (their mean size: "
        "mean_batch)")


def write_dictionary(folder: Path, vocab: int) -> None:
    """``dict.en.txt`` = ``dict.de.txt``: ``vocab - 4`` symbols ``w0`` ..., fairseq adds its
    four specials when it loads them (a joined dictionary of ``vocab`` entries)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(f"w{i} 1\n" for i in range(vocab - N_SPECIAL))
    for lang in (SRC, TGT):
        (folder / f"dict.{lang}.txt").write_text(text)


def build_checkpoint(data: Path, path: Path, enc: int, dec: int, embed_dim: int, ffn_dim: int,
                     heads: int, seed: int = 1) -> None:
    """An untrained ``admin_transformer`` checkpoint of this shape, written by fairseq's
    ``Trainer`` (what fairseq-train writes; the optimizer state is empty)."""
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from .timing import REPO

    argv = [str(data), "--user-dir", str(REPO / "fairseq_admin_pos"), "--task", "translation",
            "--source-lang", SRC, "--target-lang", TGT, "--arch", "admin_transformer",
            *SCHEME_FLAGS, "--encoder-layers", str(enc), "--decoder-layers", str(dec),
            "--encoder-embed-dim", str(embed_dim), "--decoder-embed-dim", str(embed_dim),
            "--encoder-ffn-embed-dim", str(ffn_dim), "--decoder-ffn-embed-dim", str(ffn_dim),
            "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
            "--share-all-embeddings", "--cpu", "--optimizer", "adam", "--lr", "5e-4",
            "--max-tokens", "4096", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--seed", str(seed), "--num-workers", "0"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    with warnings.catch_warnings():  # hydra's deprecation notes on fairseq's config
        warnings.simplefilter("ignore")
        cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    trainer.consolidate_optimizer()
    trainer.save_checkpoint(str(path), {})


def export_ct2(checkpoint: Path, folder: Path, data: Path, precision: str) -> None:
    """The package's export (``fairseq-admin-export CHECKPOINT --out ... --ctranslate2
    FOLDER [--quantization int8]``); the stock fairseq file it also writes is removed."""
    from fairseq_admin_pos.export.checkpoint import export

    stock = folder.parent / f".{folder.name}.stock.pt"
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    export(str(checkpoint), str(stock), data=str(data), ctranslate2=str(folder),
           quantization=None if precision == "float32" else precision,
           log=lambda msg: print(f"fairseq-admin-export: {msg}", flush=True))
    stock.unlink()


def synthetic_inputs(spm_dir: Path, vocab: int, limit: int = 0
                     ) -> Tuple[List[List[str]], List[int]]:
    """``(sources, reference lengths)``: test2016's English pieces as synthetic symbols and
    the number of pieces of each German reference (module docstring)."""
    src = (spm_dir / f"test.{SRC}").read_text(encoding="utf-8").splitlines()
    ref = (spm_dir / f"test.{TGT}").read_text(encoding="utf-8").splitlines()
    if len(src) != len(ref):
        raise SystemExit(f"{spm_dir}: {len(src)} sources for {len(ref)} references")
    if limit:
        src, ref = src[:limit], ref[:limit]
    n = vocab - N_SPECIAL
    sources = [[f"w{zlib.crc32(p.encode('utf-8')) % n}" for p in line.split()] for line in src]
    return sources, [max(1, len(line.split())) for line in ref]


def translate_fixed(translator, sources: Sequence[Sequence[str]], lengths: Sequence[int],
                    batch_size: int, beam: int = BEAM, lenpen: float = LENPEN
                    ) -> Tuple[List[List[str]], int]:
    """``(tokens per sentence in input order, number of translate_batch calls)``: beam
    search whose output has exactly ``lengths[i]`` tokens: sentences sorted by (length,
    source length) go into batches of at most ``batch_size`` that share one length, decoded
    with ``min_decoding_length = max_decoding_length = length`` (CTranslate2 4.8.5 bans EOS
    before the minimum and stops at the maximum: ``length`` decoder steps, each a token; the
    EOS step a trained model would add is not made) and ``<blank>`` (fairseq's pad)
    suppressed."""
    if len(lengths) != len(sources):
        raise ValueError(f"{len(lengths)} lengths for {len(sources)} sources")
    order = sorted(range(len(sources)), key=lambda i: (lengths[i], len(sources[i])))
    out: List[List[str]] = [None] * len(sources)  # type: ignore[list-item]
    calls, start = 0, 0
    while start < len(order):
        n = lengths[order[start]]
        chunk = [order[start]]
        while (start + len(chunk) < len(order) and len(chunk) < batch_size
               and lengths[order[start + len(chunk)]] == n):
            chunk.append(order[start + len(chunk)])
        res = translator.translate_batch(
            [list(sources[i]) for i in chunk], beam_size=beam, num_hypotheses=1,
            length_penalty=lenpen, min_decoding_length=n, max_decoding_length=n,
            return_end_token=False, suppress_sequences=[[CT2_PAD]])
        for i, r in zip(chunk, res):
            out[i] = list(r.hypotheses[0])
        calls += 1
        start += len(chunk)
    return out, calls


def prepare(args, sizes: Dict[str, int], shapes: Sequence[str], work: Path) -> Dict[str, Path]:
    """Build and export every shape not yet in ``work`` (``work/<shape>/ct2-<precision>``);
    the checkpoints are removed once exported unless ``--keep-checkpoints``."""
    from depthstudy.common import parse_depth

    data = work / "dict"
    write_dictionary(data, sizes["vocab"])
    for shape in shapes:
        enc, dec = parse_depth(shape)
        folder = work / shape
        folder.mkdir(parents=True, exist_ok=True)
        missing = [p for p in args.precisions if not (folder / f"ct2-{p}" / "model.bin").is_file()]
        if not missing:
            continue
        ckpt = folder / "checkpoint.pt"
        if not ckpt.is_file():
            print(f"building {shape} (d {sizes['embed_dim']}, FFN {sizes['ffn_dim']}, "
                  f"{sizes['heads']} heads, vocab {sizes['vocab']})", flush=True)
            build_checkpoint(data, ckpt, enc, dec, sizes["embed_dim"], sizes["ffn_dim"],
                             sizes["heads"])
        for p in missing:
            shutil.rmtree(folder / f"ct2-{p}", ignore_errors=True)
            export_ct2(ckpt, folder / f"ct2-{p}", data, p)
        if not args.keep_checkpoints:
            ckpt.unlink()
    return {shape: work / shape for shape in shapes}


def run(args) -> List[Dict[str, str]]:
    """Every shape x precision x threads x batch, in rotating rounds; the CSV rows of run
    ``args.run``."""
    from depthstudy.common import parse_depth

    sizes = dict(QUICK if args.quick else WMT)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        parse_depth(s)
    work = args.work
    # a cache of another size must not be timed as this one
    tag = f"d{sizes['embed_dim']}-f{sizes['ffn_dim']}-h{sizes['heads']}-v{sizes['vocab']}"
    work = work / tag
    folders = prepare(args, sizes, shapes, work)
    sources, lengths = synthetic_inputs(args.text, sizes["vocab"], 24 if args.quick else 0)
    units = [(shape, p, t) for shape in shapes for p in args.precisions for t in args.threads]

    def measure(unit):
        shape, precision, threads = unit
        translator = ct2_translator(folders[shape] / f"ct2-{precision}", precision, threads)
        got = {}
        for batch in args.batches:
            t0 = time.perf_counter()
            out, calls = translate_fixed(translator, sources, lengths, batch)
            seconds = time.perf_counter() - t0
            bad = [i for i, (o, n) in enumerate(zip(out, lengths)) if len(o) != n]
            if bad:
                raise SystemExit(f"{shape} {precision}: {len(bad)} outputs are not of the "
                                 f"requested length (first: sentence {bad[0]}, "
                                 f"{len(out[bad[0]])} tokens for {lengths[bad[0]]})")
            got[batch] = (len(sources), seconds, calls)
        return got

    results = rotating_rounds(units, args.rounds, measure,
                              lambda u: f"{u[0]} CTranslate2 {u[1]}, {u[2]} thread(s)")
    rows = []
    cpu = cpu_name()
    for i, (shape, precision, threads) in enumerate(units):
        enc, dec = parse_depth(shape)
        for batch in args.batches:
            per_round = [r[batch] for r in results[i]]
            rows.append({
                "run": args.run, "kind": "wmt-shapes", "shape": shape, "encoder_layers": enc,
                "decoder_layers": dec, **{k: sizes[k] for k in ("embed_dim", "ffn_dim", "heads",
                                                                "vocab")},
                "scheme": "admin", "seed": "", "train_status": "untrained", "engine": CT2,
                "precision": precision, "batch": batch, "threads": threads,
                "mean_batch": f"{statistics.mean(n / c for n, _, c in per_round):.1f}",
                # fixed lengths: no sentence reaches a limit, so no fairseq last step
                **speed_fields([(n, s) for n, s, _ in per_round],
                               [(0, 0.0) for _ in per_round]),
                "bleu": "", "note": NOTE.format(vocab=sizes["vocab"], batch=batch), "cpu": cpu,
                "checkpoint": "",
            })
    add_ratios(rows)
    return rows
