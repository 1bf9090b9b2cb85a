"""fairseq glue for ``--admin-init profile``: profile on the first training batch(es), in the
same ``fairseq-train`` command, before the first update.

The statistics, the ratio recurrence and the profile files are in
:mod:`fairseq_admin_pos.profiling` (pure torch; read its docstring for exactly what is
summed). This module decides *when* and *on what* to profile:

* The model holds a persistent buffer ``admin_profiled`` (0/1, saved in every checkpoint).
  On the first *training* forward of a model that is not yet profiled it measures (or reads)
  the omegas, writes them into the residual modules (dtype/device kept), sets
  ``admin_profiled = 1`` and then runs the normal forward: no ``exit()``, no second run, no
  task or criterion to switch. A resumed run loads ``admin_profiled = 1`` and the omegas
  from the checkpoint and never profiles again; ``fairseq-generate``/``-interactive``/hub
  loading run in eval mode, so they never profile and need no side file.
* ``--admin-profile-batches K``: K = 1 profiles the current (first) training batch; K > 1
  profiles the first K batches this rank draws in epoch 1, obtained from the task with the
  training iterator's settings (max tokens/sentences, seed, shard = data-parallel rank and
  world size), so in a fresh run they are exactly the first K training batches of the rank.
* Data-parallel runs: each rank profiles its own batches and the sufficient statistics are
  summed over ranks with one ``all_reduce``; every rank gets the same omegas, equal to one
  process profiling all ranks' batches (checked after the fact: a mismatch is an error).
* ``--admin-profile-path FILE``: if FILE exists (on every rank) the omegas are read from it
  (this package's JSON, or Transformer-Clinic's ``profile.ratio.init``) instead of measured;
  otherwise they are measured and rank 0 writes FILE atomically with the settings they came
  from. Wrong layer counts raise an error that names the file and both counts.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from fairseq import utils
from fairseq.distributed import utils as distributed_utils

from fairseq_admin_pos import profiling

logger = logging.getLogger(__name__)

#: residual-module attribute names of each stack's layers, in execution order
SUBLAYER_NAMES = {
    "encoder": ("self_attn_residual", "final_residual"),
    "decoder": ("self_attn_residual", "encoder_attn_residual", "final_residual"),
}


def add_profile_args(parser) -> None:
    """The ``--admin-profile-*`` flags (used only with ``--admin-init profile``)."""
    parser.add_argument(
        "--admin-profile-batches", type=int, metavar="K",
        help="--admin-init profile: number of training batches per rank whose statistics "
        "set the omegas (the first K batches of epoch 1; statistics are summed over "
        "batches and data-parallel ranks). Default: 1",
    )
    parser.add_argument(
        "--admin-profile-path", metavar="FILE",
        help="--admin-init profile: if FILE exists, read the omegas from it (this package's "
        "JSON or Transformer-Clinic's profile.ratio.init) instead of measuring; otherwise "
        "measure and write FILE (rank 0, atomically, with the settings used). Default: no file",
    )
    parser.add_argument(
        "--admin-profile-include-padding", action="store_true", default=None,
        help="--admin-init profile: count padded positions in the variances, as "
        "Transformer-Clinic does. Default: off, because the amount of padding depends on "
        "the batching (max tokens, GPU count), not on the data, and pads never reach the loss",
    )


def check_profile_flags(args) -> None:
    """Reject ``--admin-profile-*`` values that cannot be honoured (message names the flag)."""
    k = getattr(args, "admin_profile_batches", None)
    profile = getattr(args, "admin_init", None) == "profile"
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"--admin-profile-batches must be a positive integer; got {k!r}")
    if not profile:
        given = [
            flag
            for flag, value in (
                ("--admin-profile-batches", k if k not in (None, 1) else None),
                ("--admin-profile-path", getattr(args, "admin_profile_path", None)),
                ("--admin-profile-include-padding",
                 getattr(args, "admin_profile_include_padding", None) or None),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply to --admin-init profile (got --admin-init "
                f"{getattr(args, 'admin_init', None)})"
            )


def _find(layer: nn.Module, name: str) -> Optional[nn.Module]:
    # checkpoint_wrapper keeps the module itself; FSDP wraps it (``.module``)
    while layer is not None:
        if hasattr(layer, name):
            return getattr(layer, name)
        layer = getattr(layer, "module", None)
    return None


def residual_stacks(model: nn.Module) -> Dict[str, List[nn.Module]]:
    """``{"encoder": [2N residual modules], "decoder": [3M (2M without cross-attention)]}``
    in execution order."""
    stacks = {}
    for stack, names in SUBLAYER_NAMES.items():
        mods = []
        for layer in getattr(model, stack).layers:
            for name in names:
                mod = _find(layer, name)
                if mod is not None:
                    mods.append(mod)
        stacks[stack] = mods
    return stacks


def layer_counts(model: nn.Module) -> Dict[str, int]:
    return {stack: len(getattr(model, stack).layers) for stack in SUBLAYER_NAMES}


def _batch(model: nn.Module, src_tokens, src_lengths, prev_output_tokens):
    """``(masks, run)`` for :func:`profiling.measure_omegas`: masks are ``(T, B)`` (fairseq's
    time-major activations), True at real tokens; run() is encoder + decoder features."""
    masks = {
        "encoder": src_tokens.ne(model.encoder.padding_idx).t(),
        "decoder": prev_output_tokens.ne(model.decoder.padding_idx).t(),
    }

    def run():
        enc = model.encoder(src_tokens, src_lengths=src_lengths)
        model.decoder(prev_output_tokens, encoder_out=enc, features_only=True,
                      src_lengths=src_lengths)

    return masks, run


def measure(model: nn.Module, net_inputs, include_padding: bool = False, group=None):
    """Profile ``model`` (an ``admin_transformer``) on ``net_inputs`` (dicts with
    ``src_tokens``, ``src_lengths``, ``prev_output_tokens``); returns ``(omegas, moments)``
    per stack, summed over ``group``'s ranks when distributed. The model is not changed."""
    batches = (
        _batch(model, n["src_tokens"], n["src_lengths"], n["prev_output_tokens"]) for n in net_inputs
    )
    return profiling.measure_omegas(
        model, residual_stacks(model), batches, include_padding=include_padding, group=group
    )


