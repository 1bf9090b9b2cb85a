r"""Opt-in compiled layers for training (``--admin-compile layers``; pure torch).

Each Transformer layer's training forward (and, through AOTAutograd, its backward) is
compiled with ``torch.compile`` (TorchInductor, ``dynamic=True`` since fairseq's batches
change shape at every step): the elementwise work around the matrix products (dropout,
residual sums, LayerNorm, softmax, the omega multiply-add) is fused into a few generated
kernels and the layer's Python and dispatcher overhead is paid once per layer call instead
of once per op. Only training forwards with gradients enabled take the compiled code;
validation, ``fairseq-generate`` and incremental decoding run the same layers eagerly.

What stays the same, so that the compiled path is only faster:

* the module tree, parameter names and ``state_dict``: nothing is wrapped (the layer's
  ``forward`` dispatches to the compiled function of its class, :func:`compiled_forward`),
  so checkpoints move freely between compiled and eager runs;
* the random numbers: ``torch._inductor.config.fallback_random`` is switched on, so dropout
  draws its masks with eager's generator calls, in eager's order (without it Inductor uses
  its own generator and the run would be a different random run, not the same one faster);
* the arithmetic up to float rounding: fused kernels may contract or reorder operations.
  ``tests/test_compiled_layers.py`` bounds the difference over 50 updates.

One compiled function per layer class is shared by every layer of that class (parameters
are inputs to the graph, not constants), so an 18-layer stack compiles like a 1-layer one;
the first training step pays the compilation (about a minute per layer class on a CPU).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

COMPILE_CHOICES = ("none", "layers")

_COMPILED: Dict[type, Callable] = {}


def _is_compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def enable(module: torch.nn.Module) -> None:
    """Make ``module`` (a layer with ``forward_eager``) run compiled in training."""
    if not hasattr(type(module), "forward_eager"):
        raise TypeError(f"{type(module).__name__} has no forward_eager to compile")
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True  # dropout's random numbers as in eager mode
    module.admin_compiled = True


def compiled_forward(module: torch.nn.Module) -> Optional[Callable]:
    """The compiled ``forward_eager`` of ``module``'s class (called as ``fn(module, ...)``),
    or ``None`` when the eager forward must run: not enabled, not training, no gradients,
    or already inside a compiled region."""
    if not module.__dict__.get("admin_compiled", False) or not module.training \
            or not torch.is_grad_enabled() or _is_compiling():
        return None
    cls = type(module)
    fn = _COMPILED.get(cls)
    if fn is None:
        fn = _COMPILED[cls] = torch.compile(cls.forward_eager, dynamic=True)
    return fn
