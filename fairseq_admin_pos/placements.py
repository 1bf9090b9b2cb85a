r"""Where a Transformer's LayerNorms sit: Post-LN, Pre-LN, Peri-LN and Mix-LN (pure torch).

This module never imports fairseq. It defines the LayerNorm placements as functions that
the fairseq layers call for every residual sub-layer (self-attention, encoder attention,
FFN), plus the per-stack rules (which layer gets which placement, whether the stack ends
with a LayerNorm) and a reference stack for tests. "LN" is whatever
:func:`fairseq_admin_pos.norms.make_norm` builds (LayerNorm or DyT):

===========  ==========================================  ====================================
``post-ln``  ``LN(x + F(x))``; no final stack LN         Vaswani et al. 2017, "Attention Is
                                                         All You Need" (fairseq's default)
``pre-ln``   ``x + F(LN(x))``; a final LN on each stack  Xiong et al. 2020, "On Layer
                                                         Normalization in the Transformer
                                                         Architecture", arXiv 2002.04745
``peri-ln``  ``x + LN_out(F(LN_in(x)))``: LN on the      Kim et al. 2025 (ICML), "Peri-LN:
             sub-layer's input *and* on its output       Revisiting Normalization Layer in
             (not on the sum); a final LN on each stack  the Transformer Architecture",
                                                         arXiv 2502.02732
``mix-ln``   Post-LN in a stack's first                  Li, Yin and Liu 2025 (ICLR), "Mix-
             ``floor(alpha * L)`` layers, Pre-LN in the  LN: Unleashing the Power of Deeper
             others (``--mix-ln-alpha``, 0.25); a final  Layers by Combining Pre-LN and
             LN on the stack unless every layer is       Post-LN", arXiv 2412.13795
             Post-LN
===========  ==========================================  ====================================

``F`` is the sub-layer (attention or FFN) and ``x`` its input, of shape ``(*, C)`` (fairseq's
``(T, B, C)``). With ``dropout`` (fairseq drops the branch out before the residual add) and
``residual`` (the sum; ``x + f`` unless a residual scheme such as Admin's ``x * omega + f``
is used), :func:`sublayer_residual` computes::

    post-ln:  norm(residual(x, dropout(F(x))))
    pre-ln:   residual(x, dropout(F(norm(x))))
    peri-ln:  residual(x, dropout(out_norm(F(norm(x)))))

``norm`` is the sub-layer's own LayerNorm (fairseq's ``self_attn_layer_norm``,
``encoder_attn_layer_norm``, ``final_layer_norm``), which keeps its name and role in every
placement; ``out_norm`` is the one LayerNorm per sub-layer that Peri-LN adds.

**Peri-LN and dropout.** Dropout goes *after* the output LN, on the branch right before the
add: ``x + dropout(LN_out(F(LN_in(x))))``. The paper's formula, ``x + Norm(Module(Norm(x)))``
has no dropout (its LLMs, like Gemma 2 and OLMo 2 whose layers it describes, train
without residual dropout), so the order is ours to fix; we take it from the two published
implementations of an LN on the branch output inside a residual: fairseq's own NormFormer
(Shleifer et al. 2021; ``fairseq/modules/transformer_layer.py`` applies ``attn_ln`` to the
attention output, then ``dropout_module``, then the residual add) and Swin Transformer V2's
res-post-norm (Liu et al. 2022; ``x + drop_path(norm(attn(x)))``, timm's ``ResPostBlock``).
It is also the order that keeps inference consistent: inverted dropout is unbiased,
``E[dropout(y)] = y``, so the expected training-time branch is the evaluation-time branch;
``LN_out(dropout(h))`` would instead renormalise a masked vector (different mean and
variance than ``h``), so the branch seen in training would differ systematically from the
one used at inference. And it keeps fairseq's rule for every placement here: dropout is the
last thing applied to the branch before the add. (Some reviews describe Peri-LN as an LN on
the *sum* after the add; that is Post-LN plus an input LN, not the paper's formula.)

**Mix-LN's boundary.** Layers are numbered ``0 .. L-1`` from the stack's input; layer ``l``
is Post-LN iff ``l < floor(alpha * L)`` (the paper: Post-LN for the first ``floor(alpha L)``
layers, Pre-LN for the last ``ceil((1 - alpha) L)``; the authors' code,
github.com/pixeli99/MixLN ``modeling_llama.py``, tests ``layer_index < max_post_norm_layer``).
All sub-layers of a layer share its placement, and each stack (encoder, decoder) counts its
own ``L``. Nothing is inserted at the boundary: the last Post-LN layer outputs a normalised
stream ``LN(h + F(h))`` and the first Pre-LN layer adds to it, ``x + F(LN(x))``, as in the
authors' code. **Final LN:** after a Pre-LN layer the stream is an unnormalised sum, so
the stack keeps the Pre-LN final LayerNorm whenever it has at least one Pre-LN layer
(``floor(alpha L) < L``); with ``alpha = 1`` (all Post-LN) it has none, so that ``alpha =
1`` is exactly fairseq's Post-LN and ``alpha = 0`` exactly its Pre-LN. (The authors'
LLaMA code applies LLaMA's final norm in every mode, its all-Post-LN baseline included; in
fairseq a Post-LN stack has no final LN, and matching the two endpoints exactly is the
point of this rule.) ``floor(alpha L)`` is computed so that decimal alphas give what their
decimal value gives (0.7 * 10 = 7, 0.29 * 100 = 29; :func:`mix_ln_post_layers`).

Nothing here reads a tensor value on the host; the functions branch on strings and
``None`` only.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

__all__ = [
    "PLACEMENTS",
    "LAYER_PLACEMENTS",
    "MIX_LN_ALPHA",
    "SublayerNorms",
    "Sublayer",
    "check_placement",
    "check_mix_ln_alpha",
    "mix_ln_post_layers",
    "layer_placements",
    "stack_final_norm",
    "sublayer_norms",
    "sublayer_residual",
    "reference_stack",
]

#: the placements, in the order of the table above
PLACEMENTS = ("post-ln", "pre-ln", "peri-ln", "mix-ln")

#: what a single layer can be (``mix-ln`` is a per-stack mixture of the first two)
LAYER_PLACEMENTS = ("post-ln", "pre-ln", "peri-ln")

#: Mix-LN's default fraction of Post-LN layers per stack (the value the paper uses)
MIX_LN_ALPHA = 0.25

#: relative distance from an integer within which ``alpha * L`` counts as that integer
_INT_TOL = 1e-9


def check_placement(placement, allowed: Sequence[str] = PLACEMENTS) -> str:
    """Return ``placement`` if it is one of ``allowed``; otherwise a one-line ValueError."""
    if not isinstance(placement, str) or placement not in allowed:
        choices = ", ".join(repr(p) for p in allowed)
        raise ValueError(f"LayerNorm placement must be one of {choices}; got {placement!r}")
    return placement


def _check_layers(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"num_layers must be a positive int (the layers of one stack); "
                         f"got {value!r}")
    return int(value)


def check_mix_ln_alpha(alpha) -> float:
    """Return ``alpha`` as a float if it is a number in ``[0, 1]``; otherwise raise a
    one-line ``ValueError`` naming ``--mix-ln-alpha`` and the valid range (NaN, infinities,
    bools and non-numbers included)."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) \
            or not 0.0 <= float(alpha) <= 1.0:  # False for NaN
        raise ValueError(f"--mix-ln-alpha must be a number in [0, 1] (the fraction of each "
                         f"stack's layers that use Post-LN); got {alpha!r}")
    return float(alpha)


