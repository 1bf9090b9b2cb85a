r"""``fairseq-admin-analyze``: why deep Post-LN fails, measured at initialisation.

For every variant (Post-LN, Pre-LN, Admin closed-form, Admin profiled, ...) and depth N, the
tool builds the real ``admin_transformer`` (fairseq's own model-building path, float32, eval
mode: no dropout) with N encoder and N decoder layers (``--decoder-layers`` to fix the decoder
depth instead) and measures

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

Variants are entries of :data:`VARIANTS`: a name, the extra ``admin_transformer``
command-line arguments, and an optional ``prepare(model, net_input)`` run after building
(profiling uses it). The residual-scheme rivals (``--admin-residual``, see
:mod:`fairseq_admin_pos.schemes`) are entries too: ``deepnorm`` (omega column = DeepNorm's
alpha), ``rezero``, ``rezero-post-ln``, ``b2t`` and ``resi-dual`` (omega column = 1, the
plain shortcut; B2T's extra term and ResiDual's dual stream and its final LayerNorm are not
branch weights, so ``--perturb branches`` leaves them as they are). ReZero's
branch scalars start at 0, so every layer is the identity at initialisation and the output
does not depend on any branch weight: its output change under ``--perturb branches`` is
exactly 0 at every depth (the scalars themselves are perturbed relative to their rms, 0).
The plot cannot draw 0 on a log axis and lists such a variant in the legend instead.
``--variants`` defaults to the Admin comparison (Post-LN, Pre-LN, Admin closed-form and
profiled); ``all`` adds the rivals.

``--checkpoint CKPT`` measures a trained model instead: the same output change for the
checkpoint's weights and for the model training started from (the checkpoint's flags,
built with its ``--seed`` the way ``fairseq-train`` builds it), on the same batches and
perturbations, and the shortcut weights of every sub-layer (mean, min, max over Admin's
omega vectors; ReZero's scalars; the scaled sinusoid's scale) at initialisation and in the
checkpoint. It writes ``checkpoint_output_change.csv`` and ``checkpoint_weights.csv``.
"""
from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import fairseq_admin_pos  # noqa: F401  (registers admin_transformer)
from fairseq import options, tasks, utils
from fairseq.data import data_utils

from fairseq_admin_pos.models import admin_profile

logger = logging.getLogger("fairseq_admin_pos.cli.analyze")


# --------------------------------------------------------------------------------------- #
# variants
# --------------------------------------------------------------------------------------- #
def _profile(model, net_input, seed: int = 1) -> None:
    """Admin's profiling on the analysis batch, as ``--admin-init profile`` does on the first
    training batch: in the model's ``--admin-profile-mode`` (clinic, the default: a
    training-mode pass whose dropout masks come from ``seed``, as fairseq seeds its first
    step; eval: no dropout). The caller's random stream is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        omegas, _ = admin_profile.measure(model, [net_input], mode=model.admin_profile.mode)
    admin_profile.apply(model, omegas)


@dataclass(frozen=True)
class Variant:
    """One model family: ``model_args`` are extra ``admin_transformer`` flags; ``prepare``
    (optional) runs once on the built float32 eval model and the input batch."""

    label: str
    model_args: Tuple[str, ...]
    prepare: Optional[Callable] = field(default=None, compare=False)


#: name -> variant; a new residual scheme is one more entry with its admin_transformer flags.
VARIANTS: Dict[str, Variant] = {
    "post-ln": Variant("Post-LN", ("--admin-init", "none")),
    "pre-ln": Variant(
        "Pre-LN",
        ("--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before"),
    ),
    "admin-closed-form": Variant(
        "Admin closed-form O(log N)",
        ("--admin-init", "closed-form", "--admin-output-change-scale", "O(logn)"),
    ),
    # eval-mode statistics: the omegas of a dropout-free pass, comparable across depths (the
    # default clinic mode adds the dropout masks of one step; see fairseq_admin_pos.profiling)
    "admin-profile": Variant("Admin profiled (eval mode)",
                             ("--admin-init", "profile", "--admin-profile-mode", "eval"),
                             prepare=_profile),
    # the rivals (fairseq_admin_pos.schemes)
    "deepnorm": Variant("DeepNorm", ("--admin-residual", "deepnorm")),
    "rezero": Variant("ReZero (no LN)", ("--admin-residual", "rezero")),
    "rezero-post-ln": Variant("ReZero Post-LN", ("--admin-residual", "rezero-post-ln")),
    "b2t": Variant("B2T connection", ("--admin-residual", "b2t")),
    "resi-dual": Variant("ResiDual", ("--admin-residual", "resi-dual")),
}

#: what ``--variants`` runs when not given
DEFAULT_VARIANTS = ("post-ln", "pre-ln", "admin-closed-form", "admin-profile")


def _shortcut_weights(modules) -> List[float]:
    # Admin/DeepNorm residuals hold omega (alpha); ReZero's shortcut is the plain x (weight 1)
    return [float(m.omega.detach().reshape(-1)[0].float()) if hasattr(m, "omega") else 1.0
            for m in modules]

PERTURB_CHOICES = ("branches", "all")

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


# --------------------------------------------------------------------------------------- #
# models and inputs
# --------------------------------------------------------------------------------------- #
def _write_dicts(folder: str, vocab: int) -> None:
    for lang in ("src", "tgt"):
        with open(os.path.join(folder, f"dict.{lang}.txt"), "w", encoding="utf-8") as f:
            for i in range(vocab):
                f.write(f"w{i} 1\n")


def build_model(data: str, langs: Sequence[str], model_args: Sequence[str], seed: int):
    """``(model, task)`` through fairseq's option parser and ``task.build_model``, float32, eval."""
    argv = [data, "--arch", "admin_transformer", "--cpu", "--seed", str(seed)]
    if langs:
        argv += ["--source-lang", langs[0], "--target-lang", langs[1]]
    parser = options.get_training_parser(default_task="translation")
    args = options.parse_args_and_arch(parser, argv + list(model_args))
    task = tasks.setup_task(args)
    utils.set_torch_seed(seed)
    model = task.build_model(args)
    return model.float().eval(), task


