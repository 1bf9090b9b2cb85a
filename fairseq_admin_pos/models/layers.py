"""Transformer layers whose every residual sub-layer goes through a residual module.

Stock fairseq computes each post-LN sub-layer as ``LN(residual + dropout(f(x)))`` through
``residual_connection(x, residual)``, which cannot tell which sub-layer calls it. These
subclasses keep fairseq's parameters, names and order (so the same seed gives the same
weights) and route each sub-layer through its own residual module:

    encoder layer:  self_attn_residual, final_residual                   (2 sub-layers)
    decoder layer:  self_attn_residual, encoder_attn_residual, final_residual   (3, or 2
                    without encoder attention)

A residual module is called as ``residual_module(x, f_x)`` with ``x`` the sub-layer input
(the shortcut) and ``f_x`` the dropped-out branch output, both ``(T, B, C)``. With
:class:`fairseq_admin_pos.admin.OmegaResidual` this is Admin's ``x * omega + f_x``; with
omega == 1 as a buffer it is bit-for-bit fairseq's ``x + f_x``. Because the residual modules
are ordinary submodules, forward hooks on them see every sub-layer's shortcut and branch
in execution order, which is what the profiling initialisation uses. The residual schemes
of :mod:`fairseq_admin_pos.schemes` (DeepNorm, ReZero) are residual modules too; ReZero
without LayerNorm also builds the layers with ``sublayer_layer_norm=False``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

# (embed_dim) -> residual module; built by the model from its flags.
ResidualFactory = Callable[[int], nn.Module]

#: the per-sub-layer LayerNorms of fairseq's layers (encoder: 2, decoder: 3)
SUBLAYER_LAYER_NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")


def _drop_sublayer_layer_norms(layer: nn.Module) -> None:
    # ReZero without LayerNorm (``--admin-residual rezero``): the sub-layer LNs become
    # identities *after* fairseq built them. LayerNorm init draws no random numbers, so the
    # other weights are the same as with LNs, and the forward code stays the same.
    for name in SUBLAYER_LAYER_NORMS:
        if getattr(layer, name, None) is not None:
            setattr(layer, name, nn.Identity())


class AdminTransformerEncoderLayer(TransformerEncoderLayerBase):
    """fairseq encoder layer with a residual module per sub-layer.

    Post-LN: ``x = LN(res(x, dropout(f(x))))`` for f in (self-attention, FFN).
    Pre-LN:  ``x = res(x, dropout(f(LN(x))))`` (only with omega == 1, checked by the model).
    ``sublayer_layer_norm=False`` (ReZero): ``x = res(x, dropout(f(x)))``, LNs are identities.

    Shapes: ``x`` is ``(T, B, C)``, ``encoder_padding_mask`` ``(B, T)`` with True at pads.
    """

    def __init__(
        self,
        cfg,
        residual_factory: ResidualFactory,
        return_fc: bool = False,
        sublayer_layer_norm: bool = True,
    ):
        super().__init__(cfg, return_fc=return_fc)
        self.self_attn_residual = residual_factory(self.embed_dim)
        self.final_residual = residual_factory(self.embed_dim)
        if not sublayer_layer_norm:
            _drop_sublayer_layer_norms(self)

    def forward(
        self,
        x,
        encoder_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor] = None,
    ):
        if attn_mask is not None:
            # fairseq's convention: 1 = masked; -1e8 not -inf so fully masked rows stay finite
            attn_mask = attn_mask.masked_fill(
                attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4
            )

        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=encoder_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
        )
        x = self.dropout_module(x)
        x = self.self_attn_residual(residual, x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        fc_result = x
        x = self.dropout_module(x)
        x = self.final_residual(residual, x)
        if not self.normalize_before:
            x = self.final_layer_norm(x)

        if self.return_fc and not torch.jit.is_scripting():
            return x, fc_result
        return x


class AdminTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq decoder layer with a residual module per sub-layer.

    Post-LN: ``x = LN(res(x, dropout(f(x))))`` for f in (masked self-attention,
    encoder-attention, FFN); ``sublayer_layer_norm=False`` (ReZero) makes the LNs
    identities. Incremental decoding works as in fairseq: the residual modules
    are position-wise, so a single step sees exactly what a full forward sees at that step.

    Shapes: ``x`` is ``(T_tgt, B, C)``, ``encoder_out`` ``(T_src, B, C_enc)``.
    """

    def __init__(
        self,
        cfg,
        residual_factory: ResidualFactory,
        no_encoder_attn: bool = False,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        sublayer_layer_norm: bool = True,
    ):
        super().__init__(
            cfg,
            no_encoder_attn=no_encoder_attn,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
        )
        self.self_attn_residual = residual_factory(self.embed_dim)
        self.encoder_attn_residual = (
            residual_factory(self.embed_dim) if self.encoder_attn is not None else None
        )
        self.final_residual = residual_factory(self.embed_dim)
        if not sublayer_layer_norm:
            _drop_sublayer_layer_norms(self)

    def forward(
        self,
        x,
        encoder_out: Optional[torch.Tensor] = None,
        encoder_padding_mask: Optional[torch.Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        prev_self_attn_state: Optional[List[torch.Tensor]] = None,
        prev_attn_state: Optional[List[torch.Tensor]] = None,
        self_attn_mask: Optional[torch.Tensor] = None,
        self_attn_padding_mask: Optional[torch.Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
    ):
        if need_head_weights:
            need_attn = True

        # --- masked self-attention -------------------------------------------------
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        if prev_self_attn_state is not None:
            self._restore_state(self.self_attn, incremental_state, prev_self_attn_state)
        _self_attn_input_buffer = self.self_attn._get_input_buffer(incremental_state)
        if self.cross_self_attention and not (
            incremental_state is not None
            and _self_attn_input_buffer is not None
            and "prev_key" in _self_attn_input_buffer
        ):
            if self_attn_mask is not None:
                assert encoder_out is not None
                self_attn_mask = torch.cat(
                    (x.new_zeros(x.size(0), encoder_out.size(0)), self_attn_mask), dim=1
                )
            if self_attn_padding_mask is not None:
                if encoder_padding_mask is None:
                    assert encoder_out is not None
                    encoder_padding_mask = self_attn_padding_mask.new_zeros(
                        encoder_out.size(1), encoder_out.size(0)
                    )
                self_attn_padding_mask = torch.cat(
                    (encoder_padding_mask, self_attn_padding_mask), dim=1
                )
            assert encoder_out is not None
            y = torch.cat((encoder_out, x), dim=0)
        else:
            y = x

        x, attn = self.self_attn(
            query=x,
            key=y,
            value=y,
            key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state,
            need_weights=False,
            attn_mask=self_attn_mask,
        )
        if self.c_attn is not None:
            tgt_len, bsz = x.size(0), x.size(1)
            x = x.view(tgt_len, bsz, self.nh, self.head_dim)
            x = torch.einsum("tbhd,h->tbhd", x, self.c_attn)
            x = x.reshape(tgt_len, bsz, self.embed_dim)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        x = self.dropout_module(x)
        x = self.self_attn_residual(residual, x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        # --- encoder-decoder attention ---------------------------------------------
        if self.encoder_attn is not None and encoder_out is not None:
            residual = x
            if self.normalize_before:
                x = self.encoder_attn_layer_norm(x)
            if prev_attn_state is not None:
                self._restore_state(self.encoder_attn, incremental_state, prev_attn_state)
            x, attn = self.encoder_attn(
                query=x,
                key=encoder_out,
                value=encoder_out,
                key_padding_mask=encoder_padding_mask,
                incremental_state=incremental_state,
                static_kv=True,
                need_weights=need_attn or (not self.training and self.need_attn),
                need_head_weights=need_head_weights,
            )
            x = self.dropout_module(x)
            x = self.encoder_attn_residual(residual, x)
            if not self.normalize_before:
                x = self.encoder_attn_layer_norm(x)

        # --- feed-forward -----------------------------------------------------------
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = self.fc2(x)
        x = self.dropout_module(x)
        if self.w_resid is not None:  # NormFormer's learned residual weight
            residual = torch.mul(self.w_resid, residual)
        x = self.final_residual(residual, x)
        if not self.normalize_before:
            x = self.final_layer_norm(x)

        if self.onnx_trace and incremental_state is not None:
            saved_state = self.self_attn._get_input_buffer(incremental_state)
            assert saved_state is not None
            keys = ["prev_key", "prev_value"]
            if self_attn_padding_mask is not None:
                keys.append("prev_key_padding_mask")
            return x, attn, [saved_state[k] for k in keys]
        return x, attn, None

    @staticmethod
    def _restore_state(attn_module, incremental_state, prev_state: List[torch.Tensor]):
        saved_state: Dict[str, Optional[Tensor]] = {
            "prev_key": prev_state[0],
            "prev_value": prev_state[1],
        }
        if len(prev_state) >= 3:
            saved_state["prev_key_padding_mask"] = prev_state[2]
        assert incremental_state is not None
        attn_module._set_input_buffer(incremental_state, saved_state)