def mix_ln_post_layers(num_layers: int, alpha: float = MIX_LN_ALPHA) -> int:
    r"""Mix-LN's number of Post-LN layers in a stack of ``num_layers``: ``floor(alpha * L)``.

    Layers ``0 .. k-1`` are Post-LN and ``k .. L-1`` Pre-LN, ``k`` the value returned; 0 for
    ``alpha = 0`` (all Pre-LN), ``L`` for ``alpha = 1`` (all Post-LN). With the default 0.25:
    L = 1, 3 -> 0; 4, 6 -> 1; 12 -> 3; 24 -> 6. A product within a relative 1e-9 of an
    integer counts as that integer, so binary rounding of a decimal alpha does not move the
    boundary (0.7 * 10 is 7.000000000000001 and 0.29 * 100 is 28.999999999999996 in floating
    point; both give what a person expects, 7 and 29).

    Raises a one-line ``ValueError`` for ``alpha`` outside ``[0, 1]`` (naming
    ``--mix-ln-alpha``) or a ``num_layers`` that is not a positive int.
    """
    n = _check_layers(num_layers)
    product = check_mix_ln_alpha(alpha) * n
    nearest = round(product)
    if abs(product - nearest) <= _INT_TOL * max(1.0, product):
        return int(nearest)
    return int(math.floor(product))