def apply(model: nn.Module, omegas: Dict[str, List[float]], source: str = "<measured>") -> None:
    """Write ``omegas`` into the residual modules (after checking the counts)."""
    stacks = residual_stacks(model)
    profiling.check_profile_counts(
        source, omegas, {k: len(v) for k, v in stacks.items()}, layer_counts(model)
    )
    for stack, mods in stacks.items():
        profiling.set_omegas(mods, omegas[stack])
    if hasattr(model, "admin_profiled"):
        model.admin_profiled.fill_(1)


class ProfileController:
    """Holds what the model needs to profile on its first training forward (the options,
    a weak reference to the task and the training iterator settings). Not a module: it
    adds nothing to the state dict."""

    def __init__(self, args, task):
        self.batches = getattr(args, "admin_profile_batches", None) or 1
        self.path = getattr(args, "admin_profile_path", None)
        self.include_padding = bool(getattr(args, "admin_profile_include_padding", None))
        self._task = weakref.ref(task) if task is not None else None
        # what fairseq's trainer uses for the training iterator of epoch 1
        self.itr_args = {
            k: getattr(args, k, d)
            for k, d in (
                ("train_subset", "train"), ("max_tokens", None), ("batch_size", None),
                ("seed", 1), ("required_batch_size_multiple", 8),
                ("update_ordered_indices_seed", False), ("skip_remainder_batch", False),
                ("grouped_shuffling", False), ("fix_batches_to_gpus", False), ("curriculum", 0),
            )
        }
        self.precision = {
            k: bool(getattr(args, k, False))
            for k in ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16", "amp",
                      "store_ema")
        }
        self.omega_form = getattr(args, "admin_omega", "buffer")
        self.settings = {
            "arch": getattr(args, "arch", None),
            "encoder_layers": getattr(args, "encoder_layers", None),
            "decoder_layers": getattr(args, "decoder_layers", None),
            "encoder_embed_dim": getattr(args, "encoder_embed_dim", None),
            "decoder_embed_dim": getattr(args, "decoder_embed_dim", None),
            "admin_omega": self.omega_form,
            "encoder_pos_emb": getattr(args, "encoder_pos_emb", None),
            "decoder_pos_emb": getattr(args, "decoder_pos_emb", None),
            "data": getattr(args, "data", None),
        }
        self.checked = False

    def __getstate__(self):  # weak references do not pickle
        state = dict(self.__dict__)
        state["_task"] = None
        return state

    # -- the trigger ----------------------------------------------------------------------
    def on_training_forward(self, model, src_tokens, src_lengths, prev_output_tokens) -> None:
        """Once per process, on the first training forward: profile unless already done."""
        if self.checked:
            return
        # marked done only on success: if fairseq recovers from an OOM raised here, the next
        # training forward profiles again instead of training on with omega = 1
        self._profile_once(model, src_tokens, src_lengths, prev_output_tokens)
        self.checked = True

    def _profile_once(self, model, src_tokens, src_lengths, prev_output_tokens) -> None:
        self._check_precision()
        group = distributed_utils.get_data_parallel_group() if profiling._dist_ready() else None
        done, world = profiling.count_ranks(bool(model.admin_profiled.item()), group)
        if done == world:
            return  # resumed from a profiled checkpoint
        if done:
            raise RuntimeError(
                f"--admin-init profile: {done} of {world} ranks loaded a profiled model and the "
                "others did not; all ranks must start from the same checkpoint"
            )
        stacks = residual_stacks(model)
        if self.path:
            present, world = profiling.count_ranks(os.path.exists(self.path), group)
            if 0 < present < world:
                raise RuntimeError(
                    f"--admin-profile-path {self.path}: the file exists on {present} of {world} "
                    "ranks; put it where every rank sees it (or on none, to measure it)"
                )
            if present:
                omegas, settings, kind = profiling.load_profile(self.path)
                apply(model, omegas, self.path)
                self._check_agreement(stacks, group)
                logger.info(
                    "admin profile: read %s omegas from %s%s", kind, self.path,
                    f" (measured with {settings})" if settings else "",
                )
                self._log(stacks)
                return
        net_inputs = self._batches(model, src_tokens, src_lengths, prev_output_tokens, group)
        omegas, moments = measure(model, net_inputs, self.include_padding, group)
        apply(model, omegas)
        self._check_agreement(stacks, group)
        tokens = {k: int(m[0, 0, 0].item()) for k, m in moments.items()}
        logger.info(
            "admin profile: measured on %d batch(es) x %d rank(s), %s counted elements "
            "(padding %s)", len(net_inputs), world, tokens,
            "included" if self.include_padding else "excluded",
        )
        self._log(stacks)
        if self.path and distributed_utils.get_global_rank() == 0:
            settings = dict(self.settings)
            settings.update(
                profile_batches=len(net_inputs), world_size=world,
                include_padding=self.include_padding,
                sublayers={k: len(v) for k, v in stacks.items()}, **self.itr_args,
            )
            profiling.save_profile(self.path, omegas, settings, moments)
            logger.info("admin profile: wrote %s", self.path)

    # -- helpers --------------------------------------------------------------------------
    def _check_precision(self) -> None:
        p = self.precision
        if p["store_ema"]:
            raise ValueError(
                "--admin-init profile cannot be combined with --store-ema: fairseq copies the "
                "model for the EMA before the first batch, i.e. before the omegas are profiled"
            )
        fp16_master_copy = (p["fp16"] or p["bf16"]) and not (
            p["memory_efficient_fp16"] or p["memory_efficient_bf16"] or p["amp"]
        )
        if fp16_master_copy and self.omega_form == "parameter":
            raise ValueError(
                "--admin-init profile with --admin-omega parameter and --fp16/--bf16: fairseq's "
                "FP16Optimizer copies the parameters into fp32 master weights before the first "
                "batch, so the profiled omegas would be overwritten after the first update. "
                "Use --memory-efficient-fp16/--memory-efficient-bf16 or --amp, or "
                "--admin-omega buffer"
            )

    def _batches(self, model, src_tokens, src_lengths, prev_output_tokens, group) -> List[dict]:
        current = {"src_tokens": src_tokens, "src_lengths": src_lengths,
                   "prev_output_tokens": prev_output_tokens}
        if self.batches == 1:
            return [current]
        task = self._task() if self._task is not None else None
        if task is None:
            raise RuntimeError(
                "--admin-profile-batches > 1 needs the task the model was built with "
                "(it draws the first batches of the training set)"
            )
        a = self.itr_args
        itr = task.get_batch_iterator(
            dataset=task.dataset(a["train_subset"]),
            max_tokens=a["max_tokens"],
            max_sentences=a["batch_size"],
            max_positions=utils.resolve_max_positions(
                task.max_positions(), model.max_positions(), a["max_tokens"]
            ),
            ignore_invalid_inputs=True,
            required_batch_size_multiple=a["required_batch_size_multiple"],
            seed=a["seed"] + 1 if a["update_ordered_indices_seed"] else a["seed"],
            num_shards=distributed_utils.get_data_parallel_world_size() if group is not None else 1,
            shard_id=distributed_utils.get_data_parallel_rank() if group is not None else 0,
            num_workers=0,
            epoch=1,
            # a fresh iterator: the task's cached one is the one training is consuming
            disable_iterator_cache=True,
            skip_remainder_batch=a["skip_remainder_batch"],
            grouped_shuffling=a["grouped_shuffling"],
        )
        device = src_tokens.device
        out = []
        for sample in itr.next_epoch_itr(
            shuffle=1 > (a["curriculum"] or 0), fix_batches_to_gpus=a["fix_batches_to_gpus"],
            set_dataset_epoch=False,
        ):
            if not sample:  # the empty filler of an uneven shard
                continue
            n = sample["net_input"]
            out.append({k: n[k].to(device) for k in ("src_tokens", "src_lengths", "prev_output_tokens")})
            if len(out) == self.batches:
                break
        if not out:
            return [current]
        first = out[0]["src_tokens"]
        if first.shape != src_tokens.shape or not torch.equal(first, src_tokens):
            logger.warning(
                "admin profile: the first training batch is not the first batch of epoch 1 "
                "(resumed or non-default data order); profiling the first %d batches of epoch 1",
                len(out),
            )
        if len(out) < self.batches:
            logger.warning("admin profile: only %d of %d batches available", len(out), self.batches)
        return out

    def _check_agreement(self, stacks, group) -> None:
        values = [v for mods in stacks.values() for v in profiling.get_omegas(mods)]
        if not profiling.all_ranks_agree(values, group):
            raise RuntimeError("admin profile: the omegas differ between ranks")

    @staticmethod
    def _log(stacks) -> None:
        for stack, mods in stacks.items():
            logger.info(
                "admin profile: %s omegas %s", stack,
                " ".join(f"{v:.4f}" for v in profiling.get_omegas(mods)),
            )


def configure(model: nn.Module, args, task) -> None:
    """Called by ``build_model`` for ``--admin-init profile``: registers the persistent
    ``admin_profiled`` flag (0 until profiled) and the controller."""
    model.register_buffer("admin_profiled", torch.zeros(1, dtype=torch.long), persistent=True)
    model.admin_profile = ProfileController(args, task)
