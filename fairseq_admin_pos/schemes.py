r"""Residual schemes that compete with Admin, and precision-keeping residuals (pure torch).

This module never imports fairseq; :mod:`fairseq_admin_pos.models.admin_transformer` picks
one scheme per model with ``--admin-residual``:

==================  =====================================  ==================================
``admin``           ``LN(x * omega + f(x))``               Liu et al. 2020 (EMNLP), "Under-
                                                           standing the Difficulty of
                                                           Training Transformers"
``deepnorm``        ``LN(alpha * x + f(x))``, f's FFN,     Wang et al. 2022, "DeepNet:
                    value and output projections           Scaling Transformers to 1,000
                    Xavier-normal with gain beta           Layers", arXiv 2203.00555
``rezero``          ``x + a * f(x)``, ``a`` a trainable    Bachlechner et al. 2020, "ReZero
                    scalar starting at 0, no LayerNorm     is All You Need", arXiv 2003.04887
``rezero-post-ln``  ``LN(x + a * f(x))``                   same paper, its "Post-Norm +
                                                           ReZero" variant (Table 1)
``b2t``             Post-LN plus the layer input ``x_l``   Takase et al. 2023, "B2T
                    added into the layer's last LN:        Connection: Serving Stability
                    ``LN(h + f(h) + x_l)``; every Linear   and Performance in Deep
                    weight of a layer times N^(-1/2)       Transformers" (Findings of ACL)
``resi-dual``       Post-LN stream ``LN(x + f(x))`` and    Xie et al. 2023, "ResiDual:
                    the dual sum ``d + f(x)``; stack       Transformer with Dual Residual
                    output ``x_N + LN(d_N)``               Connections", arXiv 2304.14802
``peri-ln``         ``x + LN_out(f(LN(x)))``; a final LN   Kim et al. 2025 (ICML), "Peri-LN"
                    on each stack                          arXiv 2502.02732
``mix-ln``          Post-LN in a stack's first             Li, Yin and Liu 2025 (ICLR),
                    ``floor(alpha L)`` layers, Pre-LN      "Mix-LN", arXiv 2412.13795
                    above
==================  =====================================  ==================================

``peri-ln`` and ``mix-ln`` are LayerNorm *placements* with the plain shortcut ``x + f(x)``:
their formulas and per-stack rules are :mod:`fairseq_admin_pos.placements`, their fairseq
layers :mod:`fairseq_admin_pos.models.norm_layers`. The normalisation module itself
(LayerNorm or DyT, ``--admin-norm``) is :mod:`fairseq_admin_pos.norms`.

B2T and ResiDual change the *layer* and the *stack* (a term that skips sub-layers, a second
stream), which a per-sub-layer residual module cannot express: their layers and stacks are in
:mod:`fairseq_admin_pos.models.b2t_resi_dual`; their sub-layer shortcuts are the plain
``x + f(x)`` (a :class:`Float32OmegaResidual` with omega = 1). This module holds B2T's
initialisation, :func:`b2t_rescale_init_`.

``f(x)`` is the dropped-out sub-layer output (self-attention, encoder attention or FFN).
Every residual module here is called as ``module(x, f_x)`` with ``x`` the shortcut and
``f_x`` the branch, both of shape ``(*, C)``, and returns the sum of shape ``(*, C)`` (the
LayerNorm, if any, is applied by the layer).

DeepNorm constants (encoder-decoder, N encoder layers, M decoder layers; DeepNet Sec. 3 and
Table 1, "Encoder-decoder" rows)::

    encoder  alpha = 0.81 (N^4 M)^(1/16)      beta = 0.87 (N^4 M)^(-1/16)
    decoder  alpha = (3M)^(1/4)               beta = (12M)^(-1/4)

alpha weights the shortcut of every sub-layer of that stack; beta is the gain of the
Xavier-normal initialisation of the FFN (``fc1``, ``fc2``), value (``v_proj``) and output
(``out_proj``) projections of every attention of that stack (the decoder's encoder attention
included); the query and key projections are Xavier-normal with gain 1 (the paper's
``deepnorm_init``, Fig. 2).

**torchscale note.** Microsoft's torchscale does not use the paper's beta: it keeps its
default initialisation and *divides* those weights by ``(N^4 M)^(1/16) / 1.15`` in the
encoder (``(12 M)^(1/4)`` in the decoder), i.e. an encoder gain of ``1.15 (N^4 M)^(-1/16)``
instead of ``0.87 (N^4 M)^(-1/16)`` applied on top of a different base initialisation
(github.com/microsoft/torchscale/issues/16). **This module follows the paper**
(:func:`deepnorm_constants`, :func:`deepnorm_init_`); results are therefore not
bit-comparable with torchscale runs.

Mixed precision: :class:`Float32OmegaResidual` keeps a *fixed* shortcut weight (Admin's
buffer omega, DeepNorm's alpha) in float32 when the model is cast with ``.half()`` /
``.bfloat16()`` (what ``fairseq-train --fp16/--bf16`` does) and computes
``x * omega + f_x`` in float32 before rounding once to the activation dtype, in one kernel
forward and one backward; with omega == 1 it is fairseq's ``x + f_x`` (same kernels). Trainable
weights (Admin's vector omega, ReZero's ``a``) follow the model dtype like every other
parameter; fairseq's ``FP16Optimizer`` keeps their float32 master copies.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, NamedTuple

import torch
import torch.nn as nn

from fairseq_admin_pos.admin import OmegaResidual

__all__ = [
    "RESIDUAL_SCHEMES",
    "DeepNormConstants",
    "deepnorm_constants",
    "xavier_normal_gain_",
    "deepnorm_init_",
    "b2t_rescale_init_",
    "Float32OmegaResidual",
    "ReZeroResidual",
]

#: the ``--admin-residual`` choices, in the order of the table above
RESIDUAL_SCHEMES = ("admin", "deepnorm", "rezero", "rezero-post-ln", "b2t", "resi-dual",
                    "peri-ln", "mix-ln")

#: dtypes whose rounding of a fixed shortcut weight would bias every step (omega = 3.04
#: is 3.03125 in bfloat16, 3.041 in float16)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_layers(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int (a number of layers); got {value!r}")
    return int(value)


class DeepNormConstants(NamedTuple):
    """DeepNorm's shortcut weights (alpha) and initialisation gains (beta) per stack."""

    encoder_alpha: float
    encoder_beta: float
    decoder_alpha: float
    decoder_beta: float