def layer_placements(placement: str, num_layers: int,
                     alpha: float = MIX_LN_ALPHA) -> List[str]:
    """Each layer's own placement (one of :data:`LAYER_PLACEMENTS`), from the stack's input.

    ``post-ln``, ``pre-ln``, ``peri-ln``: that placement for every layer (``alpha`` is not
    used and not checked). ``mix-ln``: ``"post-ln"`` for the first
    :func:`mix_ln_post_layers` ``(num_layers, alpha)`` layers, ``"pre-ln"`` for the rest.
    """
    check_placement(placement)
    n = _check_layers(num_layers)
    if placement != "mix-ln":
        return [placement] * n
    k = mix_ln_post_layers(n, alpha)
    return ["post-ln"] * k + ["pre-ln"] * (n - k)


def stack_final_norm(placement: str, num_layers: int, alpha: float = MIX_LN_ALPHA) -> bool:
    """Whether a stack of ``num_layers`` ends with a LayerNorm (fairseq's ``layer_norm`` of
    the encoder/decoder): ``post-ln`` no; ``pre-ln``, ``peri-ln`` yes; ``mix-ln`` yes iff at
    least one layer is Pre-LN, i.e. ``mix_ln_post_layers(num_layers, alpha) < num_layers``
    (module docstring, "Final LN")."""
    check_placement(placement)
    n = _check_layers(num_layers)
    if placement == "mix-ln":
        return mix_ln_post_layers(n, alpha) < n
    return placement != "post-ln"


class SublayerNorms(NamedTuple):
    """Which LayerNorms a residual sub-layer of a given layer placement has."""

    #: the sub-layer's own LN: on the input (pre-ln, peri-ln) or on the sum (post-ln)
    norm: bool
    #: Peri-LN's LN on the sub-layer output, before dropout and the add
    out_norm: bool


_SUBLAYER_NORMS = {
    "post-ln": SublayerNorms(norm=True, out_norm=False),
    "pre-ln": SublayerNorms(norm=True, out_norm=False),
    "peri-ln": SublayerNorms(norm=True, out_norm=True),
}


def sublayer_norms(layer_placement: str) -> SublayerNorms:
    """The LayerNorms one sub-layer has under ``layer_placement`` (a layer's placement, one
    of :data:`LAYER_PLACEMENTS`; for ``mix-ln`` ask per layer via :func:`layer_placements`):
    every placement has the sub-layer's own ``norm``, Peri-LN also an ``out_norm``."""
    return _SUBLAYER_NORMS[check_placement(layer_placement, LAYER_PLACEMENTS)]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _add(x: torch.Tensor, f_x: torch.Tensor) -> torch.Tensor:
    return x + f_x


