r"""``fairseq-admin-analyze``: why deep Post-LN fails, measured at initialisation.

For every variant (``post-ln``, ``pre-ln``, ``admin``, ``admin-profile``, ...: the scheme
names of :mod:`fairseq_admin_pos.scheme_flags`, the ones the demo and the recipes use) and
depth N, the tool builds the real ``admin_transformer`` (fairseq's own model-building path,
float32, eval mode: no dropout) with N encoder and N decoder layers (``--decoder-layers`` to
fix the decoder depth instead) and measures

* **the omegas** of every residual sub-layer (1 for Post-LN/Pre-LN; the closed form; or
  profiled on the input batch as ``--admin-init profile --admin-profile-mode eval`` does on
  the first training batch, see :mod:`fairseq_admin_pos.profiling`);
* **the output change** (Liu et al. 2020, "Understanding the Difficulty of Training
  Transformers", Sec. 3.3 and Theorem 2):

      change = |F(x, W) - F(x, W + delta)|^2 / |F(x, W)|^2

  where F is the encoder output and the decoder output (final hidden states, before the
  vocabulary projection; sums over real-token positions and features), and ``delta`` is a
  random perturbation of the weights: for each perturbed tensor ``W_p``,
  ``delta_p = eps * rms(W_p) * z`` with ``z ~ N(0, 1)`` elementwise and ``eps =
  --perturbation``. By default (``--perturb branches``) the perturbed tensors are those of
  the residual branches - attention and FFN weights and biases of every layer - i.e. the
  paper's W in F(x, W); ``--perturb all`` perturbs every parameter (embeddings and
  LayerNorm gains too), which adds a term that grows as O(N) for every Post-LN variant,
  Admin included, because a LayerNorm gain perturbation travels along the shortcut
  undamped. The change is averaged over ``--trials`` perturbations and over ``--seeds``
  model initialisations (each seed also draws its own input batch).

The paper's analysis predicts O(N) growth in depth for Post-LN and O(log N) for Pre-LN and
Admin. The tool writes ``output_change.csv`` (one row per variant, depth and seed),
``omegas.csv`` (one row per sub-layer), ``output_change.png`` (log-log: depth vs change) to
``--out-dir`` and prints a table with, per variant, the growth from the smallest to the
largest depth and the log-log slope (1 = linear in depth).

Variants are entries of :data:`VARIANTS`: a scheme name, its ``admin_transformer`` flags
from the scheme table, and an optional ``prepare(model, net_input)`` run after building
(profiling uses it). The residual-scheme rivals (``--admin-residual``, see
:mod:`fairseq_admin_pos.schemes`) are entries too: ``deepnorm`` (omega column = DeepNorm's
alpha), ``rezero``, ``rezero-post-ln``, ``b2t`` and ``resi-dual`` (omega column = 1, the
plain shortcut; B2T's extra term and ResiDual's dual stream and its final LayerNorm are not
branch weights, so ``--perturb branches`` leaves them as they are). ReZero's
branch scalars start at 0, so every layer is the identity at initialisation and the output
does not depend on any branch weight: its output change under ``--perturb branches`` is
exactly 0 at every depth (the scalars themselves are perturbed relative to their rms, 0).
The plot cannot draw 0 on a log axis and lists such a variant in the legend instead.
``--variants`` defaults to the Admin comparison (``post-ln``, ``pre-ln``, ``admin``: the
closed form, ``admin-profile``: profiled without dropout; ``admin-paper`` profiles in
Transformer-Clinic's training mode); ``all`` adds the rivals, the LayerNorm placements Peri-LN and Mix-LN, and
Post-LN, Pre-LN, Peri-LN and Mix-LN with DyT in place of LayerNorm (``*-dyt``).

``--checkpoint CKPT`` measures a trained model instead: the same output change for the
checkpoint's weights and for the model training started from (the checkpoint's flags,
built with its ``--seed`` the way ``fairseq-train`` builds it), on the same batches and
perturbations, and the shortcut weights of every sub-layer (mean, min, max over Admin's
omega vectors; ReZero's scalars; the scaled sinusoid's scale) at initialisation and in the
checkpoint, and how alike its encoder makes different source tokens (the encoder token
cosine per layer: near 1, a collapsed encoder). It writes ``checkpoint_output_change.csv``,
``checkpoint_weights.csv`` and ``checkpoint_encoder_cos.csv``.

This module is the command line (flags, their checks, the printed output); the measurement,
the depth study, the checkpoint analysis and the plot live in :mod:`.analysis`.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import List, Optional, Sequence

from fairseq_admin_pos.cli.analysis.checkpoint import (
    CheckpointChange, CheckpointReport, WeightRow, checkpoint_table, load_checkpoint,
    measure_checkpoint, weight_rows, write_checkpoint_csvs)
from fairseq_admin_pos.cli.analysis.depth import (
    Result, growth, mean_changes, run_depth_study, table, write_csvs)
from fairseq_admin_pos.cli.analysis.measure import (
    PERTURB_CHOICES, build_model, data_batch, output_change, perturbed_parameters, random_batch,
    shortcut_weights, write_dicts)
from fairseq_admin_pos.cli.analysis.plot import plot
from fairseq_admin_pos.cli.analysis.variants import (
    DEFAULT_VARIANTS, VARIANTS, Variant, profile_admin)

#: the tool's names, importable from here whichever part of :mod:`.analysis` holds them
__all__ = [
    "cli_main", "get_parser", "check_args", "run_analysis", "run_checkpoint_analysis",
    "MODEL_FLAGS", "VARIANTS", "DEFAULT_VARIANTS", "Variant", "profile_admin",
    "PERTURB_CHOICES", "build_model", "random_batch", "data_batch", "shortcut_weights",
    "write_dicts", "perturbed_parameters", "output_change",
    "Result", "run_depth_study", "mean_changes", "growth", "write_csvs", "table", "plot",
    "CheckpointChange", "WeightRow", "CheckpointReport", "load_checkpoint", "weight_rows",
    "measure_checkpoint", "write_checkpoint_csvs", "checkpoint_table",
]
_write_dicts = write_dicts  # its name before the split

#: flag -> (attribute, default) of the flags that describe the models the depth study builds;
#: --checkpoint refuses them (its model is the checkpoint's)
MODEL_FLAGS = {
    "--embed-dim": ("embed_dim", 64),
    "--ffn-dim": ("ffn_dim", 256),
    "--heads": ("heads", 4),
    "--depths": ("depths", "6,12,18,36,60"),
    "--decoder-layers": ("decoder_layers", "same"),
    "--variants": ("variants", ",".join(DEFAULT_VARIANTS)),
    "--vocab": ("vocab", 200),
}


def _int_list(text: str, flag: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers; got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} must be positive integers; got {text!r}")
    return values


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-admin-analyze",
        description="Omegas and output change |F(x,W)-F(x,W+delta)|^2/|F|^2 at initialisation "
        "for Post-LN, Pre-LN and Admin admin_transformer models of several depths, or "
        "(--checkpoint) of a trained checkpoint next to the model it started from.",
    )
    # the model-describing flags default to None so that --checkpoint can refuse them when
    # given; check_args fills in the defaults named in their help
    p.add_argument("--checkpoint", metavar="CKPT", default=None,
                   help="a trained admin_transformer checkpoint (fairseq-train's checkpoint*.pt): "
                   "measure its output change and print its omegas per sub-layer, next to the "
                   "same model freshly initialised (the checkpoint's flags and seed). The batch "
                   "is random tokens of the checkpoint's dictionaries, or --data's. The flags "
                   "that describe models to build (" + ", ".join(MODEL_FLAGS) + ") do not "
                   "apply")
    p.add_argument("--embed-dim", type=int, default=None, help="model width d (default 64)")
    p.add_argument("--ffn-dim", type=int, default=None, help="FFN inner size (default 256)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    p.add_argument("--depths", default=None,
                   help="comma-separated encoder depths N (default 6,12,18,36,60)")
    p.add_argument("--decoder-layers", default=None,
                   help="decoder depth: 'same' (= each N, default) or a fixed integer")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of: {', '.join(VARIANTS)}, or all "
                   f"(default: {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--perturbation", type=float, default=1e-2,
                   help="eps: delta = eps * rms(W) * N(0,1) per tensor (default 1e-2)")
    p.add_argument("--perturb", choices=PERTURB_CHOICES, default="branches",
                   help="which weights are perturbed: branches = attention/FFN weights of every "
                   "layer (the paper's W, default); all = every parameter")
    p.add_argument("--trials", type=int, default=3, help="perturbations per model (default 3)")
    p.add_argument("--seeds", default="1", help="comma-separated init seeds (default 1)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="sentences in the random input batch (default 16)")
    p.add_argument("--max-len", type=int, default=20,
                   help="longest random sentence, tokens (default 20; lengths N/2..N)")
    p.add_argument("--vocab", type=int, default=None, help="random vocabulary size (default 200)")
    p.add_argument("--data", default=None,
                   help="binarized fairseq data folder: take the input batch from it instead "
                   "of random tokens (with --checkpoint: also the folder of the checkpoint's "
                   "dictionaries, instead of the one it was trained from)")
    p.add_argument("--subset", default="valid", help="--data subset (default valid)")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="--data batch size in tokens (default 1024)")
    p.add_argument("--out-dir", default="admin_analysis",
                   help="folder for output_change.csv, omegas.csv, output_change.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def check_args(args) -> None:
    given = [flag for flag, (attr, _) in MODEL_FLAGS.items() if getattr(args, attr) is not None]
    if args.checkpoint is not None:
        if given:
            raise ValueError(
                f"{', '.join(given)} cannot be combined with --checkpoint: these flags describe "
                "the models the depth study builds, --checkpoint measures the checkpoint's own "
                "model (drop them)")
        args.seed_list = _int_list(args.seeds, "--seeds")
        _check_measurement_args(args)
        if not os.path.isfile(args.checkpoint):
            raise ValueError(f"--checkpoint {args.checkpoint!r}: no such file")
        return
    for attr, default in MODEL_FLAGS.values():
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    args.depth_list = _int_list(args.depths, "--depths")
    args.seed_list = _int_list(args.seeds, "--seeds")
    if args.decoder_layers != "same":
        try:
            args.decoder_layers = int(args.decoder_layers)
            assert args.decoder_layers >= 1
        except (ValueError, AssertionError):
            raise ValueError(f"--decoder-layers must be 'same' or a positive integer; got "
                             f"{args.decoder_layers!r}") from None
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.variant_list == ["all"]:
        args.variant_list = list(VARIANTS)
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.variant_list:
        raise ValueError(f"--variants {', '.join(bad) or repr(args.variants)} not valid; valid "
                         f"choices: {', '.join(VARIANTS)}")
    for flag, value in (("--embed-dim", args.embed_dim), ("--ffn-dim", args.ffn_dim),
                        ("--heads", args.heads)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer; got {value}")
    if args.embed_dim % args.heads:
        raise ValueError(f"--embed-dim {args.embed_dim} must be divisible by --heads {args.heads}")
    if args.vocab < 2:
        raise ValueError(f"--vocab must be at least 2; got {args.vocab}")
    _check_measurement_args(args)


def _check_measurement_args(args) -> None:
    # the flags of the measurement itself, shared by both modes
    for flag, value in (("--trials", args.trials), ("--batch-size", args.batch_size),
                        ("--max-len", args.max_len), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer; got {value}")
    if not (args.perturbation > 0 and math.isfinite(args.perturbation)):
        raise ValueError(f"--perturbation must be a positive number; got {args.perturbation}")
    if args.data is not None and not os.path.isdir(args.data):
        raise ValueError(f"--data {args.data!r} is not a folder")


def run_analysis(args) -> List[Result]:
    """The depth study: every variant at every depth and seed (:mod:`.analysis.depth`)."""
    check_args(args)
    return run_depth_study(args)


def run_checkpoint_analysis(args) -> CheckpointReport:
    """Output change and shortcut weights of ``--checkpoint`` and of the same model at
    initialisation, on the same batch(es) and the same perturbations
    (:mod:`.analysis.checkpoint`)."""
    check_args(args)
    return measure_checkpoint(args)


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stderr,
                        force=True)
    # fairseq's option parsing and task setup are chatty at INFO, matplotlib at DEBUG
    for noisy in ("fairseq", "fairseq_cli", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.checkpoint is not None:
        try:
            report = run_checkpoint_analysis(args)
        except ValueError as e:
            parser.error(str(e))
        paths = write_checkpoint_csvs(report, args.out_dir)
        print(checkpoint_table(report, args))
        for path in paths:
            print(f"wrote {path}")
        return 0
    try:
        results = run_analysis(args)
    except ValueError as e:
        parser.error(str(e))
    change_path, omega_path = write_csvs(results, args.out_dir)
    print(table(results))
    print(f"wrote {change_path}")
    print(f"wrote {omega_path}")
    if not args.no_plot:
        title = (f"output change at initialisation, d={args.embed_dim}, ffn={args.ffn_dim}, "
                 f"heads={args.heads}, eps={args.perturbation:g} ({args.perturb}), "
                 f"{args.trials} trials x {len(args.seed_list)} seed(s)")
        print(f"wrote {plot(results, os.path.join(args.out_dir, 'output_change.png'), title)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
