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

Each sub-layer's branch ``dropout(f(x))`` is a method of its own (``_self_attn_branch``,
``_encoder_attn_branch``, ``_ffn_branch``), and each stack runs its layers in
``forward_layers``. Peri-LN's LayerNorm on a branch output (``*_out_layer_norm``, None in
every other placement; :mod:`fairseq_admin_pos.models.norm_layers` adds them) is applied at
the end of its branch, before the branch's dropout. The two schemes that change how a
layer combines the branches
(:mod:`fairseq_admin_pos.models.b2t_resi_dual`) are two switches of the one layer forward
here, off for every other scheme: ``bottom_to_top`` (B2T: the layer input added into the sum
that the layer's last LayerNorm normalises) and the keyword ``dual`` (ResiDual: every branch
output also added to a float32 dual stream, returned after the layer's usual outputs).

The stacks that run these layers are in :mod:`fairseq_admin_pos.models.host_sync_free`.
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

from fairseq_admin_pos.speed.compile import compiled_forward

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


def _add_to_dual(dual: Optional[Tensor], f: Tensor) -> Optional[Tensor]:
    # ResiDual's d + f, in d's dtype (float32: a low-precision f is widened inside the add,
    # no copy); no dual stream (every other scheme): nothing to add
    return None if dual is None else torch.add(dual, f)


class AdminTransformerEncoderLayer(TransformerEncoderLayerBase):
    """fairseq encoder layer with a residual module per sub-layer.

    Post-LN: ``x = LN(res(x, dropout(f(x))))`` for f in (self-attention, FFN).
    Pre-LN:  ``x = res(x, dropout(f(LN(x))))`` (only with omega == 1, checked by the model).
    Peri-LN: ``x = res(x, dropout(LN_out(f(LN(x)))))`` (``*_out_layer_norm`` set).
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
        # Peri-LN's LayerNorms on the branch outputs (models/norm_layers.py)
        self.self_attn_out_layer_norm: Optional[nn.Module] = None
        self.ffn_out_layer_norm: Optional[nn.Module] = None
        if not sublayer_layer_norm:
            _drop_sublayer_layer_norms(self)

    #: B2T's bottom-to-top term (:mod:`fairseq_admin_pos.models.b2t_resi_dual`): the layer
    #: input added into the sum that the last LayerNorm normalises
    bottom_to_top: bool = False

    def forward(self, *args, **kwargs):
        """:meth:`forward_eager`, compiled in training when ``--admin-compile layers``
        (:mod:`fairseq_admin_pos.speed.compile`)."""
        compiled = compiled_forward(self)
        if compiled is not None:
            return compiled(self, *args, **kwargs)
        return self.forward_eager(*args, **kwargs)

    def forward_eager(
        self,
        x,
        encoder_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor] = None,
        *,
        dual: Optional[Tensor] = None,
    ):
        """Returns ``x`` (``(x, fc_result)`` with ``return_fc``); given ResiDual's dual
        stream ``dual`` (float32 ``(T, B, C)``), each branch output is also added to it and
        the updated ``dual`` follows ``x`` in a flat tuple."""
        attn_mask = self._attention_mask(attn_mask, x)
        bottom = x

        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x = self._self_attn_branch(x, encoder_padding_mask, attn_mask)
        dual = _add_to_dual(dual, x)
        x = self.self_attn_residual(residual, x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x, fc_result = self._ffn_branch(x)
        dual = _add_to_dual(dual, x)
        x = self.final_residual(residual, x)
        if self.bottom_to_top:
            x = x + bottom
        if not self.normalize_before:
            x = self.final_layer_norm(x)

        return_fc = self.return_fc and not torch.jit.is_scripting()
        if dual is None:
            return (x, fc_result) if return_fc else x
        return (x, dual, fc_result) if return_fc else (x, dual)

    # -- the branches f(x), shared with the layers of other schemes (b2t_resi_dual.py) ----
    @staticmethod
    def _attention_mask(attn_mask: Optional[Tensor], x: Tensor) -> Optional[Tensor]:
        if attn_mask is None:
            return None
        # fairseq's convention: 1 = masked; -1e8 not -inf so fully masked rows stay finite
        return attn_mask.masked_fill(
            attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4
        )

    def _self_attn_branch(self, x, encoder_padding_mask: Optional[Tensor],
                          attn_mask: Optional[Tensor]) -> Tensor:
        """``dropout(SelfAttn(x))``, ``(T, B, C)``."""
        x, _ = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=encoder_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
        )
        if self.self_attn_out_layer_norm is not None:  # Peri-LN
            x = self.self_attn_out_layer_norm(x)
        return self.dropout_module(x)

    def _ffn_branch(self, x):
        """``(dropout(FFN(x)), FFN(x))``: the branch and fairseq's ``fc_result`` (before
        dropout and Peri-LN's output LayerNorm), both ``(T, B, C)``."""
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        if self.ffn_out_layer_norm is not None:  # Peri-LN
            return self.dropout_module(self.ffn_out_layer_norm(x)), x
        return self.dropout_module(x), x


class AdminTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq decoder layer with a residual module per sub-layer.

    Post-LN: ``x = LN(res(x, dropout(f(x))))`` for f in (masked self-attention,
    encoder-attention, FFN); Pre-LN and Peri-LN as in the encoder layer;
    ``sublayer_layer_norm=False`` (ReZero) makes the LNs identities. Incremental decoding works as in fairseq: the residual modules
    are position-wise, so a single step sees exactly what a full forward sees at that step.

    Shapes: ``x`` is ``(T_tgt, B, C)``, ``encoder_out`` ``(T_src, B, C_enc)``.
    """

    #: B2T's bottom-to-top term, as in the encoder layer
    bottom_to_top: bool = False

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
        # Peri-LN's LayerNorms on the branch outputs (models/norm_layers.py)
        self.self_attn_out_layer_norm: Optional[nn.Module] = None
        self.encoder_attn_out_layer_norm: Optional[nn.Module] = None
        self.ffn_out_layer_norm: Optional[nn.Module] = None
        if not sublayer_layer_norm:
            _drop_sublayer_layer_norms(self)

    def forward(self, *args, **kwargs):
        """:meth:`forward_eager`, compiled in training when ``--admin-compile layers``
        (:mod:`fairseq_admin_pos.speed.compile`)."""
        compiled = compiled_forward(self)
        if compiled is not None:
            return compiled(self, *args, **kwargs)
        return self.forward_eager(*args, **kwargs)

    def forward_eager(
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
        *,
        dual: Optional[Tensor] = None,
    ):
        """fairseq's ``(x, attn, self_attn_state)``; given ResiDual's dual stream ``dual``
        (float32 ``(T_tgt, B, C)``), each branch output is also added to it and the updated
        ``dual`` is returned fourth."""
        if need_head_weights:
            need_attn = True
        bottom = x

        # --- masked self-attention -------------------------------------------------
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, attn = self._self_attn_branch(
            x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
            self_attn_mask, self_attn_padding_mask,
        )
        dual = _add_to_dual(dual, x)
        x = self.self_attn_residual(residual, x)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        # --- encoder-decoder attention ---------------------------------------------
        if self.encoder_attn is not None and encoder_out is not None:
            residual = x
            if self.normalize_before:
                x = self.encoder_attn_layer_norm(x)
            x, attn = self._encoder_attn_branch(
                x, encoder_out, encoder_padding_mask, incremental_state, prev_attn_state,
                need_attn, need_head_weights,
            )
            dual = _add_to_dual(dual, x)
            x = self.encoder_attn_residual(residual, x)
            if not self.normalize_before:
                x = self.encoder_attn_layer_norm(x)

        # --- feed-forward -----------------------------------------------------------
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self._ffn_branch(x)
        dual = _add_to_dual(dual, x)
        if self.w_resid is not None:  # NormFormer's learned residual weight
            residual = torch.mul(self.w_resid, residual)
        x = self.final_residual(residual, x)
        if self.bottom_to_top:
            x = x + bottom
        if not self.normalize_before:
            x = self.final_layer_norm(x)

        out = self._layer_output(x, attn, incremental_state, self_attn_padding_mask)
        return out if dual is None else out + (dual,)

    # -- the branches f(x), shared with the layers of other schemes (b2t_resi_dual.py) ----
    def _self_attn_branch(
        self,
        x,
        encoder_out: Optional[Tensor],
        encoder_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
        prev_self_attn_state: Optional[List[Tensor]],
        self_attn_mask: Optional[Tensor],
        self_attn_padding_mask: Optional[Tensor],
    ):
        """``(dropout(SelfAttn(x)), attn)``: masked self-attention (cross+self-attention with
        ``--cross-self-attention``), NormFormer's head scales and LN when configured."""
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
        if self.self_attn_out_layer_norm is not None:  # Peri-LN
            x = self.self_attn_out_layer_norm(x)
        return self.dropout_module(x), attn

    def _encoder_attn_branch(
        self,
        x,
        encoder_out: Optional[Tensor],
        encoder_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
        prev_attn_state: Optional[List[Tensor]],
        need_attn: bool,
        need_head_weights: bool,
    ):
        """``(dropout(CrossAttn(x, encoder_out)), attention weights or None)``."""
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
        if self.encoder_attn_out_layer_norm is not None:  # Peri-LN
            x = self.encoder_attn_out_layer_norm(x)
        return self.dropout_module(x), attn

    def _ffn_branch(self, x) -> Tensor:
        """``dropout(FFN(x))`` (NormFormer's FFN LayerNorm when configured)."""
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = self.fc2(x)
        if self.ffn_out_layer_norm is not None:  # Peri-LN
            x = self.ffn_out_layer_norm(x)
        return self.dropout_module(x)

    def _layer_output(self, x, attn, incremental_state, self_attn_padding_mask):
        """fairseq's return value ``(x, attn, self-attention state for ONNX or None)``."""
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
