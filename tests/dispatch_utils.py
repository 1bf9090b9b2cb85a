"""Dispatcher-level probes for the tests: which aten ops a piece of code runs, and whether a
model's forward would read a device tensor back to the host.

Both are ``TorchDispatchMode``s, i.e. they see every aten op torch runs (the forward and,
for the CPU, the backward, which autograd runs on the calling thread), so the tests count
and inspect what a GPU would be asked to do without having one.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that launch no kernel: allocations and detach (views are recognised by `is_view`)
_NO_KERNEL = {
    "aten.empty_like.default", "aten.empty_strided.default", "aten.empty.memory_format",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.detach.default",
    "aten.promote_types.default", "aten.lift_fresh.default",
}


class OpRecorder(TorchDispatchMode):
    """Records the aten ops run inside ``with OpRecorder() as rec:``; :meth:`kernels` drops
    views and allocations, leaving the ops that launch a kernel on a device."""

    def __init__(self):
        super().__init__()
        self.ops: List[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))

    def kernels(self) -> List[str]:
        return [str(op) for op in self.ops if not op.is_view and str(op) not in _NO_KERNEL]


# --------------------------------------------------------------------------------------- #
# host-device synchronisation
# --------------------------------------------------------------------------------------- #
class HostSyncError(AssertionError):
    """Code under :func:`no_host_sync` read a device tensor's value on the host (the
    message names the op or ``Tensor`` method)."""


# ops whose result's *size* depends on the values, so the host must wait for the device
_VALUE_SHAPED = {
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
    "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.argwhere.default",
    "aten.repeat_interleave.Tensor",
}
# ops that hand a value to Python
_TO_HOST = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}
# ops whose result is host metadata even when the input lives on the device
_HOST_RESULT = {"aten._shape_as_tensor.default", "aten.sym_size.int", "aten.sym_numel.default"}

_MARK = "_hostsync_on_device"


def _tensors(tree) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _mark(tree) -> None:
    for t in _tensors(tree):
        setattr(t, _MARK, True)


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


class _DeviceTracker(TorchDispatchMode):
    """Propagates the "would live on the accelerator" mark from op inputs to outputs and
    raises on every op that needs a device value on the host (or a value-shaped result)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        inputs = _tensors((args, kwargs))
        on_device = any(_on_device(t) for t in inputs)
        if on_device and (name in _TO_HOST or name in _VALUE_SHAPED):
            raise HostSyncError(f"{name} on a device tensor inside the model's forward")
        if on_device and name in ("aten.index.Tensor", "aten.index_put.default",
                                  "aten.index_put_.default"):
            if any(t.dtype == torch.bool for t in _tensors(args[1])):
                raise HostSyncError(f"{name} with a boolean mask (a nonzero on the device)")
        out = func(*args, **kwargs)
        if on_device and name not in _HOST_RESULT:
            _mark(out)
        return out


class HostSyncGuard:
    """See :func:`no_host_sync`."""

    def __init__(self):
        self.depth = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Check the code in the ``with`` block (e.g. a backward pass) like a forward."""
        if self.depth:
            yield
            return
        self.depth += 1
        try:
            with _DeviceTracker():
                yield
        finally:
            self.depth -= 1

    def host_method(self, name):
        orig = getattr(torch.Tensor, name)
        guard = self

        def method(t, *a, **k):
            if guard.depth and _on_device(t):
                raise HostSyncError(f"Tensor.{name} on a device tensor inside the model's forward")
            return orig(t, *a, **k)

        return orig, method

    def wrap(self, mod: nn.Module):
        orig = mod.forward

        def forward(*args, **kwargs):
            _mark((args, kwargs))
            with self.active():
                out = orig(*args, **kwargs)
            _mark(out)
            return out

        return orig, forward


@contextlib.contextmanager
def no_host_sync(model: nn.Module, modules=None) -> Iterator[HostSyncGuard]:
    """While the ``with`` block runs, every forward of ``modules`` (default: the model, its
    encoder and its decoder), and any code run under the yielded guard's ``active()`` (a
    backward pass), raises :class:`HostSyncError` where it would make the host wait for an
    accelerator: ``Tensor.item``/``bool``/``int``/``float``/``tolist``/``cpu``/``numpy`` of
    a tensor that lives on the device, ``torch.equal``, or an op whose output size depends
    on device values (``nonzero``, boolean-mask indexing, ``unique`` ...).

    "Lives on the device" is tracked exactly as on a GPU: the model's parameters and
    buffers and every tensor argument of those forwards are device tensors, and so is every
    op result computed from one; tensors made from Python numbers or shapes are host
    tensors (fairseq's ``shape_as_tensor``, for instance), and reading them is free.
    Outside (fairseq's ``SequenceGenerator`` bookkeeping, the trainer) nothing is checked:
    that code is not the model's.
    """
    weights = list(model.parameters()) + list(model.buffers())
    _mark(weights)
    if modules is None:
        modules = [model, model.encoder, model.decoder]
    guard = HostSyncGuard()
    patched, originals = {}, []
    try:
        for name in ("tolist", "cpu", "numpy"):
            patched[name], method = guard.host_method(name)
            setattr(torch.Tensor, name, method)
        for mod in modules:
            orig, forward = guard.wrap(mod)
            originals.append((mod, "forward" in vars(mod), orig))
            mod.forward = forward
        yield guard
    finally:
        for name, orig in patched.items():
            setattr(torch.Tensor, name, orig)
        for mod, had_own, orig in originals:
            if had_own:
                mod.forward = orig
            else:
                del mod.forward
        for t in weights:  # the model outlives the block: leave its tensors unmarked
            if hasattr(t, _MARK):
                delattr(t, _MARK)


class NoValueReads(TorchDispatchMode):
    """Fails on the ops that hand any tensor's value to Python (behind ``.item()``,
    ``float(t)``, ``bool(t)``, ``torch.equal``): the strict form of :func:`no_host_sync`
    for code whose every tensor lives on the device (e.g. the training monitor's gradients
    and weights), where any such read would be a host-device synchronisation."""

    TO_HOST = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.TO_HOST:
            raise AssertionError(f"host-device synchronisation: {func}")
        return func(*args, **(kwargs or {}))