def random_batch(task, batch_size: int, max_len: int, seed: int) -> dict:
    """Random token sentences of length max_len/2..max_len (+ eos), collated like fairseq's
    LanguagePairDataset (left-padded source, right-padded shifted target), so there is
    padding to exclude."""
    g = torch.Generator().manual_seed(seed)
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    src, tgt = [], []
    for _ in range(batch_size):
        for d, out in ((src_dict, src), (tgt_dict, tgt)):
            n = int(torch.randint(max(1, max_len // 2), max_len + 1, (1,), generator=g))
            toks = torch.randint(d.nspecial, len(d), (n,), generator=g)
            out.append(torch.cat([toks, torch.tensor([d.eos()])]))
    return {
        "src_tokens": data_utils.collate_tokens(src, src_dict.pad(), src_dict.eos(), left_pad=True),
        "src_lengths": torch.tensor([len(s) for s in src]),
        "prev_output_tokens": data_utils.collate_tokens(
            tgt, tgt_dict.pad(), tgt_dict.eos(), left_pad=False, move_eos_to_beginning=True
        ),
    }


def data_batch(task, subset: str, max_tokens: int, seed: int) -> dict:
    """The first batch (seeded shuffle) of a binarized subset."""
    task.load_dataset(subset)
    itr = task.get_batch_iterator(
        task.dataset(subset), max_tokens=max_tokens, seed=seed, ignore_invalid_inputs=True,
        disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=True)
    sample = next(iter(itr))
    n = sample["net_input"]
    return {k: n[k] for k in ("src_tokens", "src_lengths", "prev_output_tokens")}


def _outputs(model, n) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encoder output and decoder features, both (B, T, C)."""
    with torch.no_grad():
        enc = model.encoder(n["src_tokens"], src_lengths=n["src_lengths"])
        dec, _ = model.decoder(n["prev_output_tokens"], encoder_out=enc, features_only=True)
    return enc["encoder_out"][0].transpose(0, 1), dec


def perturbed_parameters(model, which: str) -> List[torch.Tensor]:
    """The tensors ``--perturb`` selects: ``branches`` = every parameter inside the encoder and
    decoder layers except LayerNorms and omegas; ``all`` = every parameter except omegas."""
    if which not in PERTURB_CHOICES:
        raise ValueError(f"--perturb {which!r} is not valid; valid choices: {', '.join(PERTURB_CHOICES)}")
    out = []
    for name, p in model.named_parameters():
        if name.endswith(".omega"):
            continue  # the shortcut weight is Admin's knob, not a branch weight
        if which == "branches" and (".layers." not in name or "layer_norm" in name):
            continue
        out.append(p)
    return out


def output_change(model, n, eps: float, trials: int, which: str, seed: int) -> Tuple[float, float]:
    """Mean over ``trials`` of ``|F(x,W) - F(x,W+delta)|^2 / |F(x,W)|^2`` for the encoder and
    the decoder output (real-token positions only); the weights are restored afterwards."""
    pad_src = n["src_tokens"].ne(model.encoder.padding_idx)
    pad_tgt = n["prev_output_tokens"].ne(model.decoder.padding_idx)
    e0, d0 = _outputs(model, n)
    params = perturbed_parameters(model, which)
    saved = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(seed)
    enc, dec = [], []
    try:
        for _ in range(trials):
            with torch.no_grad():
                for p in params:
                    rms = p.detach().double().pow(2).mean().sqrt().item()
                    p.add_(eps * rms * torch.randn(p.shape, generator=g, dtype=p.dtype))
            e1, d1 = _outputs(model, n)
            enc.append(((e1 - e0)[pad_src].double().pow(2).sum() / e0[pad_src].double().pow(2).sum()).item())
            dec.append(((d1 - d0)[pad_tgt].double().pow(2).sum() / d0[pad_tgt].double().pow(2).sum()).item())
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return sum(enc) / trials, sum(dec) / trials


# --------------------------------------------------------------------------------------- #
# the analysis
# --------------------------------------------------------------------------------------- #
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
    check_args(args)
    if args.data is not None:
        return _run_analysis(args, args.data, ())
    # the random-token mode needs only dictionaries; they live as long as the measurement
    with tempfile.TemporaryDirectory(prefix="admin_analyze_") as dict_dir:
        _write_dicts(dict_dir, args.vocab)
        return _run_analysis(args, dict_dir, ("src", "tgt"))


def _run_analysis(args, data: str, langs) -> List[Result]:
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
                omegas = {k: _shortcut_weights(v)
                          for k, v in admin_profile.residual_stacks(model).items()}
                enc, dec = output_change(model, net_input, args.perturbation, args.trials,
                                         args.perturb, seed=1000 * seed + 7)
                results.append(Result(name, n_layers, dec_layers, seed, enc, dec, omegas))
                logger.info("%s N=%d seed=%d: encoder %.4g decoder %.4g", name, n_layers, seed,
                            enc, dec)
                del model
    return results


# --------------------------------------------------------------------------------------- #
# a trained checkpoint (--checkpoint)
# --------------------------------------------------------------------------------------- #
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
    changes per model and seed, and the weights per sub-layer."""

    path: str
    description: str
    changes: List[CheckpointChange]
    weights: List[WeightRow]


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


def run_checkpoint_analysis(args) -> CheckpointReport:
    """Output change and shortcut weights of ``--checkpoint`` and of the same model at
    initialisation, on the same batch(es) and the same perturbations."""
    check_args(args)
    init_model, model, task, cfg, num_updates = load_checkpoint(args.checkpoint, args.data)
    batches = {seed: (random_batch(task, args.batch_size, args.max_len, seed)
                      if args.data is None else
                      data_batch(task, args.subset, args.max_tokens, seed))
               for seed in args.seed_list}
    if init_model.admin_settings["admin_init"] == "profile":
        # what --admin-init profile does on the first training batch, here on the first batch
        _profile(init_model, batches[args.seed_list[0]], seed=cfg.common.seed)
    changes = []
    for seed, net_input in batches.items():
        for name, m in (("initialisation", init_model), ("checkpoint", model)):
            enc, dec = output_change(m, net_input, args.perturbation, args.trials, args.perturb,
                                     seed=1000 * seed + 7)
            changes.append(CheckpointChange(name, seed, enc, dec))
            logger.info("%s seed=%d: encoder %.4g decoder %.4g", name, seed, enc, dec)
    description = _describe(args.checkpoint, cfg, init_model, num_updates)
    return CheckpointReport(args.checkpoint, description, changes, weight_rows(init_model, model))


def write_checkpoint_csvs(report: CheckpointReport, out_dir: str) -> Tuple[str, str]:
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
    return change_path, weight_path


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
    lines.append("weights (omega: LN(x * omega + f(x)); rezero: x + a * f(x); pos_scale: scaled "
                 "sinusoid), initialisation and checkpoint (mean, min, max over the vector):")
    lines.append(f"{'stack':<8}{'layer':>6}  {'sublayer':<10}{'weight':<10}"
                 f"{'init':>9}{'mean':>9}{'min':>9}{'max':>9}")
    for r in report.weights:
        lines.append(f"{r.stack:<8}{r.layer:>6}  {r.sublayer:<10}{r.weight:<10}"
                     f"{r.init:>9.4f}{r.mean:>9.4f}{r.min:>9.4f}{r.max:>9.4f}")
    return "\n".join(lines)


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


def plot(results: Sequence[Result], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = mean_changes(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, which, name in ((axes[0], 0, "encoder output"), (axes[1], 1, "decoder output")):
        for variant, by_depth in means.items():
            depths = sorted(by_depth)
            label = VARIANTS[variant].label if variant in VARIANTS else variant
            ys = [by_depth[n][which] for n in depths]
            if not any(y > 0 for y in ys):  # log axis: list it, e.g. ReZero (identity at init)
                ax.plot([], [], ls="none", marker="x", color="black",
                        label=f"{label}: 0 at every N")
                continue
            ax.plot(depths, ys, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r.encoder_layers for r in results}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.minorticks_off()
        ax.set_xlabel("encoder layers N" + (" (= decoder layers)" if all(
            r.encoder_layers == r.decoder_layers for r in results) else ""))
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(r"$|F(x,W)-F(x,W+\delta)|^2 / |F(x,W)|^2$")
    fig.suptitle(title, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    if len(labels) <= 5:
        axes[0].legend(fontsize=8)
        fig.tight_layout()
    else:  # with the rivals (--variants all) a legend inside would hide curves
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
