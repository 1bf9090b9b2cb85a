"""Training you can watch: per-stack shortcut weights and gradient norms in fairseq's logs.

Deep models fail slowly: an omega that drifts, a decoder whose gradient norm climbs while
the total looks fine. For every ``admin_transformer`` trained by ``fairseq-train`` this
module logs, through fairseq's ``metrics`` (so they appear in the ``train_inner`` lines,
the epoch summary, ``--log-format json`` and ``--tensorboard-logdir``):

=========================================  ==============================================
``enc_gnorm``, ``dec_gnorm``               gradient norm of the encoder / decoder
                                           parameters, token embeddings excluded
``emb_gnorm``                              gradient norm of the token embeddings and the
                                           output projection (a shared matrix counts once)
``enc_omega_mean``, ``_min``, ``_max``     trainable Admin omegas (``--admin-omega
(``dec_omega_*``)                          parameter``): over every element of every
                                           omega vector of the stack
``enc_rezero_mean``, ``_min``, ``_max``    ReZero's branch scalars ``a``
(``dec_rezero_*``)                         (``--admin-residual rezero``/``rezero-post-ln``)
``enc_dyt_alpha_mean``, ``_min``, ``_max``  DyT's ``alpha`` (``--admin-norm dyt``): over
(``dec_dyt_alpha_*``)                      every DyT of the stack, its final one included
``enc_pos_scale``, ``dec_pos_scale``       the scaled sinusoid's scale
                                           (``--*-pos-emb scaled-sinusoidal``)
``enc_dual_norm``, ``dec_dual_norm``       ResiDual's dual stream (``--admin-residual
                                           resi-dual``): mean over real tokens of
                                           ``||d_N||_2``, the sum of every branch output
                                           of the stack before its LayerNorm, in the last
                                           training batch of each update
``enc_tok_cos``                            encoder token cosine: the mean cosine between
                                           the encoder outputs of two different real
                                           source tokens of the last training batch of
                                           each update (:mod:`fairseq_admin_pos.collapse`);
                                           near 1 = a collapsed encoder, whose decoder
                                           cannot use the source
=========================================  ==============================================

Only what exists and trains is logged: fixed omegas (``--admin-omega buffer``, profiled
or closed form) and DeepNorm's alpha never change (``fairseq-admin-analyze --checkpoint``
prints them). B2T adds no weight and no stream (its extra term is the layer input), so it
adds nothing here; neither do Peri-LN and Mix-LN (LayerNorms in other places). DyT's
``alpha`` tracks ``1 / std`` of its input in the paper (Zhu et al. 2025, Fig. 8), so its
spread over a stack shows how the activation scale changes with depth and training. The
dual stream is what ResiDual adds to watch: it grows with depth and
training (the paper's fp16 remark, Appendix G.3), and here it is carried in float32. The
encoder token cosine is logged for every scheme: an encoder that gives every source token
the same output (cosine near 1) leaves the decoder nothing to read. A high value early is no
verdict: runs that train pass through high values while they first learn the target language.
So the monitor logs one warning per run, at fairseq's log line, for the first logging
interval wholly after the learning rate's warmup whose mean is above 0.9
(:func:`warn_on_collapse`, the rule in
:func:`fairseq_admin_pos.collapse.collapse_warning`; a schedule without ``warmup_updates``
gets no warning). It never stops the run. What the rule was set on and how it has done on
the depth study's runs: docs/training.md#the-encoder-collapse-warning. Its cost is 19 small
operations on the encoder output per training forward (``fairseq_admin_pos/collapse.py``)
and, for the warning, one read of the interval's mean at each log line, which fairseq reads
anyway to print it.

The gradient norms are averaged over the updates of the interval (or epoch) like fairseq's
``gnorm``; so are the dual-stream norms (each update's value is the stack's
``last_dual_norm``, a 0-dim tensor the ResiDual stack computes in its training forward,
``models/b2t_resi_dual.py``) and the encoder token cosine (the encoder's
``last_token_cos``, ``models/layers.py``). ``enc_gnorm² + dec_gnorm² + emb_gnorm² = gnorm²`` (a criterion's own parameters
count in ``gnorm`` only). Embeddings are a group of
their own because with ``--share-all-embeddings`` one matrix serves the encoder input, the
decoder input and the output projection; counting it in a stack would make that stack's
norm mostly the output projection's. The shortcut statistics are the values after the last
update of the interval (or epoch), logged with ``weight=0`` like ``lr``, so the last
``train_inner`` line before a checkpoint shows that checkpoint's weights. They are the values
the model computes with (under ``--fp16`` the half-precision copy, not fairseq's float32
master copy).

How, without a host-device synchronisation per step (everything stays a tensor until
fairseq prints the line): :func:`install` wraps two ``fairseq.trainer.Trainer`` methods,
and only acts when the trainer's model is an ``AdminTransformerModel`` (not under FSDP,
which flattens the parameters):

* ``clip_grad_norm``: before fairseq's own, the raw norms ``||g||`` of each group and of
  all parameters are computed from the gradients as they are then (under ``--fp16``/
  ``--amp`` they may still carry the loss scale and fairseq's deferred ``1 / sample_size``;
  in a data-parallel run they are already summed over ranks). fairseq returns the true
  total norm ``gnorm``; every gradient carries the same factor, so ``gnorm * raw_group /
  raw_total`` is the group's true norm exactly;
* ``set_num_updates``: the trainer's runs after the optimizer step, and only when the update
  was taken (not on an fp16/amp overflow); the group norms, the shortcut statistics and
  the dual-stream norms are logged there. (The *model's* ``set_num_updates`` runs before each forward, one update
  behind, and never sees the last update.)
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from fairseq.logging import metrics
from fairseq.trainer import Trainer

from fairseq_admin_pos.collapse import collapse_warning
from fairseq_admin_pos.models.admin_profile import residual_stacks
from fairseq_admin_pos.models.admin_transformer import AdminTransformerModel
from fairseq_admin_pos.models.positions import ScaledSinusoidalPositions
from fairseq_admin_pos.norms import DynamicTanh
from fairseq_admin_pos.schemes import ReZeroResidual
from fairseq_admin_pos.speed import trainer as speed_trainer

logger = logging.getLogger(__name__)

STACK_PREFIX = {"encoder": "enc", "decoder": "dec"}
#: second component of a parameter name that puts it in the ``emb`` group
EMBEDDING_MODULES = ("embed_tokens", "output_projection")
GRAD_GROUPS = ("enc", "dec", "emb")

# fairseq prints a line's values in priority order: the group norms right after its gnorm
# (400), the shortcut statistics after clip (500)
_GNORM_PRIORITY = 401
_SHORTCUT_PRIORITY = 600
_GNORM_ROUND = 3  # as fairseq's gnorm
_SHORTCUT_ROUND = 4
_POS_SCALE_ROUND = 5  # starts at 1/sqrt(d): 0.0442 for d = 512
_DUAL_PRIORITY = 700
_DUAL_ROUND = 3
_TOKEN_COS_PRIORITY = 710
_TOKEN_COS_ROUND = 4


def gradient_group(name: str) -> Optional[str]:
    """``enc``/``dec``/``emb`` for a parameter name of the model, ``None`` outside both stacks.

    ``encoder.embed_tokens.*``, ``decoder.embed_tokens.*`` and ``decoder.output_projection.*``
    are ``emb``; every other ``encoder.*``/``decoder.*`` parameter (layers, positions,
    LayerNorms) belongs to its stack.
    """
    parts = name.split(".")
    if parts[0] not in STACK_PREFIX:
        return None
    if len(parts) > 1 and parts[1] in EMBEDDING_MODULES:
        return "emb"
    return STACK_PREFIX[parts[0]]


def _trainable(module: nn.Module, attr: str) -> Optional[torch.Tensor]:
    value = getattr(module, attr, None)
    if isinstance(value, nn.Parameter) and value.requires_grad:
        return value
    return None


# model -> (gradient groups, shortcut weights): walking the module tree costs tens of ms per
# call for a 100L-100L model, so it is done once per model (fairseq never replaces a model's
# parameters while training; FSDP, which does flatten them, is not monitored)
_PLANS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _plan(model: nn.Module) -> dict:
    plan = _PLANS.get(model)
    if plan is None:
        groups: Dict[str, List[nn.Parameter]] = {g: [] for g in GRAD_GROUPS}
        rest: List[nn.Parameter] = []
        for name, p in model.named_parameters():
            if hasattr(p, "expert"):  # fairseq's gnorm leaves MoE expert params out
                continue
            group = gradient_group(name)
            (groups[group] if group is not None else rest).append(p)
        plan = _PLANS[model] = {"groups": groups, "rest": rest,
                                "shortcuts": shortcut_values(model)}
    return plan


def shortcut_values(model: nn.Module) -> Dict[str, List[torch.Tensor]]:
    """The trainable shortcut-side weights per metric stem: ``{"enc_omega": [omega vectors],
    "dec_rezero": [a scalars], "enc_dyt_alpha": [DyT alphas], "enc_pos_scale": [scale],
    ...}``; absent when there are none."""
    out: Dict[str, List[torch.Tensor]] = {}
    for stack, modules in residual_stacks(model).items():
        prefix = STACK_PREFIX[stack]
        for m in modules:
            if isinstance(m, ReZeroResidual):
                p, stem = _trainable(m, "alpha"), f"{prefix}_rezero"
            else:
                p, stem = _trainable(m, "omega"), f"{prefix}_omega"
            if p is not None:
                out.setdefault(stem, []).append(p)
    for stack, prefix in STACK_PREFIX.items():
        alphas = [m.alpha for m in getattr(model, stack).modules()
                  if isinstance(m, DynamicTanh) and m.alpha.requires_grad]
        if alphas:
            out[f"{prefix}_dyt_alpha"] = alphas
        positions = getattr(getattr(model, stack), "embed_positions", None)
        if isinstance(positions, ScaledSinusoidalPositions):
            scale = _trainable(positions.embed, "scaling")
            if scale is not None:
                out[f"{prefix}_pos_scale"] = [scale]
    return out


@torch.no_grad()
def shortcut_stats(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``{"enc_omega_mean": t, "enc_omega_min": t, "enc_omega_max": t, ...,
    "enc_pos_scale": t}``: 0-dim float32 tensors on the model's device (no host sync)."""
    stats: Dict[str, torch.Tensor] = {}
    for stem, params in _plan(model)["shortcuts"].items():
        # under no_grad the parameters need no detach (an operation each)
        flat = torch.cat([p if p.dim() == 1 else p.reshape(-1) for p in params]).float()
        if stem.endswith("_pos_scale"):
            stats[stem] = flat[0]
            continue
        lo, hi = torch.aminmax(flat)
        stats[f"{stem}_mean"] = flat.mean()
        stats[f"{stem}_min"] = lo
        stats[f"{stem}_max"] = hi
    return stats


