"""A trained checkpoint in ``fairseq-admin-analyze`` (``--checkpoint``): the checkpoint's
model and the model training started from (its flags, built with its ``--seed`` the way
``fairseq-train`` builds it), their output change on the same batches and perturbations,
and the shortcut weights of every sub-layer (Admin's omegas, ReZero's scalars, the scaled
sinusoid's scale) at initialisation and in the checkpoint, and both encoders' token cosines
per layer; ``checkpoint_output_change.csv``, ``checkpoint_weights.csv``,
``checkpoint_encoder_cos.csv`` and the printed table."""
from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from fairseq import tasks, utils

from fairseq_admin_pos.models import admin_profile

from .measure import data_batch, encoder_token_cosines, output_change, random_batch
from .variants import profile_admin

# the tool's logger: its records carry the command's name
logger = logging.getLogger("fairseq_admin_pos.cli.analyze")


@dataclass
class CheckpointChange:
    """Output change of one model (``initialisation`` or ``checkpoint``) on one seed's batch."""

    model: str
    seed: int
    encoder_change: float
    decoder_change: float


@dataclass
class WeightRow:
    """One trained or fixed weight of the checkpoint next to its initial value: ``weight`` is
    ``omega`` (Admin's or DeepNorm's shortcut weight), ``rezero`` (ReZero's branch scalar a)
    or ``pos_scale`` (the scaled sinusoid's scale); mean/min/max over the vector."""

    stack: str
    layer: str
    sublayer: str
    weight: str
    init: float
    mean: float
    min: float
    max: float


@dataclass
class CheckpointReport:
    """What ``--checkpoint`` measured: a one-line description of the checkpoint, the output
    changes per model and seed, the weights per sub-layer, and per model the encoder's token
    cosines on the first batch (:func:`.measure.encoder_token_cosines`: after the embedding,
    after each layer, of the output)."""

    path: str
    description: str
    changes: List[CheckpointChange]
    weights: List[WeightRow]
    encoder_cos: Dict[str, List[float]]


def _checkpoint_error(path: str, what: str) -> ValueError:
    return ValueError(f"--checkpoint {path!r}: {what}")