def deepnorm_constants(encoder_layers: int, decoder_layers: int) -> DeepNormConstants:
    r"""DeepNorm's alpha and beta for an encoder-decoder with N encoder, M decoder layers.

    ``encoder_alpha = 0.81 (N^4 M)^(1/16)``, ``encoder_beta = 0.87 (N^4 M)^(-1/16)``,
    ``decoder_alpha = (3M)^(1/4)``, ``decoder_beta = (12M)^(-1/4)`` (Wang et al. 2022,
    "DeepNet", arXiv 2203.00555, Table 1). N and M count *layers*, not sub-layers. For
    example (alpha / beta, rounded) 6L-6L: encoder 1.418 / 0.497, decoder 2.060 / 0.343;
    18L-18L: encoder 1.999 / 0.353, decoder 2.711 / 0.261; 60L-12L: encoder 2.633 / 0.268,
    decoder 2.449 / 0.289.

    Raises ``ValueError`` unless both counts are positive ints.
    """
    n = _check_layers(encoder_layers, "encoder_layers")
    m = _check_layers(decoder_layers, "decoder_layers")
    # (N^4 M)^(1/16) = N^(1/4) M^(1/16): written this way so 1000-layer models do not
    # overflow an intermediate N^4 M in other number types
    enc = n ** 0.25 * m ** 0.0625
    return DeepNormConstants(
        encoder_alpha=0.81 * enc,
        encoder_beta=0.87 / enc,
        decoder_alpha=(3.0 * m) ** 0.25,
        decoder_beta=(12.0 * m) ** -0.25,
    )


