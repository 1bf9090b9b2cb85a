r"""Normalisation layers a Transformer layer can use in place of LayerNorm (pure torch).

This module never imports fairseq; the model picks one kind per model with ``--admin-norm``
(:data:`NORM_CHOICES`) and builds every LayerNorm of the model, the per-sub-layer ones and
the stacks' final ones, through :func:`make_norm`:

=============  ====================================  =====================================
``layernorm``  ``g * (x - mean) / sqrt(var + eps)    Ba, Kiros and Hinton 2016, "Layer
               + b`` over the last dimension          Normalization", arXiv 1607.06450
``dyt``        ``g * tanh(a * x) + b``, ``a`` one     Zhu, Chen, He, LeCun and Liu 2025,
               trainable scalar (initialised to       "Transformers without Normalization"
               ``--dyt-alpha-init``, 0.5), ``g``,     (CVPR), arXiv 2503.10622; code:
               ``b`` per channel (ones, zeros)        github.com/jiachenzhu/DyT
=============  ====================================  =====================================

Where each of these sits in a layer (Post-LN, Pre-LN, Peri-LN, Mix-LN) is
:mod:`fairseq_admin_pos.placements`; every placement works with either kind.

**DyT as a drop-in LayerNorm.** :class:`DynamicTanh` is called like ``nn.LayerNorm(C)``: on
``(T, B, C)`` or ``(B, T, C)`` (any ``(*, C)``) tensors, acting on the last dimension, and
returns the input's shape and dtype. Its per-channel gain and shift are named ``weight`` and
``bias``, as LayerNorm's are and as the authors' ``DynamicTanh`` names them, so

* checkpoints have the authors' layout (``alpha`` of shape ``(1,)``, ``weight``, ``bias``
  of shape ``(C,)``), and the LayerNorm parameters keep their fairseq names
  (``self_attn_layer_norm.weight`` ...), so fairseq's state-dict upgrades and optimizer
  rules that go by name or by dimension (no weight decay on ``bias`` / 1-d parameters)
  treat them as they treat LayerNorm's;
* anything that rescales a LayerNorm's output through its affine parameters stays exact:
  DyT's output is affine in ``(weight, bias)`` exactly like LayerNorm's, so
  ``weight <- w * weight``, ``bias <- w * bias`` multiplies the output by ``w`` for both.

What does *not* carry over is anything that relies on LayerNorm's normalisation itself
(zero mean, unit variance of ``(y - bias) / weight``, a constant ``eps``): DyT only squashes.
In particular an exporter that rebuilds the model in another runtime (the CTranslate2
export) must refuse ``dyt``: that runtime's LayerNorm would read ``weight`` and ``bias``
and normalise.

**Mixed precision.** ``fairseq-train --fp16/--bf16`` casts the model with ``.half()`` /
``.to(torch.bfloat16)``. fairseq's ``LayerNorm`` (``torch.nn.LayerNorm``, or apex's
``FusedLayerNorm`` on CUDA) then takes and returns half-precision tensors but computes its
statistics in float32 inside the kernel; ``Fp32LayerNorm`` does the same with explicit
casts. :class:`DynamicTanh` follows that rule: its parameters follow the model dtype (like
LayerNorm's, and like every trainable weight of :mod:`fairseq_admin_pos.schemes`; fairseq's
FP16 optimizers keep float32 master copies), and for float16/bfloat16 inputs it computes
``tanh(a * x) * g + b`` in float32 and rounds once to the input dtype. The forward is then
the float32 DyT rounded once, instead of three roundings (after ``a * x``, after ``tanh``,
after ``* g + b``), and, which matters more, ``a``'s gradient, a sum over *every* element
of the input (``T * B * C`` terms, ``C`` times more than a LayerNorm gain's), is
accumulated in float32 before it is rounded to the parameter dtype once. The cost in eager
mode is one extra cast kernel and a float32 ``tanh`` output kept for backward (6 bytes per
element instead of 4 in half precision); ``torch.compile`` fuses the chain. Under float16 a
summed ``a`` gradient beyond 65504 still becomes ``inf`` in the half-precision ``.grad``,
which fairseq's dynamic loss scaler treats like any other overflow (skip the step, lower
the scale); bfloat16 has float32's range. float32 and float64 inputs are computed in their
own dtype (``gradcheck`` runs in float64).

The forward never reads a tensor value on the host (no ``.item()``, no branch on values):
the only checks are on shapes and dtypes.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

__all__ = [
    "NORM_CHOICES",
    "DYT_ALPHA_INIT",
    "DynamicTanh",
    "make_norm",
    "check_norm_kind",
    "check_dyt_alpha_init",
]

#: the ``--admin-norm`` choices, in the order of the table above
NORM_CHOICES = ("layernorm", "dyt")

#: DyT's default initial ``alpha`` (the paper's alpha_0 for every non-LLM model)
DYT_ALPHA_INIT = 0.5

#: activation dtypes DyT computes in float32 (as LayerNorm kernels do)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_norm_kind(kind) -> str:
    """Return ``kind`` if it is one of :data:`NORM_CHOICES`; otherwise raise a one-line
    ``ValueError`` naming ``--admin-norm`` and the valid choices."""
    if not isinstance(kind, str) or kind not in NORM_CHOICES:
        choices = ", ".join(repr(c) for c in NORM_CHOICES)
        raise ValueError(f"--admin-norm must be one of {choices}; got {kind!r}")
    return kind


def check_dyt_alpha_init(value) -> float:
    """Return ``value`` as a float if it is a positive finite number; otherwise raise a
    one-line ``ValueError`` naming ``--dyt-alpha-init``. (``alpha = 0`` would make every DyT
    output the constant ``bias`` with zero gradient to everything below it, and a negative
    ``alpha`` only flips the sign that ``weight`` could flip.)"""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"--dyt-alpha-init must be a positive finite number (DyT's initial "
                         f"tanh scale alpha, {DYT_ALPHA_INIT} in the paper); got {value!r}")
    return float(value)


def _normalized_shape(value) -> Tuple[int, ...]:
    shape = (value,) if isinstance(value, numbers.Integral) else tuple(value)
    if not shape or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1
                        for d in shape):
        raise ValueError(f"normalized_shape must be a positive int or a non-empty tuple of "
                         f"positive ints (the channel dimensions); got {value!r}")
    return tuple(int(d) for d in shape)


class DynamicTanh(nn.Module):
    r"""Dynamic Tanh (DyT), a drop-in replacement for ``nn.LayerNorm(normalized_shape)``.

    .. math:: \mathrm{DyT}(x) = \gamma \odot \tanh(\alpha x) + \beta

    Zhu, Chen, He, LeCun and Liu, "Transformers without Normalization" (CVPR 2025,
    arXiv 2503.10622), Eq. 1 and the authors' ``DynamicTanh`` (github.com/jiachenzhu/DyT):
    ``alpha`` is one trainable scalar per DyT layer, stored with shape ``(1,)`` and
    initialised to ``alpha_init``; ``gamma`` (``weight``, ones) and ``beta`` (``bias``,
    zeros) are per-channel vectors of shape ``normalized_shape``, exactly LayerNorm's affine
    parameters and names. Unlike LayerNorm, nothing is computed across channels: each
    element is squashed on its own, and ``alpha`` sets how much of the input's range stays
    in tanh's near-linear part (the paper shows it tracks ``1 / std`` of the activations).

    ``alpha_init = 0.5`` is the paper's default (its alpha_0; section "Initialization of
    alpha"): found by sweeps and used for every non-LLM model there (ViT, ConvNeXt, DiT,
    wav2vec 2.0, ...), where results are insensitive to it over a broad range; only its LLaMA
    models needed alpha_0 tuned (smaller for wider models, larger in the attention blocks
    than elsewhere). Must be a positive finite number (``--dyt-alpha-init``).

    Shapes: ``x`` ``(*, *normalized_shape)`` (e.g. fairseq's ``(T, B, C)``, or
    ``(B, T, C)``) -> same shape and dtype. For float16/bfloat16 ``x`` the value is computed
    in float32 and rounded once (module docstring, "Mixed precision"); parameters follow the
    module's dtype. ``elementwise_affine=False`` drops ``weight`` and ``bias`` (``tanh(alpha
    x)``), as it drops LayerNorm's. Gradients, for an upstream gradient ``u`` and ``t =
    tanh(alpha x)``: ``dx = u * gamma * alpha * (1 - t^2)``, ``dalpha = sum(u * gamma * (1 -
    t^2) * x)`` over every element, ``dgamma = sum(u * t)`` and ``dbeta = sum(u)`` over all
    but the channel dimensions.
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int]],
                 alpha_init: float = DYT_ALPHA_INIT, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.alpha_init = check_dyt_alpha_init(alpha_init)
        self.elementwise_affine = bool(elementwise_affine)
        factory = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.empty(1, **factory))
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``alpha = alpha_init``, ``weight = 1``, ``bias = 0`` (the paper's initialisation)."""
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            if self.weight is not None:
                nn.init.ones_(self.weight)
                nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.normalized_shape)
        if tuple(x.shape[-n:]) != self.normalized_shape:
            raise ValueError(f"DynamicTanh expects an input whose last dimension(s) are "
                             f"{self.normalized_shape}; got shape {tuple(x.shape)}")
        dtype = x.dtype
        # float16/bfloat16 -> float32; float32 and float64 stay as they are
        compute = torch.promote_types(dtype, torch.float32)
        # alpha has shape (1,), not (): a dimensioned float32 tensor promotes a half x, so
        # the product is one kernel reading x in half and writing float32 (no copy of x)
        y = torch.tanh(self.alpha.to(compute) * x)
        if self.weight is not None:
            y = torch.addcmul(self.bias.to(compute), y, self.weight.to(compute))
        return y.to(dtype)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, alpha_init={self.alpha_init:g}, "
                f"elementwise_affine={self.elementwise_affine}")