def load_checkpoint(path: str, data: Optional[str] = None):
    """``(init_model, model, task, cfg, num_updates)`` for an ``admin_transformer`` checkpoint:
    ``model`` holds the checkpoint's weights, ``init_model`` is the same configuration built
    afresh with the checkpoint's ``--seed`` the way ``fairseq-train`` builds it (seed, then
    ``task.build_model``), i.e. the model that training started from. Both float32, eval mode.
    ``data`` replaces the checkpoint's data folder. Errors name ``--checkpoint``."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.models import ARCH_MODEL_REGISTRY

    from fairseq_admin_pos.models.admin_transformer import AdminTransformerModel

    if not os.path.isfile(path):
        raise _checkpoint_error(path, "no such file")
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(
            path, arg_overrides={"data": data} if data is not None else None)
    except Exception as e:  # not a torch file, a truncated one, a foreign pickle
        raise _checkpoint_error(path, f"not a checkpoint torch.load can read ({type(e).__name__}: "
                                f"{e})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise _checkpoint_error(path, "not a fairseq checkpoint (no 'model' entry)")
    if state.get("args") is not None:
        cfg = convert_namespace_to_omegaconf(state["args"])
    elif state.get("cfg") is not None:
        cfg = state["cfg"]
    else:
        raise _checkpoint_error(path, "not a fairseq checkpoint (neither 'cfg' nor 'args')")
    arch = getattr(cfg.model, "arch", None) or getattr(cfg.model, "_name", None)
    cls = ARCH_MODEL_REGISTRY.get(arch)
    if cls is None or not issubclass(cls, AdminTransformerModel):
        raise _checkpoint_error(
            path, f"holds a {arch!r} model; --checkpoint needs an admin_transformer checkpoint "
            "(fairseq-train --user-dir fairseq_admin_pos --arch admin_transformer*)")
    try:
        task = tasks.setup_task(cfg.task, from_checkpoint=True)
    except Exception as e:  # the data folder (dictionaries) moved or is gone
        raise _checkpoint_error(
            path, f"cannot set up its task from the data folder {cfg.task.data!r} "
            f"({type(e).__name__}: {e}); pass --data FOLDER with its dictionaries") from None
    utils.set_torch_seed(cfg.common.seed)
    # both models take their omegas from here (the checkpoint, or profiling the init model
    # on the analysis batch), not from the profile file the training run named
    with admin_profile.loading_trained_checkpoint():
        init_model = task.build_model(cfg.model)
        model = task.build_model(cfg.model, from_checkpoint=True)
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    history = state.get("optimizer_history") or [{}]
    num_updates = history[-1].get("num_updates")
    return init_model.float().eval(), model.float().eval(), task, cfg, num_updates


def _sublayer_labels(stack: str, modules: Sequence, n_layers: int) -> List[Tuple[int, str]]:
    # residual_stacks lists each layer's sub-layers in execution order
    if stack == "encoder" or len(modules) == 2 * n_layers:  # no cross-attention
        names = ("self-attn", "ffn")
    else:
        names = ("self-attn", "enc-attn", "ffn")
    return [(i // len(names), names[i % len(names)]) for i in range(len(modules))]


def _weight_of(module) -> Tuple[str, Optional[torch.Tensor]]:
    if hasattr(module, "omega"):
        return "omega", module.omega
    return "rezero", getattr(module, "alpha", None)


def weight_rows(init_model, model) -> List[WeightRow]:
    """The shortcut weights of every sub-layer and the scaled sinusoid's scales, checkpoint
    against initialisation."""
    from fairseq_admin_pos.models.positions import ScaledSinusoidalPositions

    def stats(t: torch.Tensor) -> Tuple[float, float, float]:
        t = t.detach().double().reshape(-1)
        return t.mean().item(), t.min().item(), t.max().item()

    rows = []
    init_stacks = admin_profile.residual_stacks(init_model)
    stacks = admin_profile.residual_stacks(model)
    for stack, modules in stacks.items():
        labels = _sublayer_labels(stack, modules, len(getattr(model, stack).layers))
        for (layer, sub), m0, m1 in zip(labels, init_stacks[stack], modules):
            kind, w1 = _weight_of(m1)
            _, w0 = _weight_of(m0)
            if w1 is None:
                continue
            rows.append(WeightRow(stack, str(layer), sub, kind, stats(w0)[0], *stats(w1)))
    for stack in ("encoder", "decoder"):
        pos0 = getattr(getattr(init_model, stack), "embed_positions", None)
        pos1 = getattr(getattr(model, stack), "embed_positions", None)
        if isinstance(pos1, ScaledSinusoidalPositions):
            rows.append(WeightRow(stack, "", "positions", "pos_scale",
                                  stats(pos0.embed.scaling)[0], *stats(pos1.embed.scaling)))
    return rows


def _describe(path: str, cfg, init_model, num_updates) -> str:
    m = cfg.model
    settings = init_model.admin_settings
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items()
                     if v is not None)
    return (f"{path}: {getattr(m, 'arch', None) or getattr(m, '_name', None)}, "
            f"{len(init_model.encoder.layers)}L encoder / {len(init_model.decoder.layers)}L "
            f"decoder, {flags}; {num_updates} updates (training seed {cfg.common.seed})")


def measure_checkpoint(args) -> CheckpointReport:
    """Output change and shortcut weights of ``--checkpoint`` and of the same model at
    initialisation, on the same batch(es) and the same perturbations, for checked arguments
    (``seed_list`` filled in by the command line's ``check_args``)."""
    init_model, model, task, cfg, num_updates = load_checkpoint(args.checkpoint, args.data)
    batches = {seed: (random_batch(task, args.batch_size, args.max_len, seed)
                      if args.data is None else
                      data_batch(task, args.subset, args.max_tokens, seed))
               for seed in args.seed_list}
    if init_model.admin_settings["admin_init"] == "profile":
        # what --admin-init profile does on the first training batch, here on the first batch
        profile_admin(init_model, batches[args.seed_list[0]], seed=cfg.common.seed)
    first = batches[args.seed_list[0]]
    encoder_cos = {"initialisation": encoder_token_cosines(init_model, first),
                   "checkpoint": encoder_token_cosines(model, first)}
    changes = []
    for seed, net_input in batches.items():
        for name, m in (("initialisation", init_model), ("checkpoint", model)):
            enc, dec = output_change(m, net_input, args.perturbation, args.trials, args.perturb,
                                     seed=1000 * seed + 7)
            changes.append(CheckpointChange(name, seed, enc, dec))
            logger.info("%s seed=%d: encoder %.4g decoder %.4g", name, seed, enc, dec)
    description = _describe(args.checkpoint, cfg, init_model, num_updates)
    return CheckpointReport(args.checkpoint, description, changes, weight_rows(init_model, model),
                            encoder_cos)


def _cos_stages(n_values: int) -> List[str]:
    """Labels of :func:`.measure.encoder_token_cosines`' values: the embedding, each layer,
    the output."""
    return ["embedding"] + [f"layer {i}" for i in range(n_values - 2)] + ["output"]


def write_checkpoint_csvs(report: CheckpointReport, out_dir: str) -> Tuple[str, str, str]:
    os.makedirs(out_dir, exist_ok=True)
    change_path = os.path.join(out_dir, "checkpoint_output_change.csv")
    with open(change_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "seed", "encoder_change", "decoder_change"])
        for c in report.changes:
            w.writerow([c.model, c.seed, f"{c.encoder_change:.6e}", f"{c.decoder_change:.6e}"])
    weight_path = os.path.join(out_dir, "checkpoint_weights.csv")
    with open(weight_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stack", "layer", "sublayer", "weight", "init", "mean", "min", "max"])
        for r in report.weights:
            w.writerow([r.stack, r.layer, r.sublayer, r.weight,
                        *(f"{v:.6f}" for v in (r.init, r.mean, r.min, r.max))])
    cos_path = os.path.join(out_dir, "checkpoint_encoder_cos.csv")
    init, ckpt = report.encoder_cos["initialisation"], report.encoder_cos["checkpoint"]
    with open(cos_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stage", "initialisation", "checkpoint"])
        for stage, a, b in zip(_cos_stages(len(ckpt)), init, ckpt):
            w.writerow([stage, f"{a:.6f}", f"{b:.6f}"])
    return change_path, weight_path, cos_path


def checkpoint_table(report: CheckpointReport, args) -> str:
    lines = [f"checkpoint {report.description}", ""]
    mean = {}
    for name in ("initialisation", "checkpoint"):
        rows = [c for c in report.changes if c.model == name]
        mean[name] = (sum(c.encoder_change for c in rows) / len(rows),
                      sum(c.decoder_change for c in rows) / len(rows))
    lines.append(f"output change |F(x,W)-F(x,W+delta)|^2/|F(x,W)|^2, eps={args.perturbation:g} "
                 f"({args.perturb}), {args.trials} trial(s) x {len(args.seed_list)} batch(es):")
    lines.append(f"{'model':<16}{'encoder':>12}{'decoder':>12}")
    for name, (e, d) in mean.items():
        lines.append(f"{name:<16}{e:>12.3e}{d:>12.3e}")
    ratio = [c / i if i > 0 else float("nan") for c, i in zip(mean["checkpoint"],
                                                                mean["initialisation"])]
    lines.append(f"{'checkpoint/init':<16}{ratio[0]:>11.2f}x{ratio[1]:>11.2f}x")
    lines.append("")
    init, ckpt = report.encoder_cos["initialisation"], report.encoder_cos["checkpoint"]
    lines.append("encoder token cosine (mean cosine between the encoder outputs of two different "
                 "source tokens of the first batch; 1: a collapsed encoder, one vector for every "
                 f"token): initialisation {init[-1]:.3f}, checkpoint {ckpt[-1]:.3f}; the "
                 "checkpoint's after the embedding and after each layer: "
                 + " ".join(f"{c:.3f}" for c in ckpt[:-1]))
    lines.append("")
    lines.append("weights (omega: LN(x * omega + f(x)); rezero: x + a * f(x); pos_scale: scaled "
                 "sinusoid), initialisation and checkpoint (mean, min, max over the vector):")
    lines.append(f"{'stack':<8}{'layer':>6}  {'sublayer':<10}{'weight':<10}"
                 f"{'init':>9}{'mean':>9}{'min':>9}{'max':>9}")
    for r in report.weights:
        lines.append(f"{r.stack:<8}{r.layer:>6}  {r.sublayer:<10}{r.weight:<10}"
                     f"{r.init:>9.4f}{r.mean:>9.4f}{r.min:>9.4f}{r.max:>9.4f}")
    return "\n".join(lines)
