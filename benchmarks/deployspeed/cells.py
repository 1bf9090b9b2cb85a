"""``deploy_speed.py --study-out OUT``: the deployed speed of each trained shape of a depth
study plan (the deep-shallow plan's encoder/decoder allocations).

For each scheme x shape cell of ``--plan`` (default ``deep-shallow``; ``--cells`` picks some,
or adds cells outside the plan), one run's ``checkpoint_best.pt`` is timed: the lowest seed
whose row says ``trained``, else the lowest seed, among the rows of ``OUT/results.csv`` with
the plan's recipe whose checkpoint is still there (``depth_study.py --keep-checkpoints``;
several ``--study-out`` folders are searched in order, each with its own data). Engines:

* ``fairseq + plugin``: ``fairseq-generate --user-dir fairseq_admin_pos`` on the checkpoint
  with the study's data (``OUT/data/bin``);
* ``CTranslate2`` float32 and int8: the checkpoint exported by the package's export
  (``fairseq_admin_pos.export.checkpoint.export``, what ``fairseq-admin-export --ctranslate2
  DIR [--quantization int8]`` runs; cached in ``WORK/<run>/ct2-<precision>``) and translated by
  ``fairseq_admin_pos.export.ct2.translate`` (fairseq's settings mapped onto CTranslate2's).
  A scheme the export refuses (rezero, b2t, resi-dual) is timed through the plugin only; its
  rows say so in ``note``.

All with the study's decoding (beam 4, length penalty 0.6, at most ``1.2 * source + 10``
tokens) on test2016: batch 64 (sentences/s) and batch 1 (ms per sentence), each with 1 and 2
threads (``--threads``, ``--batches``), the (cell, engine, threads) units in rotating order
for ``--rounds`` rounds. BLEU is sacreBLEU of the timed output against the raw references.
CTranslate2's rows count the sentences that took ``translate``'s fairseq last step (their
best hypothesis reached the length limit) and the seconds it took (``fallback_*``, within
the timed seconds: ``timing``'s docstring); a failed model that runs to the limit spends
much of its time there.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Dict, List

from .timing import (CT2, PLUGIN, add_ratios, cpu_name, ct2_translate, ct2_translator, detok,
                     fairseq_generate, rotating_rounds, speed_fields)

PRECISIONS = ("float32", "int8")


def parse_cells(text: str):
    """``scheme:shape,...`` -> [(scheme, shape)]."""
    cells = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        scheme, sep, shape = item.partition(":")
        if not sep or not re.fullmatch(r"\d+L-\d+L", shape):
            raise SystemExit(f"--cells: {item!r} is not scheme:<enc>L-<dec>L, e.g. admin:12L-1L")
        cells.append((scheme, shape))
    return cells


def pick_checkpoints(study_outs: List[Path], plan: str, cells_text: str = ""):
    """``(picked, missing)``: per cell ``dict(scheme, shape, positions, out, row, checkpoint)``
    in plan order; ``missing`` the cells without a row whose checkpoint is still there."""
    from depthstudy.deepshallow import cell_rows, plan_cells
    from depthstudy.report import read_rows

    cells = plan_cells(plan)
    if cells_text:
        wanted = parse_cells(cells_text)
        cells = [c for c in cells if c[:2] in wanted] + \
            [(s, d, "sinusoidal") for s, d in wanted if (s, d) not in {c[:2] for c in cells}]
    picked, missing = [], []
    for cell in cells:
        choice = None
        for out in study_outs:
            groups = cell_rows(read_rows(out / "results.csv"), plan, [cell])
            with_ckpt = [(r, _checkpoint(out, r)) for r in groups[cell]]
            with_ckpt = [(r, c) for r, c in with_ckpt if c.is_file()]
            if with_ckpt:
                # a trained run, lowest seed first: a failed model's output length is not the
                # cell's
                r, c = min(with_ckpt, key=lambda rc: (rc[0]["status"] != "trained",
                                                      int(rc[0]["seed"])))
                choice = dict(scheme=cell[0], shape=cell[1], positions=cell[2], out=out, row=r,
                              checkpoint=c)
                break
        (picked if choice else missing).append(choice or cell)
    return picked, missing


def _checkpoint(out: Path, row) -> Path:
    run = (Path(row["curve_file"]).parent if row.get("curve_file") else
           Path("runs") / re.sub(r"[^A-Za-z0-9_.-]+", "_", row["key"]))
    return out / run / "ckpt" / "checkpoint_best.pt"


def export_cell(cell, work: Path) -> str:
    """Export the cell's checkpoint to CTranslate2 float32 and int8 (kept in
    ``work/<run>/``); the refusal's one line where the export refuses the scheme, else ""."""
    from fairseq_admin_pos.export.checkpoint import ExportError, export
    from fairseq_admin_pos.export.fold import NotExportable

    folder = work / cell["checkpoint"].parent.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    for p in PRECISIONS:
        target = folder / f"ct2-{p}"
        if (target / "model.bin").is_file():
            continue
        shutil.rmtree(target, ignore_errors=True)
        stock = folder / f".stock-{p}.pt"
        try:
            export(str(cell["checkpoint"]), str(stock), data=str(cell["out"] / "data" / "bin"),
                   ctranslate2=str(target), quantization=None if p == "float32" else p,
                   log=lambda msg: print(f"fairseq-admin-export: {msg}", flush=True))
        except (ExportError, NotExportable) as e:
            return str(e)
        stock.unlink()
    cell["ct2"] = folder
    return ""