def make_norm(kind: str, dim: int, *, dyt_alpha_init: float = DYT_ALPHA_INIT,
              eps: float = 1e-5,
              layer_norm: Optional[Callable[..., nn.Module]] = None) -> nn.Module:
    r"""One normalisation layer of kind ``kind`` (``--admin-norm``) over ``dim`` channels.

    * ``"layernorm"``: ``layer_norm(dim, eps=eps)``, by default ``torch.nn.LayerNorm``;
      the fairseq glue passes fairseq's factory (``fairseq.modules.LayerNorm``, e.g.
      ``functools.partial(LayerNorm, export=cfg.export)``) to get exactly the module
      stock fairseq builds.
    * ``"dyt"``: :class:`DynamicTanh` ``(dim, alpha_init=dyt_alpha_init)``; ``eps`` and
      ``layer_norm`` are not used (DyT has no variance to guard).

    Both are called on ``(*, dim)`` tensors and have ``weight`` and ``bias`` of shape
    ``(dim,)``. Raises a one-line ``ValueError`` naming ``--admin-norm`` for an unknown
    ``kind``, naming ``--dyt-alpha-init`` for a non-positive or non-finite
    ``dyt_alpha_init`` (checked when ``kind == "dyt"``), and for a ``dim`` that is not a
    positive int or an ``eps`` that is not a positive finite number.
    """
    check_norm_kind(kind)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
        raise ValueError(f"dim must be a positive int (the number of channels); got {dim!r}")
    if kind == "dyt":
        return DynamicTanh(int(dim), alpha_init=check_dyt_alpha_init(dyt_alpha_init))
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) \
            or eps <= 0:
        raise ValueError(f"eps must be a positive finite number; got {eps!r}")
    factory = nn.LayerNorm if layer_norm is None else layer_norm
    return factory(int(dim), eps=float(eps))