def sublayer_residual(
    x: torch.Tensor,
    f: Callable[[torch.Tensor], torch.Tensor],
    layer_placement: str,
    norm: Callable[[torch.Tensor], torch.Tensor],
    out_norm: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    *,
    dropout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    residual: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    r"""One residual sub-layer under ``layer_placement`` (one of :data:`LAYER_PLACEMENTS`)::

        post-ln:  norm(residual(x, dropout(f(x))))
        pre-ln:   residual(x, dropout(f(norm(x))))
        peri-ln:  residual(x, dropout(out_norm(f(norm(x)))))

    ``x``: the sub-layer input ``(*, C)``; ``f``: the sub-layer (attention or FFN) as a
    function of its ``(*, C)`` input returning ``(*, C)``; ``norm``: the sub-layer's own
    LayerNorm/DyT; ``out_norm``: Peri-LN's output LayerNorm/DyT, required for ``peri-ln`` and
    refused otherwise. ``dropout`` (default: none) is applied to the branch output, last,
    right before the add (module docstring, "Peri-LN and dropout"); ``residual(x, f_x)``
    (default ``x + f_x``) is the sum, e.g. an Admin ``OmegaResidual`` or DeepNorm residual
    module. Returns ``(*, C)``. For ``mix-ln`` call it with each layer's placement from
    :func:`layer_placements`.
    """
    check_placement(layer_placement, LAYER_PLACEMENTS)
    if norm is None:
        raise ValueError(f"{layer_placement} needs the sub-layer's LayerNorm (norm)")
    if (out_norm is not None) != (layer_placement == "peri-ln"):
        raise ValueError("out_norm (the LayerNorm on the sub-layer output) is "
                         + ("required for peri-ln" if out_norm is None
                            else f"Peri-LN's alone; {layer_placement} has none"))
    dropout = _identity if dropout is None else dropout
    residual = _add if residual is None else residual
    if layer_placement == "post-ln":
        return norm(residual(x, dropout(f(x))))
    if layer_placement == "pre-ln":
        return residual(x, dropout(f(norm(x))))
    return residual(x, dropout(out_norm(f(norm(x)))))


class Sublayer(NamedTuple):
    """One residual sub-layer of :func:`reference_stack`: the function ``f`` and its
    LayerNorms (``out_norm`` only under Peri-LN), as :func:`sublayer_residual` takes them."""

    f: Callable[[torch.Tensor], torch.Tensor]
    norm: Callable[[torch.Tensor], torch.Tensor]
    out_norm: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def reference_stack(
    x: torch.Tensor,
    layers: Sequence[Sequence[Sublayer]],
    placement: str,
    *,
    mix_ln_alpha: float = MIX_LN_ALPHA,
    final_norm: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    dropout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    residual: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    r"""A whole stack under ``placement`` (one of :data:`PLACEMENTS`), for tests: layer
    ``l`` (a sequence of :class:`Sublayer`, e.g. self-attention then FFN) runs each of its
    sub-layers through :func:`sublayer_residual` with the layer's placement from
    :func:`layer_placements` ``(placement, len(layers), mix_ln_alpha)``, and the result goes
    through ``final_norm`` when :func:`stack_final_norm` says the stack has one.
    ``final_norm`` must be given exactly then (a ``ValueError`` otherwise), as must each
    sub-layer's ``out_norm`` exactly under Peri-LN. Embedding, positions and the
    embedding's dropout are the caller's. ``x``: ``(*, C)`` -> ``(*, C)``.
    """
    per_layer = layer_placements(placement, len(layers), mix_ln_alpha)
    has_final = stack_final_norm(placement, len(layers), mix_ln_alpha)
    if has_final != (final_norm is not None):
        raise ValueError(f"a {placement} stack of {len(layers)} layers "
                         + ("ends with a LayerNorm: pass final_norm" if has_final
                            else "has no final LayerNorm: final_norm must be None"))
    for layer, layer_placement in zip(layers, per_layer):
        for sub in layer:
            x = sublayer_residual(x, sub.f, layer_placement, sub.norm, sub.out_norm,
                                  dropout=dropout, residual=residual)
    return final_norm(x) if has_final else x