def _grads(params: Iterable[nn.Parameter]) -> List[torch.Tensor]:
    return [p.grad.detach() for p in params if p.grad is not None]


def _norm(grads: List[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    # float32 norms: raw fp16 gradients carry the loss scale, their norm overflows fp16
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


@torch.no_grad()
def raw_group_norms(model: nn.Module, extra_params: Iterable[nn.Parameter] = ()) -> Tuple[
        Dict[str, torch.Tensor], torch.Tensor]:
    """``({"enc": n, "dec": n, "emb": n}, total)``: L2 norms of the current ``.grad`` of each
    group (:func:`gradient_group`) and of every gradient (``extra_params``, e.g. the
    criterion's, count in the total only), float32 tensors, whatever scale the gradients
    currently carry."""
    plan = _plan(model)
    groups = {k: _grads(v) for k, v in plan["groups"].items()}
    rest = _grads(plan["rest"]) + _grads(p for p in extra_params if not hasattr(p, "expert"))
    device = next((g[0].device for g in (*groups.values(), rest) if g), torch.device("cpu"))
    norms = {k: _norm(v, device) for k, v in groups.items()}
    parts = [norms[k] for k in GRAD_GROUPS]
    if rest:
        parts.append(_norm(rest, device))
    return norms, torch.linalg.vector_norm(torch.stack(parts))


def scaled_group_norms(raw: Dict[str, torch.Tensor], raw_total: torch.Tensor,
                       true_total) -> Dict[str, torch.Tensor]:
    """Each group's true norm ``true_total * raw_group / raw_total`` (0 when every gradient is
    0); exact because all gradients carry the same scale factor."""
    total = torch.as_tensor(true_total, device=raw_total.device).float()
    denom = raw_total.clamp_min(torch.finfo(torch.float32).tiny)
    return {k: total * (v / denom) for k, v in raw.items()}


def log_group_norms(norms: Dict[str, torch.Tensor]) -> None:
    for i, group in enumerate(GRAD_GROUPS):
        metrics.log_scalar(f"{group}_gnorm", norms[group], priority=_GNORM_PRIORITY + i,
                           round=_GNORM_ROUND)


def log_shortcut_stats(model: nn.Module) -> None:
    for i, (name, value) in enumerate(shortcut_stats(model).items()):
        metrics.log_scalar(
            name, value, weight=0, priority=_SHORTCUT_PRIORITY + i,
            round=_POS_SCALE_ROUND if name.endswith("_pos_scale") else _SHORTCUT_ROUND,
        )


def dual_norms(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``{"enc_dual_norm": t, "dec_dual_norm": t}`` for a ResiDual model after a training
    forward (0-dim tensors on the model's device, as the stacks left them); ``{}`` for the
    other schemes."""
    out = {}
    for stack, prefix in STACK_PREFIX.items():
        value = getattr(getattr(model, stack), "last_dual_norm", None)
        if value is not None:
            out[f"{prefix}_dual_norm"] = value
    return out


def log_dual_norms(model: nn.Module) -> None:
    # averaged over the interval like gnorm: an activation statistic varies with the batch
    for i, (name, value) in enumerate(dual_norms(model).items()):
        metrics.log_scalar(name, value, priority=_DUAL_PRIORITY + i, round=_DUAL_ROUND)


def log_token_cosine(model: nn.Module) -> None:
    # averaged over the interval like the dual norms: it is a statistic of the batch
    value = getattr(model.encoder, "last_token_cos", None)
    if value is not None:
        metrics.log_scalar("enc_tok_cos", value, priority=_TOKEN_COS_PRIORITY,
                           round=_TOKEN_COS_ROUND)


_COLLAPSE_WARNED = "_admin_collapse_warned"


def warn_on_collapse(trainer, num_updates: int) -> None:
    """At fairseq's own logging step (``num_updates`` a multiple of ``--log-interval``), read
    the interval's ``enc_tok_cos`` meter, the value the ``train_inner`` line is about to print,
    and log :func:`fairseq_admin_pos.collapse.collapse_warning`'s line once per run (on the
    first data-parallel rank only, which logs for all)."""
    if num_updates % trainer.cfg.common.log_interval or getattr(trainer, _COLLAPSE_WARNED, False) \
            or not trainer.is_data_parallel_master:
        return
    meter = metrics.get_meter("train_inner", "enc_tok_cos")
    if meter is None or not meter.count:
        return
    # one host read per interval, of the value fairseq itself reads to print the line
    warmup = getattr(trainer.cfg.lr_scheduler, "warmup_updates", 0) or 0
    message = collapse_warning(float(meter.avg), num_updates - meter.count + 1, num_updates,
                               int(warmup))
    if message is not None:
        logger.warning(message)
        setattr(trainer, _COLLAPSE_WARNED, True)


def _monitored(trainer) -> Optional[nn.Module]:
    model = trainer.get_model()
    return model if isinstance(model, AdminTransformerModel) else None


_PENDING = "_admin_group_gnorms"


def norms_from_cache(model: nn.Module, cached: Dict[int, torch.Tensor],
                     extra_params: Iterable[nn.Parameter] = ()) -> Tuple[
        Dict[str, torch.Tensor], torch.Tensor]:
    """:func:`raw_group_norms` from per-parameter norms already computed (``{id(param):
    norm}``, the fast clipping's, :func:`fairseq_admin_pos.speed.trainer.take_grad_norms`):
    the same groups, no second pass over the gradients."""
    plan = _plan(model)
    device = next(iter(cached.values())).device if cached else torch.device("cpu")

    def combine(params) -> Optional[torch.Tensor]:
        parts = [cached[id(p)] for p in params if id(p) in cached]
        if not parts:
            return None
        return torch.linalg.vector_norm(torch.stack(parts))

    zero = torch.zeros((), dtype=torch.float32, device=device)
    norms = {k: combine(v) for k, v in plan["groups"].items()}
    norms = {k: zero if v is None else v for k, v in norms.items()}
    parts = [norms[k] for k in GRAD_GROUPS]
    rest = combine(list(plan["rest"]) + [p for p in extra_params if not hasattr(p, "expert")])
    if rest is not None:
        parts.append(rest)
    return norms, torch.linalg.vector_norm(torch.stack(parts))


def _wrap_clip_grad_norm(clip_grad_norm):
    @functools.wraps(clip_grad_norm)
    def wrapper(self, clip_norm):
        model = _monitored(self)
        if model is None:
            return clip_grad_norm(self, clip_norm)
        if speed_trainer.has_fast_clipping(self.optimizer):
            # the fast clipping computes every gradient's norm anyway: reuse them
            total = clip_grad_norm(self, clip_norm)
            cached = speed_trainer.take_grad_norms(self.optimizer)
            if cached is not None:
                raw, raw_total = norms_from_cache(model, cached,
                                                  self.get_criterion().parameters())
            else:  # clipping scales every gradient alike: the ratios below still hold
                raw, raw_total = raw_group_norms(model, self.get_criterion().parameters())
        else:
            raw, raw_total = raw_group_norms(model, self.get_criterion().parameters())
            total = clip_grad_norm(self, clip_norm)  # raises on an fp16 overflow: nothing logged
        # logged in set_num_updates, i.e. only if the update is taken
        setattr(self, _PENDING, scaled_group_norms(raw, raw_total, total))
        return total

    wrapper.__admin_monitoring__ = True
    return wrapper


def _wrap_set_num_updates(set_num_updates):
    @functools.wraps(set_num_updates)
    def wrapper(self, num_updates):
        set_num_updates(self, num_updates)
        model = _monitored(self)
        if model is None:
            return
        norms = self.__dict__.pop(_PENDING, None)
        if norms is not None:
            log_group_norms(norms)
        log_shortcut_stats(model)
        log_dual_norms(model)
        log_token_cosine(model)
        warn_on_collapse(self, num_updates)

    wrapper.__admin_monitoring__ = True
    return wrapper


def install() -> None:
    """Wrap ``Trainer.clip_grad_norm`` and ``Trainer.set_num_updates`` once (idempotent)."""
    if not getattr(Trainer.clip_grad_norm, "__admin_monitoring__", False):
        Trainer.clip_grad_norm = _wrap_clip_grad_norm(Trainer.clip_grad_norm)
    if not getattr(Trainer.set_num_updates, "__admin_monitoring__", False):
        Trainer.set_num_updates = _wrap_set_num_updates(Trainer.set_num_updates)


install()
