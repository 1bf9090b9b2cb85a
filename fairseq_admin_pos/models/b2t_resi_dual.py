r"""B2T connection and ResiDual: the two rivals of Admin that change a whole layer or stack.

``--admin-residual b2t`` and ``--admin-residual resi-dual`` (:mod:`fairseq_admin_pos.schemes`
lists every scheme). Both keep Post-LN's sub-layers ``LN(x + f(x))`` with fairseq's
parameters, names and order; what they add cannot be written as one residual module per
sub-layer, so their layers (and ResiDual's stacks) are here. ``f`` is a sub-layer's
dropped-out branch, computed by the branch methods of
:mod:`fairseq_admin_pos.models.layers` (the same code as every other scheme); the sub-layer
shortcuts ``x + f`` go through the layers' residual modules (omega = 1), so the analysis tool
and hooks see them like every other scheme's.

**B2T connection** (Takase, Kiyono, Kobayashi, Suzuki, "B2T Connection: Serving Stability
and Performance in Deep Transformers", Findings of ACL 2023, arXiv 2206.00330; code
takase/b2t_connection, a fairseq fork, ``fairseq/modules/transformer_layer.py`` with
``--residual-bottom-to-top``). With ``x`` the layer input::

    encoder layer   h  = LN1(x + f_attn(x))
                    y  = LN2(h + f_ffn(h) + x)
    decoder layer   h1 = LN1(x + f_self(x))
                    h2 = LN2(h1 + f_cross(h1, enc))
                    y  = LN3(h2 + f_ffn(h2) + x)

as the authors' code computes it: the bottom-to-top term is the layer input itself (no
dropout, no weight), added in *every* layer of both stacks (the last one included) into the
sum that the layer's last LayerNorm normalises; with ``--no-cross-attention`` the decoder
layer is the encoder's form. Initialisation: every Linear weight of a layer times
``N^(-1/2)``, N the layer count of its stack (the code's ``rescaling_init``, applied with every
B2T run; :func:`fairseq_admin_pos.schemes.b2t_rescale_init_`). The code's other option
(``--no-layer-norm``, a LayerNorm-free variant with its own scales) is not part of ``b2t``.

**ResiDual** (Xie, Zhang, Guo, Tan, Bian, Awadalla, Menezes, Qin, Yan, "ResiDual: Transformer
with Dual Residual Connections", arXiv 2304.14802; code microsoft/ResiDual, a fairseq user
dir, ``resi_dual/resi_dual.py`` and ``resi_dual_layers.py``). Per sub-layer k (2 per encoder
layer, 3 per decoder layer) a Post-LN stream and a Pre-LN-like dual stream::

    x_{k+1} = LN_k(x_k + f_k(x_k))          x_0 = e (the embedding output, after dropout)
    d_{k+1} = d_k + f_k(x_k)                d_0 = e
    stack output  y = x_K + LN_d(d_K)

``f_k(x_k)`` is the same dropped-out branch output in both streams. The repository starts
the dual stream at the embedding output (``res = x * scale``; a commented-out
``torch.zeros_like(x)`` was the alternative), adds ``x_K`` with weight ``enc_alpha`` /
``dec_alpha`` = 1 (all its configurations), and replaces the stack's final LayerNorm by
``LN_d`` with ``eps = 1e-7``; the decoder does the same with its three sub-layers, and
incremental decoding needs no extra state (every operation on the streams is per position).

ResiDual and fp16: the paper (Appendix G.3) notes that ``d_K``, a sum of 2N or 3N branch
outputs, can exceed the float16 range, and the repository multiplies every term of the dual
stream by ``res_input_norm_scale`` (0.05 in its OPUS-100 fp16 run, 1 elsewhere), which
``LN_d`` cancels up to its eps. Here instead the dual stream is always carried in float32
(the branch outputs of a float16/bfloat16 model are added to a float32 ``d``, and ``LN_d``
runs in float32, rounded once to the activation dtype): no overflow, no rounding of a long
sum to 8 (bfloat16) or 11 (float16) bits, and no constant to tune; in float32 models this is
the repository's computation with scale 1. Cost: one float32 ``(T, B, C)`` tensor per stack
alive during the forward (and per layer boundary under ``--checkpoint-activations``, which
saves each layer's inputs).

The ResiDual stacks record ``last_dual_norm`` in training forwards: the mean over real tokens
of ``||d_K||_2`` (before ``LN_d``), a 0-dim float32 tensor, never read on the host here; the
training monitor logs it as ``enc_dual_norm`` / ``dec_dual_norm``
(:mod:`fairseq_admin_pos.models.monitoring`).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairseq_admin_pos.models.layers import (
    AdminTransformerDecoderLayer,
    AdminTransformerEncoderLayer,
)

#: ResiDual's final LayerNorm eps (microsoft/ResiDual: ``LayerNorm(..., eps=1e-7)``)
DUAL_LAYER_NORM_EPS = 1e-7


# --------------------------------------------------------------------------------------- #
# B2T connection
# --------------------------------------------------------------------------------------- #
class B2TEncoderLayer(AdminTransformerEncoderLayer):
    r"""Post-LN encoder layer with B2T's bottom-to-top connection (Takase et al. 2023)::

        h = LN1(x + dropout(SelfAttn(x)))
        y = LN2(h + dropout(FFN(h)) + x)

    ``x`` ``(T, B, C)`` is the layer input, ``encoder_padding_mask`` ``(B, T)`` True at pads;
    returns ``y`` ``(T, B, C)`` (and fairseq's ``fc_result`` with ``return_fc``). The
    sub-layer shortcuts ``h + f`` are the residual modules (omega = 1); the forward is the
    Post-LN layer's with its ``bottom_to_top`` term on.
    """

    bottom_to_top = True


class B2TDecoderLayer(AdminTransformerDecoderLayer):
    r"""Post-LN decoder layer with B2T's bottom-to-top connection (Takase et al. 2023)::

        h1 = LN1(x + dropout(SelfAttn(x)))
        h2 = LN2(h1 + dropout(CrossAttn(h1, enc)))
        y  = LN3(h2 + dropout(FFN(h2)) + x)

    ``x`` ``(T_tgt, B, C)`` is the layer input (one step, ``T_tgt = 1``, when decoding
    incrementally: every term is per position), ``encoder_out`` ``(T_src, B, C)``. Returns
    fairseq's ``(y, attn, None)``.
    """

    bottom_to_top = True


# --------------------------------------------------------------------------------------- #
# ResiDual
# --------------------------------------------------------------------------------------- #
class ResiDualEncoderLayer(AdminTransformerEncoderLayer):
    r"""ResiDual encoder layer (Xie et al. 2023): two Post-LN sub-layers that also add their
    branch outputs to the dual stream ``d``::

        f1 = dropout(SelfAttn(x));  h = LN1(x + f1)
        f2 = dropout(FFN(h));       y = LN2(h + f2)
        d' = d + f1 + f2

    Called as ``layer(x, encoder_padding_mask, dual=d)`` with ``x`` ``(T, B, C)`` and ``d``
    ``(T, B, C)`` float32 (the Post-LN layer's forward with its ``dual`` keyword); returns
    the flat tuple ``(y, d')`` (``(y, d', fc_result)`` with ``return_fc``), which fairseq's
    ``--checkpoint-activations`` wrapper passes through.
    """

    def forward(self, x, encoder_padding_mask: Optional[Tensor],
                attn_mask: Optional[Tensor] = None, *, dual: Tensor):
        # the dual stream is required here (optional in the base layer)
        return super().forward(x, encoder_padding_mask, attn_mask, dual=dual)


class ResiDualDecoderLayer(AdminTransformerDecoderLayer):
    r"""ResiDual decoder layer (Xie et al. 2023): three Post-LN sub-layers (two with
    ``--no-cross-attention``) whose branch outputs also go to the dual stream ``d``::

        h1 = LN1(x + f1),  f1 = dropout(SelfAttn(x))
        h2 = LN2(h1 + f2), f2 = dropout(CrossAttn(h1, enc))
        y  = LN3(h2 + f3), f3 = dropout(FFN(h2))
        d' = d + f1 + f2 + f3

    Called like fairseq's decoder layer plus ``dual=d`` (``(T_tgt, B, C)`` float32; one step
    when decoding incrementally; the Post-LN layer's forward with its ``dual`` keyword);
    returns ``(y, attn, None, d')``.
    """

    def forward(self, x, *args, dual: Tensor, **kwargs):
        # the dual stream is required here (optional in the base layer)
        return super().forward(x, *args, dual=dual, **kwargs)


class Float32LayerNorm(nn.LayerNorm):
    r"""LayerNorm computed in float32 whatever the dtype of its input and weights (a
    ``.half()`` / ``.bfloat16()`` model casts the weights; they are widened here), returning
    float32. ResiDual's ``LN_d`` on the float32 dual stream. Shapes: ``(*, C)`` -> ``(*, C)``.
    """

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                            self.bias.float(), self.eps)


def _token_mean_norm(dual: Tensor, pad_mask: Tensor) -> Tensor:
    """Mean over real tokens of ``||dual[t, b]||_2``; ``dual`` ``(T, B, C)``, ``pad_mask``
    ``(B, T)`` True at pads. A weighted sum, not boolean indexing: no host read."""
    with torch.no_grad():
        norms = torch.linalg.vector_norm(dual.detach().float(), dim=-1)  # (T, B)
        real = (~pad_mask).t().to(norms.dtype)
        return (norms * real).sum() / real.sum().clamp_min(1.0)


class ResiDualStack:
    r"""What the ResiDual encoder and decoder share (a mixin for fairseq's stacks): the final
    ``dual_layer_norm`` ``LN_d`` (float32, eps 1e-7) and ``y = x_K + LN_d(d_K)``, with
    ``d`` carried in float32. ``init_dual(embed_dim)`` must be called by the stack's
    ``__init__`` (LayerNorm init draws no random numbers, so the other weights stay the
    same as without it)."""

    last_dual_norm: Optional[Tensor] = None

    def init_dual(self, embed_dim: int) -> None:
        self.dual_layer_norm = Float32LayerNorm(embed_dim, eps=DUAL_LAYER_NORM_EPS)

    def dual_output(self, x: Tensor, dual: Tensor, pad_mask: Optional[Tensor]) -> Tensor:
        if self.training and pad_mask is not None:
            self.last_dual_norm = _token_mean_norm(dual, pad_mask)
        return x + self.dual_layer_norm(dual).to(x.dtype)


class ResiDualEncoderStack(ResiDualStack):
    """``forward_layers`` of the ResiDual encoder (mixed into ``HostSyncFreeEncoderBase``)."""

    def forward_layers(self, x, encoder_padding_mask, return_all_hiddens: bool,
                       encoder_states: List[Tensor], fc_results: List[Optional[Tensor]]):
        dual = x.float()  # d_0 = the embedding output (padding zeroed, as x)
        for layer in self.layers:
            out = layer(x, encoder_padding_mask=encoder_padding_mask, dual=dual)
            x, dual = out[0], out[1]
            if return_all_hiddens and not torch.jit.is_scripting():
                encoder_states.append(x)
                fc_results.append(out[2] if len(out) == 3 else None)
        return self.dual_output(x, dual, encoder_padding_mask)


class ResiDualDecoderStack(ResiDualStack):
    """``forward_layers`` of the ResiDual decoder (mixed into ``HostSyncFreeDecoderBase``);
    the same per-step computation in incremental decoding."""

    def forward_layers(self, x, enc, padding_mask, incremental_state, self_attn_padding_mask,
                       full_context_alignment: bool, alignment_layer: int):
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        dual = x.float()  # d_0 = the embedding output
        for idx, layer in enumerate(self.layers):
            if incremental_state is None and not full_context_alignment:
                self_attn_mask = self.buffered_future_mask(x)
            else:
                self_attn_mask = None
            x, layer_attn, _, dual = layer(
                x,
                enc,
                padding_mask,
                incremental_state,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
                need_attn=bool((idx == alignment_layer)),
                need_head_weights=bool((idx == alignment_layer)),
                dual=dual,
            )
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        return self.dual_output(x, dual, self_attn_padding_mask), attn, inner_states
