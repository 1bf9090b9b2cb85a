"""fairseq glue: the multi-tensor Adam step and gradient clipping under fairseq's ``Trainer``.

:func:`install` wraps ``Trainer._build_optimizer`` once. When the trainer's model is an
``AdminTransformerModel`` (any ``--admin-residual``), the optimizer fairseq just built is
adjusted in place, before it holds any state:

* ``--optimizer adam`` without apex (fairseq's own ``fairseq.optim.adam.Adam``): the torch
  optimizer inside ``FairseqAdam`` is replaced by :class:`ForeachAdam`, a subclass whose
  ``step`` is :func:`fairseq_admin_pos.speed.foreach.adam_step_` for float32 parameters
  with float32 dense gradients (fairseq's fp32 training, the float32 master copies of
  ``--fp16``/``--bf16``) and fairseq's own loop otherwise (``--memory-efficient-fp16``'s
  half parameters, amsgrad). Same state keys, so checkpoints move freely between the two;
  the ``FairseqAdam`` wrapper, its flags and its name in the checkpoint stay fairseq's.
  (``--optimizer radam`` is ``torch.optim.RAdam``, which takes its multi-tensor path by
  itself on a GPU.)
* ``FairseqOptimizer.clip_grad_norm`` (fp32 training, and the float32 master optimizer of
  ``--fp16``/``--bf16``) becomes one multi-tensor norm over the gradients plus fairseq's
  total and clip coefficient; in fp32 training the per-parameter norms are kept on the
  optimizer (:func:`take_grad_norms`) for the training monitor, which would otherwise
  compute every gradient's norm a second time for its per-stack norms;
* ``FP16Optimizer``'s copies between the half-precision model and its float32 master copy
  are multi-tensor copies (:mod:`.fp16`).

A stock ``transformer`` trained in the same process (``speed_vs_stock.py``) keeps fairseq's
code untouched. Nothing here reads a device value on the host.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairseq.optim import FairseqOptimizer
from fairseq.optim.adam import Adam as FairseqTorchAdam
from fairseq.optim.adam import FairseqAdam
from fairseq.trainer import Trainer

from fairseq_admin_pos.speed import foreach, fp16

_NORMS = "_admin_grad_norms"


class ForeachAdam(FairseqTorchAdam):
    """fairseq's ``Adam`` whose step runs as multi-tensor ops (same arithmetic, same state).

    Parameters are bucketed by (parameter group, step count); each bucket is one
    :func:`~fairseq_admin_pos.speed.foreach.adam_step_`. Falls back to fairseq's per-parameter
    loop for the whole step when any parameter or gradient is not a dense float32 tensor or
    a group uses amsgrad, so every case fairseq handles is still handled, by fairseq.
    """

    @torch.no_grad()
    def step(self, closure=None):
        buckets = self._buckets()
        if buckets is None:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, step, params, grads, exp_avgs, exp_avg_sqs in buckets:
            beta1, beta2 = group["betas"]
            foreach.adam_step_(params, grads, exp_avgs, exp_avg_sqs, step=step,
                               lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                               weight_decay=group["weight_decay"])
        return loss

    def _buckets(self) -> Optional[List[tuple]]:
        """``[(group, step, params, grads, exp_avgs, exp_avg_sqs)]`` with the step counts
        already advanced, or ``None`` (nothing touched) when fairseq's loop must run. Written
        as list operations over a group's parameters: the per-parameter Python work is what
        the multi-tensor step saves."""
        f32 = torch.float32
        plans = []
        for group in self.param_groups:
            if group.get("amsgrad", False):
                return None
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if not all(p.dtype == f32 and g.dtype == f32 and not g.is_sparse
                       and g.device == p.device for p, g in zip(params, grads)):
                return None
            plans.append((group, params, grads))
        buckets = []
        for group, params, grads in plans:
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            for state in states:
                state["step"] += 1
            # states loaded from a checkpoint are cast to their parameter's dtype and device
            # by torch's load_state_dict, as fairseq's .to(p_data_fp32) would
            by_step: Dict[int, List[int]] = defaultdict(list)
            for i, state in enumerate(states):
                by_step[state["step"]].append(i)
            for step, index in by_step.items():
                if len(index) == len(states):  # the usual case: one step count
                    pick = states
                    bucket_params, bucket_grads = params, grads
                else:
                    pick = [states[i] for i in index]
                    bucket_params = [params[i] for i in index]
                    bucket_grads = [grads[i] for i in index]
                buckets.append((group, step, bucket_params, bucket_grads,
                                [st["exp_avg"] for st in pick], [st["exp_avg_sq"] for st in pick]))
        return buckets


def _fast_clip_grad_norm(self: FairseqOptimizer, max_norm, aggregate_norm_fn=None, *,
                         keep_norms: bool = True):
    """``FairseqOptimizer.clip_grad_norm`` (``utils.clip_grad_norm_`` on ``self.params``) with
    one multi-tensor norm; the per-parameter norms are kept for :func:`take_grad_norms`
    when ``keep_norms`` (the trainer's own optimizer, which the monitor reads)."""
    params = [p for p in self.params if getattr(p, "grad", None) is not None]
    regular = [p for p in params if not hasattr(p, "expert")]
    # the gradients themselves (fairseq detaches each one: an operation per parameter);
    # fairseq-train never builds a graph through them, and the ops below run under no_grad
    grads = [p.grad for p in regular]
    experts = [p.grad for p in params if hasattr(p, "expert")]
    if not grads:
        if keep_norms:
            setattr(self, _NORMS, ([], []))
        all_params = list(self.params)
        return all_params[0].new_tensor(0.0) if all_params else torch.tensor(0.0)
    with torch.no_grad():
        norms, total = foreach.norms_and_total(grads)
    if aggregate_norm_fn is not None:
        total = aggregate_norm_fn(total)
    foreach.clip_grads_(grads + experts, total, max_norm)
    if keep_norms:
        setattr(self, _NORMS, (regular, norms))
    return total


def has_fast_clipping(optimizer) -> bool:
    """Whether ``optimizer`` (a trainer's) clips with :func:`_fast_clip_grad_norm`."""
    return _plain_optimizer(optimizer) is not None


def take_grad_norms(optimizer) -> Optional[Dict[int, Tensor]]:
    """The per-parameter gradient norms (before clipping) of the last ``clip_grad_norm`` of a
    fast-path optimizer, ``{id(param): 0-dim float32 norm}``, removed from the optimizer;
    ``None`` when the optimizer has no fast clipping (the FP16 optimizers) or did not clip."""
    inner = _plain_optimizer(optimizer)
    if inner is None:
        return None
    taken = inner.__dict__.pop(_NORMS, None)
    if taken is None:
        return None
    params, norms = taken
    return {id(p): n for p, n in zip(params, norms)}


def _plain_optimizer(optimizer) -> Optional[FairseqOptimizer]:
    # the fp32 path: the trainer's optimizer is the FairseqOptimizer itself, clipping fast
    clip = optimizer.__dict__.get("clip_grad_norm") if isinstance(optimizer, FairseqOptimizer) \
        else None
    if isinstance(clip, functools.partial) and clip.keywords.get("keep_norms"):
        return optimizer
    return None


def _fairseq_optimizers(optimizer) -> List[FairseqOptimizer]:
    """The FairseqOptimizer(s) inside what ``Trainer._build_optimizer`` built: itself, or the
    float32 optimizer of ``FP16Optimizer``, or the one ``MemoryEfficientFP16Optimizer``/
    ``AMPOptimizer`` wrap."""
    found = []
    for attr in (None, "fp32_optimizer", "wrapped_optimizer"):
        candidate = optimizer if attr is None else getattr(optimizer, attr, None)
        if isinstance(candidate, FairseqOptimizer) and candidate not in found:
            found.append(candidate)
    return found


#: the model classes whose trainers are accelerated, given by :func:`install` (the models sit
#: above this module and are handed to it, not imported)
_MODEL_TYPES: Tuple[type, ...] = ()


def accelerate(trainer: Trainer) -> None:
    """Swap in the multi-tensor Adam, clipping and FP16 copies for this trainer's optimizer
    (module docstring); only for trainers of the model classes :func:`install` was given
    (``AdminTransformerModel``), only before any state exists."""
    if not _MODEL_TYPES or not isinstance(trainer.get_model(), _MODEL_TYPES):
        return
    outer = trainer._optimizer
    for opt in _fairseq_optimizers(outer):
        inner = getattr(opt, "_optimizer", None)
        if isinstance(opt, FairseqAdam) and type(inner) is FairseqTorchAdam and not inner.state:
            opt._optimizer = ForeachAdam(inner.param_groups, **opt.optimizer_config)
        if type(opt).clip_grad_norm is FairseqOptimizer.clip_grad_norm:
            # the trainer's own optimizer keeps its norms for the monitor; the float32
            # optimizer inside FP16Optimizer clips its master copy, which nobody reads
            opt.clip_grad_norm = functools.partial(_fast_clip_grad_norm, opt,
                                                   keep_norms=opt is outer)
    fp16.accelerate(outer)


def _wrap_build_optimizer(build_optimizer):
    @functools.wraps(build_optimizer)
    def wrapper(self):
        build_optimizer(self)
        accelerate(self)

    wrapper.__admin_speed__ = True
    return wrapper


def install(model_types: Sequence[type] = ()) -> None:
    """Wrap ``Trainer._build_optimizer`` once (idempotent) and accelerate the trainers of
    ``model_types`` (added to those of earlier calls)."""
    global _MODEL_TYPES
    _MODEL_TYPES = tuple(dict.fromkeys(_MODEL_TYPES + tuple(model_types)))
    if not getattr(Trainer._build_optimizer, "__admin_speed__", False):
        Trainer._build_optimizer = _wrap_build_optimizer(Trainer._build_optimizer)