def read_texts(outs) -> Dict[Path, Dict]:
    """Per study folder: test2016's sentencepiece sources and references (the batches'
    order), the raw references (BLEU) and the target vocabulary's size."""
    from depthstudy.data import SRC, TGT

    texts = {}
    for out in outs:
        spm, raw = out / "data" / "spm", out / "data" / "raw"
        texts[out] = dict(
            sources=[ln.split() for ln in (spm / f"test.{SRC}").read_text().splitlines()],
            pieces=[ln.split() for ln in (spm / f"test.{TGT}").read_text().splitlines()],
            refs=(raw / f"test.{TGT}").read_text(encoding="utf-8").splitlines(),
            # fairseq's dictionary: the file's symbols and its four specials
            vocab=str(len((out / "data" / "bin" / f"dict.{TGT}.txt").read_text().splitlines())
                      + 4))
    return texts


def measure_unit(cell, text, engine: str, precision: str, threads: int, batches):
    """One unit's timing at each batch size: ``{batch: (sentences, seconds, hypotheses,
    (fallback sentences, fallback seconds))}``."""
    got = {}
    translator = None if engine == PLUGIN else ct2_translator(
        cell["ct2"] / f"ct2-{precision}", precision, threads)
    for batch in batches:
        if engine == PLUGIN:
            hyps, n, seconds = fairseq_generate(cell["out"] / "data" / "bin",
                                                cell["checkpoint"], batch, threads, True)
            fallback = (0, 0.0)  # fairseq forces EOS inside its own search
        else:
            tokens, n, seconds, fb = ct2_translate(translator, text["sources"], text["pieces"],
                                                   batch)
            hyps, fallback = [detok(t) for t in tokens], (fb.sentences, fb.seconds)
        got[batch] = (n, seconds, hyps, fallback)
    return got


def unit_row(args, cell, text, unit, batch: int, per_round, cpu: str) -> Dict[str, str]:
    """The CSV row of one unit at one batch size from its rounds' measurements."""
    import sacrebleu

    from depthstudy.common import parse_depth

    _, engine, precision, threads = unit
    r, hyps = cell["row"], per_round[0][2]
    enc, dec = parse_depth(cell["shape"])
    notes = []
    if cell["refused"]:
        notes.append(f"CTranslate2 not exported: {cell['refused']}")
    if any(p[2] != hyps for p in per_round[1:]):
        notes.append("output differs between rounds")
    if len(hyps) != len(text["refs"]):
        notes.append(f"{len(hyps)} translations for {len(text['refs'])} references")
        bleu = ""
    else:
        bleu = f"{sacrebleu.metrics.BLEU().corpus_score(hyps, [text['refs']]).score:.2f}"
    return {
        "run": args.run, "kind": "cells", "shape": cell["shape"], "encoder_layers": enc,
        "decoder_layers": dec, "embed_dim": r["embed_dim"], "ffn_dim": r["ffn_dim"],
        "heads": r["heads"], "vocab": text["vocab"], "scheme": cell["scheme"],
        "seed": r["seed"], "train_status": r["status"], "engine": engine,
        "precision": precision, "batch": batch, "threads": threads, "mean_batch": "",
        **speed_fields([(n, s) for n, s, _, _ in per_round], [p[3] for p in per_round]),
        "bleu": bleu, "note": "; ".join(notes), "cpu": cpu,
        "checkpoint": str(cell["checkpoint"].relative_to(cell["out"])),
    }


def run(args) -> List[Dict[str, str]]:
    """Export, time every unit in rotating rounds, return the CSV rows of run ``args.run``
    (ratios within it included)."""
    picked, missing = pick_checkpoints(args.study_out, args.plan, args.cells)
    for cell in missing:
        print(f"no checkpoint for {cell[0]} {cell[1]}: no row of --plan {args.plan} in "
              f"{', '.join(map(str, args.study_out))} whose run kept its checkpoint_best.pt "
              "(depth_study.py --keep-checkpoints); not timed", flush=True)
    if not picked:
        raise SystemExit("no cell has a checkpoint to time")
    texts = read_texts({c["out"] for c in picked})
    for cell in picked:
        cell["refused"] = export_cell(cell, args.work)
        if cell["refused"]:
            print(f"{cell['scheme']} {cell['shape']}: plugin speed only, the export refuses "
                  f"it: {cell['refused']}", flush=True)
    units = []
    for i, cell in enumerate(picked):
        engines = [(PLUGIN, "float32")] + ([] if cell["refused"] else
                                           [(CT2, p) for p in PRECISIONS])
        units += [(i, e, p, t) for e, p in engines for t in args.threads]

    def measure(unit):
        cell = picked[unit[0]]
        return measure_unit(cell, texts[cell["out"]], *unit[1:], args.batches)

    label = lambda u: f"{picked[u[0]]['scheme']} {picked[u[0]]['shape']} {u[1]} {u[2]}, " \
                      f"{u[3]} thread(s)"  # noqa: E731
    results = rotating_rounds(units, args.rounds, measure, label)
    rows, cpu = [], cpu_name()
    for k, unit in enumerate(units):
        cell = picked[unit[0]]
        rows += [unit_row(args, cell, texts[cell["out"]], unit, batch,
                          [res[batch] for res in results[k]], cpu) for batch in args.batches]
    add_ratios(rows)
    return rows
