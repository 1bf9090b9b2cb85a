"""``fairseq-admin-export``: a trained ``admin_transformer`` as a stock fairseq ``transformer``.

    fairseq-admin-export demo_out/admin/checkpoints/checkpoint_last.pt \\
        --out demo_out/admin/stock.pt --ctranslate2 demo_out/admin/ct2 --quantization int8

writes a checkpoint that ``fairseq-generate`` loads without ``--user-dir`` (and without
turning ``weights_only`` off) and, with ``--ctranslate2``, converts it with CTranslate2's
own ``FairseqConverter`` (the ``deploy`` extra). Each export is checked before it is
written: the stock model's log-probabilities on a padded batch are compared with the
original's, and the largest difference is printed. The folding and its exactness are
explained in :mod:`fairseq_admin_pos.export.fold`; the file format in
:mod:`fairseq_admin_pos.export.checkpoint`.

Residual schemes without a stock equivalent (``rezero``, ``b2t``, ``resi-dual``,
``peri-ln``, ``mix-ln``) and DyT models (``--admin-norm dyt``) are refused with one line
saying why; nothing is written then, nor on any other error.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from fairseq_admin_pos.export.checkpoint import CT2_QUANTIZATIONS
from fairseq_admin_pos.export.fold import SCALAR_FOLDS

PROG = "fairseq-admin-export"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="an admin_transformer checkpoint written by fairseq-train --user-dir "
                   "fairseq_admin_pos")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the stock fairseq checkpoint to write (a temporary file next to it is "
                   "renamed at the end)")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="folder with the dictionaries, when the checkpoint's own data path "
                   "(task.data) is not on this machine; used to build the models and by "
                   "CTranslate2's converter, while the exported file keeps the original path "
                   "(fairseq-generate takes the data folder on its command line anyway)")
    p.add_argument("--ctranslate2", metavar="DIR", default=None,
                   help="also convert the export with CTranslate2's FairseqConverter into DIR "
                   "(must not exist or be empty; needs the deploy extra: ctranslate2==4.8.5)")
    p.add_argument("--quantization", choices=CT2_QUANTIZATIONS, default=None,
                   help="CTranslate2 weight type (only with --ctranslate2); default: the "
                   "weights' own float32")
    p.add_argument("--scalar-fold", choices=SCALAR_FOLDS, default="output",
                   help="where a scalar shortcut weight w (omega buffer, DeepNorm's alpha) "
                   "goes: output = 1/w into each branch's out_proj/fc2, keeping shared "
                   "embeddings and sinusoidal positions; exact up to the LayerNorm eps term "
                   "(about 5e-6 relative per LayerNorm, fold.py section 2); input = w into the "
                   "LayerNorm before and 1/w into q/k/v/fc1, exact, but with one embedding "
                   "table per side and learned position tables. Default: output")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # fairseq's INFO lines (task setup, model loading) would bury the result
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from fairseq_admin_pos.export.checkpoint import ExportError, export
    from fairseq_admin_pos.export.fold import NotExportable

    def log(msg: str) -> None:
        print(f"{PROG}: {msg}", flush=True)

    try:
        report = export(args.checkpoint, args.out, data=args.data,
                        ctranslate2=args.ctranslate2, quantization=args.quantization,
                        scalar_fold=args.scalar_fold, log=log)
    except (ExportError, NotExportable) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    positions = ", ".join(f"{side} {kind}" for side, kind in report.positions.items())
    log(f"{report.scheme} model -> stock transformer ({positions} positions"
        f"{'; per-side embedding tables' if report.unshared else ''})")
    for line in report.folds:
        log(f"  {line}")
    exactness = ("exact up to float32 rounding" if not report.eps_scales else
                 f"{len(report.eps_scales)} LayerNorms differ by their eps term (see "
                 "fairseq_admin_pos/export/fold.py, section 2)")
    log(f"self-check: max |log p difference| {report.max_abs_logprob_diff:.3g} on a padded "
        f"batch ({exactness})")
    log(f"wrote {report.out}")
    if report.ctranslate2 is not None:
        log(f"wrote {report.ctranslate2} (CTranslate2"
            f"{', ' + args.quantization if args.quantization else ''})")
    return 0


def cli_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