def xavier_normal_gain_(weight: torch.Tensor, gain: float) -> torch.Tensor:
    r"""Re-draw ``weight`` (shape ``(out, in)``) from ``N(0, std^2)`` in place,
    ``std = gain * sqrt(2 / (fan_in + fan_out))`` (Glorot & Bengio 2010, "Xavier normal";
    ``torch.nn.init.xavier_normal_``). Returns ``weight``. ``gain`` must be a positive
    finite number."""
    if isinstance(gain, bool) or not isinstance(gain, numbers.Real) or not math.isfinite(gain) \
            or gain <= 0:
        raise ValueError(f"gain must be a positive finite number; got {gain!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
        raise ValueError("xavier_normal_gain_ needs a weight tensor with at least 2 dimensions")
    with torch.no_grad():
        return nn.init.xavier_normal_(weight, gain=float(gain))


def deepnorm_init_(
    layer: nn.Module,
    beta: float,
    attention_names: Iterable[str] = ("self_attn", "encoder_attn"),
    ffn_names: Iterable[str] = ("fc1", "fc2"),
) -> None:
    r"""DeepNorm's initialisation of one Transformer layer, in place (DeepNet, Fig. 2).

    For each attention ``layer.<a>`` in ``attention_names`` that exists (fairseq's
    ``MultiheadAttention`` naming): ``q_proj``, ``k_proj`` Xavier-normal with gain 1,
    ``v_proj``, ``out_proj`` Xavier-normal with gain ``beta``; each Linear ``layer.<f>`` in
    ``ffn_names`` Xavier-normal with gain ``beta``. Biases and LayerNorms are left as they
    are (the paper re-initialises weight matrices only). Use the beta of the layer's stack
    (:func:`deepnorm_constants`).
    """
    touched = 0
    for name in attention_names:
        attn = getattr(layer, name, None)
        if attn is None:
            continue
        for proj, gain in (("q_proj", 1.0), ("k_proj", 1.0), ("v_proj", beta), ("out_proj", beta)):
            xavier_normal_gain_(getattr(attn, proj).weight, gain)
        touched += 1
    for name in ffn_names:
        fc = getattr(layer, name, None)
        if fc is None:
            continue
        xavier_normal_gain_(fc.weight, beta)
        touched += 1
    if touched == 0:
        raise ValueError(
            f"deepnorm_init_: {type(layer).__name__} has none of the attentions "
            f"{tuple(attention_names)} or FFN linears {tuple(ffn_names)}"
        )


def b2t_rescale_init_(layer: nn.Module, num_layers: int) -> int:
    r"""B2T's initialisation of one layer, in place: every ``nn.Linear`` weight of ``layer``
    (attention q/k/v/out projections, encoder attention, FFN ``fc1``/``fc2``) is multiplied
    by ``num_layers^(-1/2)``, ``num_layers`` the layer count of the layer's stack; biases and
    LayerNorms stay as they are. Returns the number of weights rescaled.

    Source: the authors' code (takase/b2t_connection, ``fairseq/modules/transformer_layer.py``,
    ``rescaling_init``, called in every encoder and decoder layer's constructor whenever
    ``--residual-bottom-to-top`` is on) multiplies every parameter whose name contains
    ``weight`` and not ``layer_norm`` by ``layer_num ** -0.5``; on fairseq's layers these are
    exactly the Linear weights (here selected by type, so NormFormer's extra LayerNorms,
    whose names lack ``layer_norm``, are not rescaled). The paper's equations do not show
    this step; it is part of every B2T run of the authors' code, so it is part of ``b2t``.
    """
    n = _check_layers(num_layers, "num_layers")
    scale = n ** -0.5
    count = 0
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                module.weight.mul_(scale)
                count += 1
    if count == 0:
        raise ValueError(f"b2t_rescale_init_: {type(layer).__name__} has no Linear layer")
    return count


def _is_compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


class _ShortcutSum(torch.autograd.Function):
    r"""``x * omega + f_x`` in one kernel each way, for ``x``, ``f_x`` of one dtype and shape.

    Used by :class:`Float32OmegaResidual` for a float32 ``omega`` with float16/bfloat16
    activations: one ``addcmul`` writing into a tensor of ``x``'s dtype computes in float32
    and rounds once on store, without float32 copies of ``x``, ``f_x`` or the sum (no
    native op does that in one kernel: ``add(f_x, x, alpha=omega)`` rounds alpha to the
    activation dtype on the CPU). Where omega and the activations share a dtype, native
    ``addcmul`` is used instead: a Python autograd function costs about twice the host time
    of the native ops (``docs/speed.md``), and the host is what a training step waits for.
    Backward: ``grad_f = grad`` (no kernel), ``grad_x = grad * omega`` written the same way
    (one kernel), and ``grad_omega = sum(grad * x)`` over the broadcast dimensions only when
    omega is trained.
    """

    @staticmethod
    def forward(ctx, x, f_x, omega):
        ctx.save_for_backward(omega, x if omega.requires_grad else None)
        return torch.addcmul(f_x, x, omega, out=torch.empty_like(x))

    @staticmethod
    def backward(ctx, grad):
        omega, x = ctx.saved_tensors
        grad_x = grad_omega = None
        if ctx.needs_input_grad[0]:
            if torch.is_grad_enabled():  # double backward: out= is not differentiable
                grad_x = (grad.to(torch.promote_types(grad.dtype, omega.dtype)) * omega
                          ).to(grad.dtype)
            else:
                grad_x = torch.mul(grad, omega, out=torch.empty_like(grad))
        if ctx.needs_input_grad[2]:
            prod = grad * x if omega.dtype == x.dtype else grad.float() * x.float()
            grad_omega = prod.sum_to_size(omega.shape).to(omega.dtype)
        return grad_x, grad if ctx.needs_input_grad[1] else None, grad_omega


class Float32OmegaResidual(OmegaResidual):
    r"""Admin/DeepNorm residual ``x * omega + f_x`` whose *fixed* omega stays float32.

    Same constructor, state dict and float32 results as
    :class:`fairseq_admin_pos.admin.OmegaResidual` (bit for bit; with omega == 1 bitwise
    ``x + f_x``, so ``--admin-init none`` remains stock fairseq). Differences, for
    ``fairseq-train --fp16/--bf16``, which casts the whole model with ``.half()`` /
    ``.to(torch.bfloat16)``, and for speed:

    * the buffer form (``as_parameter=False``) keeps omega in float32 through those casts
      (device moves still apply), so checkpoints hold the exact value and a profiled or
      closed-form omega is never rounded (3.04 would become 3.03125 in bfloat16);
    * with float16/bfloat16 inputs and a float32 omega the sum is computed in float32 and
      rounded once to the activation dtype, in one kernel forward and one backward
      (:class:`_ShortcutSum`); mixed-dtype or broadcast inputs take
      ``addcmul(f_x, x, omega).to(dtype)``, the same numbers in more kernels;
    * where omega and the activations share a dtype (float32 training; the trainable vector
      in every precision) it is one native ``addcmul`` forward, the seed module's numbers,
      with autograd's own backward: no Python runs in the backward pass;
    * a buffer omega *known* to be exactly 1 computes ``x + f_x`` itself: the same numbers
      (``x * 1`` is exact) in stock fairseq's one kernel forward and none backward, so the
      Post-LN/Pre-LN baselines (``--admin-init none``) cost what stock costs in every
      precision. Known means set on the host (construction, ``load_state_dict`` from a CPU
      state dict, dtype/device casts) and untouched since, which the tensor's version
      counter tells without reading the device; any other write (``fill_``, ``copy_``,
      profiling) makes the next forward take the general path until omega is set from the
      host again. Never a host-device synchronisation. Writes through ``omega.data`` are not
      seen by the version counter (nor by autograd): write omega under ``torch.no_grad()``.

    The parameter form (trainable vector, Transformer-Clinic) follows the model dtype like
    every other weight: fairseq's FP16Optimizer keeps its float32 master copy.
    The seed API class in ``admin.py`` is left unchanged (its omega follows ``.half()``).

    Shapes: ``x``, ``f_x`` ``(*, C)`` -> ``(*, C)``.
    """

    def __init__(self, init_value, as_parameter=False, embed_dim=None):
        super().__init__(init_value, as_parameter=as_parameter, embed_dim=embed_dim)
        self._mark_known_one(not self.as_parameter and self.init_value == 1.0)

    # -- omega == 1 known on the host ------------------------------------------------------
    def _mark_known_one(self, known: bool) -> None:
        omega = self._buffers.get("omega") if not self.as_parameter else None
        # the tensor itself and its version: any later in-place write or replacement shows
        # (tensors made under torch.inference_mode have no version counter: never known)
        known = known and omega is not None and not omega.is_inference()
        self._one_at = (omega, omega._version) if known else None

    def _known_one(self) -> bool:
        key = getattr(self, "_one_at", None)
        if key is None or _is_compiling():
            return False
        omega = self._buffers.get("omega")
        return key[0] is omega and key[1] == omega._version

    def _apply(self, fn, recurse=True):
        # casts and moves keep 1.0 exactly (it is exact in every floating dtype); the meta
        # device holds no value, and leaving it (to_empty) leaves garbage until a load
        was_one = self._known_one() and self.omega.device.type != "meta"
        keep = None
        if not self.as_parameter and self.omega.dtype == torch.float32:
            keep = self.omega  # Module._apply replaces the buffer; this tensor stays float32
        out = super()._apply(fn, recurse)
        if keep is not None and self.omega.dtype in _LOW_PRECISION:
            self._buffers["omega"] = keep.to(device=self.omega.device)
        self._mark_known_one(was_one and self.omega.device.type != "meta")
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        incoming = state_dict.get(prefix + "omega")
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.as_parameter or not isinstance(incoming, torch.Tensor):
            return  # nothing loaded into the buffer: what was known still holds
        # read the incoming value only where that costs no device round trip
        known = (len(error_msgs) == errors and incoming.device.type == "cpu"
                 and bool((incoming == 1).all()))
        self._mark_known_one(known)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x, f_x):
        if self._known_one():
            return x + f_x
        return self.forward_omega(x, f_x)

    def forward_omega(self, x, f_x):
        omega = self.omega
        if not (x.is_floating_point() and f_x.is_floating_point()):
            return super().forward_omega(x, f_x)
        dtype = x.dtype if x.dtype == f_x.dtype else torch.promote_types(x.dtype, f_x.dtype)
        if omega.dtype == dtype and x.dtype == f_x.dtype:
            # one native kernel forward, autograd's backward (the seed module's numbers)
            return torch.addcmul(f_x, x, omega)
        # a float32 omega with half/bfloat16 activations: the sum is computed in float32
        if omega.dtype == torch.float32 and dtype in _LOW_PRECISION:
            if x.dtype == f_x.dtype and x.shape == f_x.shape and not _is_compiling():
                return _ShortcutSum.apply(x, f_x, omega)
            # mixed or broadcast inputs (torch.compile fuses this into one kernel)
            return torch.addcmul(f_x, x, omega).to(dtype)
        return super().forward_omega(x, f_x)


