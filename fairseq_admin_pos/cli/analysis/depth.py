"""The depth study of ``fairseq-admin-analyze``: every variant at every depth and seed, built
afresh and measured (omegas and output change, one :class:`Result` each), then the summaries
(mean over seeds, growth from the smallest to the largest depth, log-log slope), the CSVs
``output_change.csv`` and ``omegas.csv``, and the printed table."""
from __future__ import annotations

import csv
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from fairseq_admin_pos.models import admin_profile

from .measure import (build_model, data_batch, output_change, random_batch, shortcut_weights,
                      write_dicts)
from .variants import VARIANTS

# the tool's logger: its records carry the command's name
logger = logging.getLogger("fairseq_admin_pos.cli.analyze")


@dataclass
class Result:
    """One measurement: a variant at one depth and seed, its output change per stack."""

    variant: str
    encoder_layers: int
    decoder_layers: int
    seed: int
    encoder_change: float
    decoder_change: float
    omegas: Dict[str, List[float]]


def run_depth_study(args) -> List[Result]:
    """The measurements for checked arguments (``depth_list``, ``seed_list``,
    ``variant_list`` filled in by the command line's ``check_args``)."""
    if args.data is not None:
        return _run(args, args.data, ())
    # the random-token mode needs only dictionaries; they live as long as the measurement
    with tempfile.TemporaryDirectory(prefix="admin_analyze_") as dict_dir:
        write_dicts(dict_dir, args.vocab)
        return _run(args, dict_dir, ("src", "tgt"))


def _run(args, data: str, langs) -> List[Result]:
    results = []
    for seed in args.seed_list:
        for n_layers in args.depth_list:
            dec_layers = n_layers if args.decoder_layers == "same" else args.decoder_layers
            size = [
                "--encoder-embed-dim", str(args.embed_dim), "--decoder-embed-dim", str(args.embed_dim),
                "--encoder-ffn-embed-dim", str(args.ffn_dim), "--decoder-ffn-embed-dim", str(args.ffn_dim),
                "--encoder-attention-heads", str(args.heads), "--decoder-attention-heads", str(args.heads),
                "--encoder-layers", str(n_layers), "--decoder-layers", str(dec_layers),
            ]
            net_input = None
            for name in args.variant_list:
                variant = VARIANTS[name]
                model, task = build_model(data, langs, size + list(variant.model_args), seed)
                if net_input is None:  # the same input for every variant of this seed/depth
                    net_input = (random_batch(task, args.batch_size, args.max_len, seed)
                                 if args.data is None else
                                 data_batch(task, args.subset, args.max_tokens, seed))
                if variant.prepare is not None:
                    variant.prepare(model, net_input)
                omegas = {k: shortcut_weights(v)
                          for k, v in admin_profile.residual_stacks(model).items()}
                enc, dec = output_change(model, net_input, args.perturbation, args.trials,
                                         args.perturb, seed=1000 * seed + 7)
                results.append(Result(name, n_layers, dec_layers, seed, enc, dec, omegas))
                logger.info("%s N=%d seed=%d: encoder %.4g decoder %.4g", name, n_layers, seed,
                            enc, dec)
                del model
    return results


# --------------------------------------------------------------------------------------- #
# summaries and outputs
# --------------------------------------------------------------------------------------- #
def mean_changes(results: Sequence[Result]) -> Dict[str, Dict[int, Tuple[float, float]]]:
    """variant -> encoder depth -> (mean encoder change, mean decoder change) over seeds."""
    acc: Dict[str, Dict[int, List[Tuple[float, float]]]] = {}
    for r in results:
        acc.setdefault(r.variant, {}).setdefault(r.encoder_layers, []).append(
            (r.encoder_change, r.decoder_change))
    return {
        v: {n: (sum(e for e, _ in rows) / len(rows), sum(d for _, d in rows) / len(rows))
            for n, rows in sorted(by_n.items())}
        for v, by_n in acc.items()
    }


def growth(by_depth: Dict[int, Tuple[float, float]], which: int) -> Tuple[float, float]:
    """(change at the largest depth / change at the smallest, least-squares log-log slope)."""
    depths = sorted(by_depth)
    ys = [by_depth[n][which] for n in depths]
    if ys[0] > 0:
        ratio = ys[-1] / ys[0]
    else:  # ReZero at init: 0 at every depth
        ratio = float("nan") if ys[-1] == 0 else float("inf")
    if len(depths) < 2:
        return ratio, float("nan")
    lx = [math.log(n) for n in depths]
    ly = [math.log(max(y, 1e-300)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx if sxx > 0 else float("nan")
    return ratio, slope


def write_csvs(results: Sequence[Result], out_dir: str) -> Tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    change_path = os.path.join(out_dir, "output_change.csv")
    with open(change_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "encoder_layers", "decoder_layers", "seed", "encoder_change",
                    "decoder_change", "encoder_last_omega", "decoder_last_omega"])
        for r in results:
            w.writerow([r.variant, r.encoder_layers, r.decoder_layers, r.seed,
                        f"{r.encoder_change:.6e}", f"{r.decoder_change:.6e}",
                        f"{r.omegas['encoder'][-1]:.6f}", f"{r.omegas['decoder'][-1]:.6f}"])
    omega_path = os.path.join(out_dir, "omegas.csv")
    with open(omega_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "encoder_layers", "decoder_layers", "seed", "stack", "sublayer",
                    "omega"])
        for r in results:
            for stack, values in r.omegas.items():
                for i, v in enumerate(values, 1):
                    w.writerow([r.variant, r.encoder_layers, r.decoder_layers, r.seed, stack, i,
                                f"{v:.6f}"])
    return change_path, omega_path


def table(results: Sequence[Result]) -> str:
    means = mean_changes(results)
    depths = sorted({r.encoder_layers for r in results})
    last = {}
    for r in results:
        last.setdefault((r.variant, r.encoder_layers), []).append(
            (r.omegas["encoder"][-1], r.omegas["decoder"][-1]))
    lines = []
    head = f"{'variant':<20} {'output':<8}" + "".join(f"{'N=' + str(n):>11}" for n in depths)
    head += f"{'growth':>10}{'slope':>8}"
    lines.append(head)
    lines.append("-" * len(head))
    for variant, by_depth in means.items():
        for which, name in ((0, "encoder"), (1, "decoder")):
            ratio, slope = growth(by_depth, which)
            row = f"{variant:<20} {name:<8}" + "".join(
                f"{by_depth[n][which]:>11.3e}" if n in by_depth else f"{'':>11}" for n in depths)
            lines.append(row + f"{ratio:>9.2f}x{slope:>8.2f}")
        om = "".join(
            f"{'%.2f/%.2f' % tuple(sum(x) / len(x) for x in zip(*last[(variant, n)])):>11}"
            if (variant, n) in last else f"{'':>11}" for n in depths)
        lines.append(f"{'':<20} {'omega':<8}" + om + "   (last encoder/decoder omega)")
    lines.append(
        f"growth = change at N={depths[-1]} / change at N={depths[0]} (depth ratio "
        f"{depths[-1] / depths[0]:.1f}x); slope = least-squares d log(change) / d log(N)"
    )
    return "\n".join(lines)
