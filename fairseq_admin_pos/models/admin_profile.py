"""fairseq glue for ``--admin-init profile``: profile before the first update, in the same
``fairseq-train`` command, with every profile-file problem found when the model is built.

The statistics, the two modes (``clinic``: Transformer-Clinic's training-mode, in-pass
profiling; ``eval``: dropout-free, padding-excluded, additive over batches), the ratio
recurrence and the profile files are in :mod:`fairseq_admin_pos.profiling` (pure torch; its
docstring says exactly what is summed and argues the default). This module decides *when*,
*on what* and *what else must follow*:

* **Build time** (``build_model`` -> :func:`check_profile_flags`, :func:`configure`): flag
  combinations that cannot be honoured are refused (``--admin-profile-batches K > 1`` with
  the clinic mode, ``--store-ema``, a stack without layers), and when
  ``--admin-profile-path FILE`` exists it is read and validated at once: omega count per
  stack, NaN/infinite/zero/negative omegas, a Clinic ``profile.ratio.init`` outside the
  clinic mode, and the settings the file was measured with (width, depths, heads, positions,
  mode, padding, and in clinic mode the dropout rates; :data:`COMPARED_SETTINGS`) - each is
  an error before training starts.
* **The trigger** is fairseq's ``Trainer.train_step``, wrapped by
  :func:`install_trainer_hooks` (run by :func:`fairseq_admin_pos.register`): on the first
  call, for a model with ``--admin-init profile`` that is not yet profiled, the profile runs
  *before* the original ``train_step``, i.e. outside fairseq's ``try/except`` that writes
  ``checkpoints/crash.pt``, on the batch(es) the trainer is about to train on. In clinic mode
  the pass draws its dropout masks from ``seed + num_updates``, the seed fairseq sets for
  that step, inside ``torch.random.fork_rng``: the profiling masks are those of the first
  training forward (as in Clinic, whose profiling pass *was* that forward) and the RNG
  stream of training is unchanged by profiling (fairseq reseeds every step anyway). After
  the omegas are written, FP16Optimizer's float32 master copy of trainable omegas
  (``--admin-omega parameter`` with ``--fp16``/``--bf16``) is set to the exact profiled
  values (:func:`refresh_master_copy`); without that the first update would copy the
  master's omega = 1 back into the model.
* ``--admin-profile-batches K > 1`` (eval mode) takes the first K batches of epoch 1 from
  the ``EpochBatchIterator`` that ``Trainer.get_train_iterator`` returned (recorded by the
  same hooks): its frozen batches in the order its own ``ordered_batches`` gives them (the
  shuffle with ``seed + epoch``, this rank's shard), collated and moved to the device one
  batch at a time. The batch sampler is never rebuilt and the K batches are never all on
  the device.
* A model trained outside fairseq's Trainer profiles on its first training forward (the
  fallback in ``AdminTransformerModel.forward``), one batch, with the RNG state of that
  forward (forked, so the forward that follows draws the same masks it would have drawn).
* A resumed run loads ``admin_profiled = 1`` and the omegas from the checkpoint and never
  profiles again; ``fairseq-generate``/``-interactive``/hub loading run in eval mode and
  never profile.
* Data-parallel runs: every rank profiles its own batch(es); eval mode sums the sufficient
  statistics with one ``all_reduce`` at the end, clinic mode inside each sub-layer's hook;
  every rank gets the same omegas (checked: a mismatch is an error).
* ``--admin-profile-path FILE``: if FILE exists (on every rank) the omegas are read from it
  instead of measured; otherwise they are measured and rank 0 writes FILE atomically with
  the settings they came from, the mode among them.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional

import torch
import torch.nn as nn

from fairseq import utils
from fairseq.distributed import utils as distributed_utils

from fairseq_admin_pos import profiling
from fairseq_admin_pos.errors import AdminFlagError, ProfileFileError
from fairseq_admin_pos.profiling import PROFILE_MODES

logger = logging.getLogger(__name__)

#: residual-module attribute names of each stack's layers, in execution order
SUBLAYER_NAMES = {
    "encoder": ("self_attn_residual", "final_residual"),
    "decoder": ("self_attn_residual", "encoder_attn_residual", "final_residual"),
}

#: settings that define the model and the statistic: a profile file measured with other
#: values is refused (the omegas would belong to another model or another statistic)
COMPARED_SETTINGS = (
    "encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim",
    "encoder_ffn_embed_dim", "decoder_ffn_embed_dim", "encoder_attention_heads",
    "decoder_attention_heads", "no_cross_attention", "encoder_pos_emb", "decoder_pos_emb",
    "no_scale_embedding", "layernorm_embedding", "activation_fn", "admin_profile_mode",
    "admin_profile_include_padding",
)
#: compared too in clinic mode, where the statistic is the dropped-out branch output
CLINIC_COMPARED_SETTINGS = ("dropout", "attention_dropout", "activation_dropout")
#: recorded in the file, never compared: they choose the *sample* (initial weights, data,
#: batches), not the statistic, so a profile can be reused across seeds and batch sizes
RECORDED_SETTINGS = (
    "arch", "admin_omega", "data", "train_subset", "seed", "max_tokens", "batch_size",
    "required_batch_size_multiple",
)


def add_profile_args(parser) -> None:
    """The ``--admin-profile-*`` flags (used only with ``--admin-init profile``)."""
    parser.add_argument(
        "--admin-profile-mode", choices=PROFILE_MODES,
        help="--admin-init profile: clinic = Transformer-Clinic's training-mode profile of one "
        "batch; eval = an eval-mode pass, padding excluded (docs/initialisation.md). "
        "Default: clinic",
    )
    parser.add_argument(
        "--admin-profile-batches", type=int, metavar="K",
        help="--admin-profile-mode eval: the training batches per rank whose statistics set "
        "the omegas. Default: 1",
    )
    parser.add_argument(
        "--admin-profile-path", metavar="FILE",
        help="--admin-init profile: read the omegas from FILE if it exists, else measure and "
        "write it (docs/initialisation.md). Default: no file",
    )
    parser.add_argument(
        "--admin-profile-include-padding", action="store_true", default=None,
        help="--admin-profile-mode eval: count padded positions in the variances, as "
        "Transformer-Clinic does. Default: off (docs/initialisation.md)",
    )


def profile_mode(cfg) -> Optional[str]:
    """The profiling mode of an args namespace / config: ``None`` unless ``--admin-init
    profile``; the default (``clinic``) when not given; an invalid value names the flag."""
    if getattr(cfg, "admin_init", None) != "profile":
        return None
    mode = getattr(cfg, "admin_profile_mode", None)
    if mode is None:
        return PROFILE_MODES[0]
    if mode not in PROFILE_MODES:
        raise AdminFlagError(
            f"--admin-profile-mode {mode!r} is not valid; valid choices: {', '.join(PROFILE_MODES)}"
        )
    return mode


def check_profile_flags(args) -> None:
    """Reject ``--admin-profile-*`` values and combinations that cannot be honoured (the
    message names the flags), and fill in the default ``--admin-profile-mode`` so that the
    saved config records the mode used."""
    k = getattr(args, "admin_profile_batches", None)
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise AdminFlagError(f"--admin-profile-batches must be a positive integer; got {k!r}")
    mode = profile_mode(args)
    if mode is None:
        given = [
            flag
            for flag, value in (
                ("--admin-profile-mode", getattr(args, "admin_profile_mode", None)),
                ("--admin-profile-batches", k if k not in (None, 1) else None),
                ("--admin-profile-path", getattr(args, "admin_profile_path", None)),
                ("--admin-profile-include-padding",
                 getattr(args, "admin_profile_include_padding", None) or None),
            )
            if value is not None
        ]
        if given:
            raise AdminFlagError(
                f"{', '.join(given)} only apply to --admin-init profile (got --admin-init "
                f"{getattr(args, 'admin_init', None)})"
            )
        return
    args.admin_profile_mode = mode
    if mode == "clinic" and (k or 1) > 1:
        raise AdminFlagError(
            f"--admin-profile-batches {k} cannot be combined with --admin-profile-mode clinic: "
            "the clinic mode writes each omega into the model as the pass reaches it, so "
            "every later statistic depends on the earlier omegas of the same pass, and K "
            "batches would be K passes that each change the omegas. Use --admin-profile-mode "
            "eval for statistics summed over several batches (clinic mode sums over GPUs "
            "inside the pass), or --admin-profile-batches 1"
        )
    for side in ("encoder", "decoder"):
        n = getattr(args, f"{side}_layers", None)
        if n is not None and n < 1:
            raise AdminFlagError(
                f"--admin-init profile needs at least one layer per stack (one omega per "
                f"residual sub-layer); got --{side}-layers {n}"
            )
    if getattr(args, "store_ema", False):
        raise AdminFlagError(
            "--admin-init profile cannot be combined with --store-ema: fairseq copies the "
            "model for the EMA when the trainer is built, i.e. before the omegas are "
            "profiled on the first batch"
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


def measure(model: nn.Module, net_inputs: Iterable[Mapping],
            include_padding: Optional[bool] = None, group=None, mode: str = "eval"):
    """Profile ``model`` (an ``admin_transformer``) on ``net_inputs`` (dicts with
    ``src_tokens``, ``src_lengths``, ``prev_output_tokens``, consumed one at a time); returns
    ``(omegas, moments)`` per stack, summed over ``group``'s ranks when distributed. The
    model's omegas are not changed. ``include_padding``: the mode's own when None (eval:
    excluded; clinic: included). ``mode="clinic"`` takes one batch and the current RNG
    state (see :func:`profiling.measure_omegas`)."""
    batches = (
        _batch(model, n["src_tokens"], n["src_lengths"], n["prev_output_tokens"]) for n in net_inputs
    )
    return profiling.measure_omegas(
        model, residual_stacks(model), batches, include_padding=include_padding, group=group,
        mode=mode,
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


def _arg_names(args) -> List[str]:
    try:
        return list(vars(args))
    except TypeError:  # an omegaconf DictConfig (a model loaded from a checkpoint)
        return list(args.keys()) if hasattr(args, "keys") else []


def profile_settings(args) -> Dict[str, object]:
    """The settings a profile is measured with: :data:`COMPARED_SETTINGS` (plus any
    ``pos_emb_*`` option of the position modules, and the dropout rates), then
    :data:`RECORDED_SETTINGS`. ``admin_profile_include_padding`` is the effective value
    (always True in clinic mode)."""
    mode = profile_mode(args)
    settings: Dict[str, object] = {k: getattr(args, k, None) for k in COMPARED_SETTINGS}
    settings["admin_profile_mode"] = mode
    settings["admin_profile_include_padding"] = mode == "clinic" or bool(
        getattr(args, "admin_profile_include_padding", None)
    )
    for k in sorted(_arg_names(args)):
        if k.startswith("pos_emb_"):
            settings[k] = getattr(args, k)
    for k in CLINIC_COMPARED_SETTINGS + RECORDED_SETTINGS:
        settings[k] = getattr(args, k, None)
    for k, v in list(settings.items()):  # JSON-friendly (e.g. omegaconf containers)
        if not isinstance(v, (str, int, float, bool, type(None))):
            settings[k] = str(v)
    return settings


def compared_keys(settings: Mapping[str, object]) -> List[str]:
    keys = list(COMPARED_SETTINGS) + sorted(k for k in settings if k.startswith("pos_emb_"))
    if settings.get("admin_profile_mode") == "clinic":
        keys += list(CLINIC_COMPARED_SETTINGS)
    return keys


def read_profile(path: str, model: nn.Module, settings: Mapping[str, object]):
    """Read ``path`` and check it against ``model`` and its ``settings`` (from
    :func:`profile_settings`): omega values, count per stack, file kind against the mode,
    and the settings the file records. Returns ``(omegas, file settings, kind)``; any
    problem is a :class:`~fairseq_admin_pos.errors.ProfileFileError` whose one-line message
    starts with the flag and the file (``--admin-profile-path FILE: ...``), which fairseq's
    tools print as ``<prog>: error: ...`` with exit status 2."""
    try:
        return _read_profile(path, model, settings)
    except ProfileFileError as e:
        # the pure reader names the file; the flag that named it is known only here
        raise ProfileFileError(f"--admin-profile-path {e}") from None


def _read_profile(path: str, model: nn.Module, settings: Mapping[str, object]):
    omegas, file_settings, kind = profiling.load_profile(path)
    mode = settings.get("admin_profile_mode")
    if kind == "clinic" and mode != "clinic":
        raise ProfileFileError(
            f"{path}: a Transformer-Clinic profile.ratio.init holds Clinic's statistics "
            "(training-mode forward with dropout, padding included), which --admin-profile-"
            f"mode {mode} does not measure; use it with --admin-profile-mode clinic"
        )
    stacks = residual_stacks(model)
    profiling.check_profile_counts(
        path, omegas, {k: len(v) for k, v in stacks.items()}, layer_counts(model)
    )
    profiling.compare_settings(path, file_settings, settings, compared_keys(settings))
    return omegas, file_settings, kind


def _master_copies(optimizer) -> Iterator:
    """``(model parameter, its float32 master tensor)`` of fairseq's FP16Optimizer, flat or
    not, in the layout its ``_sync_fp32_params_to_fp16`` reads back; nothing for optimizers
    without a master copy (fp32, ``--memory-efficient-fp16``, ``--amp``)."""
    fp16 = getattr(optimizer, "fp16_params", None)
    fp32 = getattr(optimizer, "fp32_params", None)
    if fp16 is None or fp32 is None:
        return
    if getattr(optimizer, "has_flat_params", False):
        by_device: Dict[Optional[int], List[torch.Tensor]] = {}
        for p in fp16:
            by_device.setdefault(p.device.index, []).append(p)
        for device, flat in fp32.items():
            offset = 0
            for p in by_device.get(device, []):
                n = p.numel()
                yield p, flat.data[offset: offset + n].view(p.shape)
                offset += n
    else:
        for p, p32 in zip(fp16, fp32):
            yield p, p32.data


def refresh_master_copy(optimizer, model: nn.Module, omegas: Mapping[str, List[float]]) -> int:
    """Set the float32 master copy of every trainable omega to its exact profiled value
    (the model's fp16/bf16 parameter holds it rounded). Returns how many were set; raises
    if the optimizer has a master copy that does not hold a trainable omega."""
    wanted = {
        id(mod.omega): value
        for stack, mods in residual_stacks(model).items()
        for mod, value in zip(mods, omegas[stack])
        if isinstance(mod.omega, nn.Parameter) and mod.omega.requires_grad
    }
    if not wanted or getattr(optimizer, "fp32_params", None) is None:
        return 0
    done = 0
    with torch.no_grad():
        for p, master in _master_copies(optimizer):
            if id(p) in wanted:
                master.fill_(wanted[id(p)])
                done += 1
    if done != len(wanted):
        raise RuntimeError(
            f"admin profile: the optimizer's float32 master copy holds {done} of the "
            f"{len(wanted)} trainable omegas; the profiled values could not be copied into it"
        )
    return done


def _cuda_devices() -> List[int]:
    # only this rank's GPU: the pass runs there; forking every visible device's RNG would
    # touch (and initialise a context on) the other ranks' GPUs
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def _net_input(sample: Mapping, device: torch.device) -> Dict[str, torch.Tensor]:
    n = sample["net_input"]
    return {k: n[k].to(device) for k in ("src_tokens", "src_lengths", "prev_output_tokens")}


class ProfileController:
    """What the model needs to profile before its first update: the options, the settings
    the profile is measured with, and the profiling itself (:meth:`profile`). Not a module:
    it adds nothing to the state dict."""

    def __init__(self, args):
        self.batches = getattr(args, "admin_profile_batches", None) or 1
        self.path = getattr(args, "admin_profile_path", None)
        self.mode = profile_mode(args)
        self.settings = profile_settings(args)
        self.include_padding = bool(self.settings["admin_profile_include_padding"])
        self.checked = False

    # -- the triggers ---------------------------------------------------------------------
    def before_first_step(self, trainer, samples) -> None:
        """fairseq's Trainer, before its first ``train_step``: profile on the batch(es) it is
        about to train on, then refresh the optimizer's float32 master copy."""
        if self.checked:
            return
        model = trainer.get_model()
        first = samples[0] if samples else None
        if not first:
            raise RuntimeError(
                "--admin-init profile: the first training batch of this rank is empty "
                "(fewer batches than data-parallel ranks?); nothing to profile"
            )
        device = next(model.parameters()).device
        if self.batches > 1:
            net_inputs = self._epoch_batches(trainer, first, device)
        else:
            net_inputs = iter([_net_input(first, device)])
        self.profile(
            model, net_inputs,
            seed=trainer.cfg.common.seed + trainer.get_num_updates(),
            optimizer=lambda: trainer.optimizer,
        )

    def on_training_forward(self, model, src_tokens, src_lengths, prev_output_tokens) -> None:
        """Fallback outside fairseq's Trainer: the first training forward profiles its batch."""
        if self.checked:
            return
        if self.batches > 1:
            raise RuntimeError(
                f"--admin-profile-batches {self.batches}: the first K batches are taken from "
                "fairseq's Trainer before its first train_step; this model is trained "
                "outside it. Call model.admin_profile.profile(model, batches) with the "
                "first K batches' net_input dicts before training"
            )
        net = {"src_tokens": src_tokens, "src_lengths": src_lengths,
               "prev_output_tokens": prev_output_tokens}
        self.profile(model, iter([net]))

    # -- the profile ----------------------------------------------------------------------
    def profile(self, model: nn.Module, net_inputs: Iterable[Mapping], seed: Optional[int] = None,
                optimizer: Optional[Callable[[], object]] = None) -> None:
        """Read or measure the omegas, write them into ``model`` and set ``admin_profiled``
        (once; a model loaded profiled on every rank is left alone). ``net_inputs`` is
        consumed lazily. Clinic mode: the pass runs in ``torch.random.fork_rng``, seeded with
        ``seed`` when given (else from the current RNG state). ``optimizer()`` returns the
        optimizer whose float32 master copy must follow the profiled omegas."""
        group = distributed_utils.get_data_parallel_group() if profiling._dist_ready() else None
        done, world = profiling.count_ranks(bool(model.admin_profiled.item()), group)
        if done == world:  # resumed from a profiled checkpoint
            self.checked = True
            return
        if done:
            raise RuntimeError(
                f"--admin-init profile: {done} of {world} ranks loaded a profiled model and the "
                "others did not; all ranks must start from the same checkpoint"
            )
        stacks = residual_stacks(model)
        if self.path:
            present, world = profiling.count_ranks(os.path.exists(self.path), group)
            if 0 < present < world:
                raise ProfileFileError(
                    f"--admin-profile-path {self.path}: the file exists on {present} of {world} "
                    "ranks; put it where every rank sees it (or on none, to measure it)"
                )
            if present:
                omegas, settings, kind = read_profile(self.path, model, self.settings)
                apply(model, omegas, self.path)
                self._after(model, stacks, omegas, group, optimizer)
                logger.info("admin profile: read %s omegas from %s", kind, self.path)
                self._log(stacks)
                self.checked = True
                return
        counted = [0]

        def counting(items):
            for item in items:
                counted[0] += 1
                yield item

        with torch.random.fork_rng(devices=_cuda_devices(), enabled=self.mode == "clinic"):
            if seed is not None and self.mode == "clinic":
                utils.set_torch_seed(seed)
            omegas, moments = measure(model, counting(net_inputs), self.include_padding, group,
                                      mode=self.mode)
        apply(model, omegas)
        self._after(model, stacks, omegas, group, optimizer)
        tokens = {k: int(m[0, 0, 0].item()) for k, m in moments.items()}
        logger.info(
            "admin profile: measured in %s mode on %d batch(es) x %d rank(s), %s counted "
            "elements (padding %s)", self.mode, counted[0], world, tokens,
            "included" if self.include_padding else "excluded",
        )
        self._log(stacks)
        if self.path and distributed_utils.get_global_rank() == 0:
            settings = dict(self.settings)
            settings.update(profile_batches=counted[0], world_size=world,
                            sublayers={k: len(v) for k, v in stacks.items()})
            profiling.save_profile(self.path, omegas, settings, moments)
            logger.info("admin profile: wrote %s", self.path)
        self.checked = True

    # -- helpers --------------------------------------------------------------------------
    def _after(self, model, stacks, omegas, group, optimizer) -> None:
        values = [v for mods in stacks.values() for v in profiling.get_omegas(mods)]
        if not profiling.all_ranks_agree(values, group):
            raise RuntimeError("admin profile: the omegas differ between ranks")
        if optimizer is not None:
            n = refresh_master_copy(optimizer(), model, omegas)
            if n:
                logger.info("admin profile: float32 master copy of %d trainable omegas set "
                            "to the profiled values", n)

    def _epoch_batches(self, trainer, first: Mapping, device) -> Iterator[Dict[str, torch.Tensor]]:
        """The first K batches of epoch 1 of this rank, from the trainer's own epoch iterator
        (no new batch sampler), as a generator: one batch collated and on the device at a time."""
        itr = getattr(trainer, "_admin_profile_train_itr", None)
        if itr is None or not hasattr(itr, "ordered_batches"):
            raise RuntimeError(
                f"--admin-profile-batches {self.batches}: the first batches of epoch 1 come "
                "from the EpochBatchIterator returned by Trainer.get_train_iterator, and this "
                "trainer has not returned one; call trainer.get_train_iterator(epoch=1) before "
                "the first train_step"
            )
        sampler = getattr(itr, "epoch_batch_sampler", None)
        shuffle = sampler.shuffle if sampler is not None else itr.shuffle
        fix = sampler.fix_batches_to_gpus if sampler is not None else False
        order = [b for b in itr.ordered_batches(1, fix, shuffle) if len(b) > 0][: self.batches]
        if "id" in first and order and sorted(int(i) for i in order[0]) != sorted(first["id"].tolist()):
            logger.warning(
                "admin profile: the first training batch is not the first batch of epoch 1 "
                "(resumed or non-default data order); profiling the first %d batches of epoch 1",
                len(order),
            )
        if len(order) < self.batches:
            logger.warning("admin profile: only %d of %d batches available", len(order), self.batches)

        def generate():
            for indices in order:
                yield _net_input(itr.collate_fn([itr.dataset[i] for i in indices]), device)

        return generate()

    @staticmethod
    def _log(stacks) -> None:
        for stack, mods in stacks.items():
            logger.info(
                "admin profile: %s omegas %s", stack,
                " ".join(f"{v:.4f}" for v in profiling.get_omegas(mods)),
            )


# True while fairseq loads a trained checkpoint (fairseq-generate, -interactive, hub, fairseq-
# admin-analyze): its omegas come from the checkpoint, so the side file named by its recorded
# --admin-profile-path is neither needed nor checked (it may have been re-measured since)
_LOADING_CHECKPOINT = contextvars.ContextVar("admin_loading_checkpoint", default=False)


@contextlib.contextmanager
def loading_trained_checkpoint() -> Iterator[None]:
    """Models built inside take their omegas from a trained checkpoint: the profile file
    their settings name is not read (fairseq's checkpoint loading runs inside it)."""
    token = _LOADING_CHECKPOINT.set(True)
    try:
        yield
    finally:
        _LOADING_CHECKPOINT.reset(token)


def configure(model: nn.Module, args, task) -> None:
    """Called by ``build_model`` for ``--admin-init profile``: registers the persistent
    ``admin_profiled`` flag (0 until profiled) and the controller, and when
    ``--admin-profile-path`` exists validates it now (before any training). A model that
    fairseq builds to load a trained checkpoint into skips the file."""
    model.register_buffer("admin_profiled", torch.zeros(1, dtype=torch.long), persistent=True)
    controller = ProfileController(args)
    model.admin_profile = controller
    if (controller.path and os.path.exists(controller.path) and not _LOADING_CHECKPOINT.get()
            and not _resuming(args)):
        read_profile(controller.path, model, controller.settings)


def _resuming(args) -> bool:
    """fairseq-train will load a checkpoint into this model (fairseq's ``--restore-file``
    rule): its omegas are already profiled, and a file that is still needed (a checkpoint
    saved before profiling) is read and checked before the first step instead."""
    restore = getattr(args, "restore_file", None)
    if not restore:
        return False
    if restore == "checkpoint_last.pt":
        restore = os.path.join(getattr(args, "save_dir", None) or "checkpoints", restore)
    return os.path.isfile(restore)


_ORIGINAL = {}


def install_trainer_hooks() -> None:
    """Wrap ``fairseq.trainer.Trainer.train_step`` (profile before the first one, outside
    its crash handler), ``get_train_iterator`` (remember the epoch iterator, for
    ``--admin-profile-batches K > 1``) and ``checkpoint_utils.load_model_ensemble_and_task``
    (a model loaded from a trained checkpoint does not read the profile file). Idempotent;
    other models are unaffected."""
    from fairseq.trainer import Trainer

    if getattr(Trainer.train_step, "_admin_profile_hook", False):
        return
    _ORIGINAL["train_step"] = train_step = Trainer.train_step
    _ORIGINAL["get_train_iterator"] = get_train_iterator = Trainer.get_train_iterator

    @functools.wraps(train_step)
    def train_step_after_profile(self, samples, *args, **kwargs):
        controller = getattr(self.get_model(), "admin_profile", None)
        if isinstance(controller, ProfileController) and not controller.checked:
            controller.before_first_step(self, samples)
        return train_step(self, samples, *args, **kwargs)

    @functools.wraps(get_train_iterator)
    def get_train_iterator_recorded(self, *args, **kwargs):
        itr = get_train_iterator(self, *args, **kwargs)
        self._admin_profile_train_itr = itr
        return itr

    train_step_after_profile._admin_profile_hook = True
    Trainer.train_step = train_step_after_profile
    Trainer.get_train_iterator = get_train_iterator_recorded

    from fairseq import checkpoint_utils

    load = checkpoint_utils.load_model_ensemble_and_task

    @functools.wraps(load)
    def load_trained(*args, **kwargs):
        with loading_trained_checkpoint():
            return load(*args, **kwargs)

    checkpoint_utils.load_model_ensemble_and_task = load_trained
