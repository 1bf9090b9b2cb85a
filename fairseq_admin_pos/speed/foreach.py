r"""fairseq's Adam step and gradient clipping with multi-tensor ops (pure torch, no fairseq).

fairseq 0.12's ``Adam`` (``fairseq/optim/adam.py``, used by ``--optimizer adam`` whenever
apex's fused Adam is absent, i.e. on every CPU and on GPUs without apex) and its
``utils.clip_grad_norm_`` (without apex's ``amp_C``) loop over the parameters in Python:
about nine tensor operations per parameter per step for Adam and one norm per parameter for
clipping, i.e. 2,277 and 761 of the 5,568 top-level aten operations of a 6L-6L step
(``docs/speed.md``). Every operation costs host time on a CPU and a kernel launch on a GPU,
and a step at the widths people train is bound by exactly that host time.

The functions here perform the same arithmetic per element with ``torch._foreach_*`` ops,
which take lists of tensors: on CUDA one multi-tensor kernel per operation (a few launches
for all parameters), on the CPU the same per-tensor kernels called from one C++ loop. On
the CPU the results are therefore bit for bit fairseq's (``tests/test_speed.py``); on CUDA
the multi-tensor kernels compute the same formula, rounding may differ in the last bit
where the compiler contracts a multiply-add differently.

Adam (Kingma & Ba 2015, Algorithm 1, in fairseq's "AdamW" form: decoupled weight decay,
Loshchilov & Hutter 2019), for parameters ``p`` with gradients ``g`` at step ``t``::

    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g * g
    p <- p - lr * wd * p                                         (if wd != 0)
    p <- p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)

written in fairseq's order of operations (``eps`` added to ``sqrt(v)`` before the bias
correction, which is folded into the step size; torch.optim.Adam instead adds ``eps`` after
dividing by ``sqrt(1 - beta2^t)``, a different update, so it is not used here).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["adam_step_", "grad_norms", "total_norm", "clip_grads_"]


@torch.no_grad()
def adam_step_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
               exp_avg_sqs: List[Tensor], *, step: int, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float) -> None:
    """One fairseq Adam update (module docstring) of parameters that share the step count
    ``step`` (already incremented, >= 1), in place. All lists have one entry per parameter;
    tensors of one entry share shape, device and dtype (float32 here; fairseq's own loop
    handles half-precision parameters)."""
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    if weight_decay != 0:
        torch._foreach_add_(params, params, alpha=-weight_decay * lr)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def grad_norms(grads: Sequence[Tensor]) -> List[Tensor]:
    """``[||g||_2 for g in grads]`` as 0-dim float32 tensors, one multi-tensor call (the
    per-tensor values are those of ``torch.norm(g, p=2, dtype=torch.float32)``)."""
    if not grads:
        return []
    return list(torch._foreach_norm(list(grads), 2, dtype=torch.float32))


def total_norm(norms: Sequence[Tensor]) -> Tensor:
    """The L2 norm of all gradients from their per-tensor norms, as fairseq's
    ``clip_grad_norm_`` forms it (a single gradient's norm is returned as it is)."""
    if len(norms) == 1:
        return norms[0]
    return torch.norm(torch.stack(list(norms)))


@torch.no_grad()
def clip_grads_(grads: Sequence[Tensor], total: Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total + 1e-6))`` (fairseq's clip
    coefficient) when ``max_norm > 0``; a tensor, never read on the host."""
    if max_norm > 0 and grads:
        clip_coef = (float(max_norm) / (total + 1e-6)).clamp_(max=1)
        torch._foreach_mul_(list(grads), clip_coef)


def norms_and_total(grads: Sequence[Tensor]) -> Tuple[List[Tensor], Tensor]:
    """``(grad_norms(grads), total_norm(...))``."""
    norms = grad_norms(grads)
    return norms, total_norm(norms)
