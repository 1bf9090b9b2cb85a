"""fairseq glue: ``FP16Optimizer``'s copies between the model and its float32 master copy as
two multi-tensor copies per step instead of one copy per parameter each way.

With ``--fp16`` (flattened master copy) and ``--bf16`` (fairseq never flattens for bf16:
one float32 master tensor per parameter) fairseq's ``_FP16OptimizerMixin`` copies every
half-precision gradient into the float32 master gradient before clipping, and every float32
master parameter back into the model after the step, each with its own ``copy_`` (plus
slicing and views on the flat tensor): 2 x 253 kernels per step for a 6L-6L model, and a
Python loop on the host. :func:`accelerate` replaces the two methods on one optimizer
instance (the plugin's models only, see :mod:`.trainer`) by ``torch._foreach_copy_`` over
the same tensors (views into the flat tensor, computed once): the same element conversions,
so the same bits, in a few multi-tensor kernels on a GPU. Missing gradients are zeros, as in
fairseq. Anything else (several devices, pipeline parallelism, parameters without
``requires_grad``) keeps fairseq's methods.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor


def _flat_views(flat: Tensor, params) -> List[Tensor]:
    views, offset = [], 0
    for p in params:
        n = p.numel()
        views.append(flat[offset:offset + n].view_as(p))
        offset += n
    return views


class _FlatCopies:
    """The two copies for one single-device flattened master copy."""

    def __init__(self, optimizer):
        self.opt = optimizer
        (self.flat,) = optimizer.fp32_params.values()
        self.params = list(optimizer.fp16_params)
        self.data_views = _flat_views(self.flat.data, self.params)
        self._grad, self.grad_views = None, None

    def grads_to_fp32(self) -> None:
        opt = self.opt
        if not opt._needs_sync:
            return
        if self._grad is not self.flat.grad:  # fairseq keeps one flat gradient tensor
            self._grad = self.flat.grad
            self.grad_views = _flat_views(self._grad.data, self.params)
        dst, src = [], []
        with torch.no_grad():
            for view, p in zip(self.grad_views, self.params):
                if p.grad is None:
                    view.zero_()
                else:
                    dst.append(view)
                    src.append(p.grad)
            if dst:
                torch._foreach_copy_(dst, src)
        opt._needs_sync = False

    def params_to_fp16(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.data_views)


class _ListCopies:
    """The two copies for one float32 master tensor per parameter (``--bf16``,
    ``--fp16-no-flatten-grads``)."""

    def __init__(self, optimizer):
        self.opt = optimizer
        self.pairs = list(zip(optimizer.fp16_params, optimizer.fp32_params))

    def grads_to_fp32(self) -> None:
        opt = self.opt
        if not opt._needs_sync:
            return
        dst, src = [], []
        with torch.no_grad():
            for p, p32 in self.pairs:
                if p.grad is None:
                    p32.grad = torch.zeros_like(p.data, dtype=torch.float)
                elif p32.grad is None:
                    p32.grad = p.grad.data.float()
                else:
                    dst.append(p32.grad.data)
                    src.append(p.grad.data)
            if dst:
                torch._foreach_copy_(dst, src)
        opt._needs_sync = False

    def params_to_fp16(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p, _ in self.pairs],
                                 [p32.data for _, p32 in self.pairs])


def accelerate(optimizer) -> bool:
    """Install the multi-tensor copies on an ``FP16Optimizer`` (module docstring); returns
    whether it did."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    if type(optimizer) is not FP16Optimizer:
        return False
    params = list(optimizer.fp16_params)
    if not params or not all(p.requires_grad for p in params):
        return False
    if len({p.device for p in params}) != 1:
        return False
    fp32 = optimizer.fp32_params
    if isinstance(fp32, dict):
        if len(fp32) != 1 or not all(torch.is_tensor(t) for t in fp32.values()):
            return False
        (flat,) = fp32.values()
        if flat.numel() != sum(p.numel() for p in params) or flat.device != params[0].device:
            return False
        copies = _FlatCopies(optimizer)
    elif isinstance(fp32, list) and len(fp32) == len(params):
        copies = _ListCopies(optimizer)
    else:
        return False
    # instance attributes: found before the class's methods, this optimizer only
    optimizer._sync_fp16_grads_to_fp32 = copies.grads_to_fp32
    optimizer._sync_fp32_params_to_fp16 = copies.params_to_fp16
    return True