class ReZeroResidual(nn.Module):
    r"""ReZero's residual ``x + a * f_x`` with ``a`` one trainable scalar initialised to 0.

    Bachlechner, Majumder, Mao, Cottrell, McAuley 2020, "ReZero is All You Need: Fast
    Convergence at Large Depth" (arXiv 2003.04887), Eq. 4: ``x_{i+1} = x_i + a_i F(x_i)``.
    At initialisation every sub-layer is the identity, so a ReZero stack without LayerNorm
    returns its input (the embedding output) exactly. One ``a`` per residual sub-layer,
    as the paper writes it per residual connection (the authors' ``RZTXEncoderLayer``
    shares one ``resweight`` between the two sub-layers of a layer).

    ``a`` is stored as a parameter of shape ``(1,)`` and follows the model dtype; it is cast
    to ``f_x``'s dtype in the product, computed as one native ``addcmul`` (one kernel, one
    rounding, no temporary for ``a * f_x``; autograd's own backward). Shapes: ``x``,
    ``f_x`` ``(*, C)`` -> ``(*, C)``.
    """

    def __init__(self, init_value: float = 0.0):
        super().__init__()
        if isinstance(init_value, bool) or not isinstance(init_value, numbers.Real) \
                or not math.isfinite(init_value):
            raise ValueError(f"init_value must be a finite number; got {init_value!r}")
        self.alpha = nn.Parameter(torch.full((1,), float(init_value)))

    def forward(self, x, f_x):
        alpha = self.alpha
        if f_x.is_floating_point() and alpha.dtype != f_x.dtype:
            alpha = alpha.to(f_x.dtype)
        # one native kernel forward; autograd's backward (no Python in the backward pass)
        return torch.addcmul(x, f_x, alpha)

    def extra_repr(self) -> str:
        return f"alpha={float(self.alpha.detach().reshape(-1)[0]):.6g}"
