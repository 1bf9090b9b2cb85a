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

The stacks (:class:`HostSyncFreeEncoderBase`, :class:`HostSyncFreeDecoderBase`) are fairseq's
encoder and decoder without the two places where fairseq reads a tensor back to the host in
every forward (``encoder_padding_mask.any()``, tested again before every encoder layer, and
``prev_output_tokens.eq(pad).any()`` in the decoder). On an accelerator each such read waits
for all queued kernels, so the host can no longer run ahead; here the padding masks are
always passed instead (fairseq's own choice on XLA), which gives the same numbers.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from fairseq_admin_pos.collapse import token_cosine
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


# --------------------------------------------------------------------------------------- #
# the stacks, without host reads
# --------------------------------------------------------------------------------------- #
class HostSyncFreeEncoderBase(TransformerEncoderBase):
    """fairseq's ``TransformerEncoderBase`` whose forward never reads a tensor back to the host.

    fairseq computes ``has_pads = encoder_padding_mask.any()`` and passes the mask to each
    layer only ``if has_pads``: one device-to-host read per layer on an accelerator. Here
    the mask ``(B, T)`` (True at pads) is always passed, as fairseq itself does on XLA. The
    results are the same: a mask without pads adds 0 to every attention score, and the
    embedding is multiplied by ``1 - mask`` as before (by 1 everywhere without pads).
    Everything else is fairseq's ``forward_scriptable`` (0.12.3), unchanged, its layer loop
    moved into :meth:`forward_layers`.

    Shapes: ``src_tokens`` ``(B, T)``; ``encoder_out`` ``[(T, B, C)]``.

    In training forwards the stack records ``last_token_cos``, the encoder token cosine of
    its output (:func:`fairseq_admin_pos.collapse.token_cosine`, a 0-dim tensor never read on
    the host here), which the training monitor logs as ``enc_tok_cos``.
    """

    last_token_cos: Optional[Tensor] = None

    def forward_scriptable(
        self,
        src_tokens,
        src_lengths: Optional[torch.Tensor] = None,
        return_all_hiddens: bool = False,
        token_embeddings: Optional[torch.Tensor] = None,
    ):
        encoder_padding_mask = src_tokens.eq(self.padding_idx)

        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)

        # account for padding while computing the representation
        x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        encoder_states = []
        fc_results = []

        if return_all_hiddens:
            encoder_states.append(x)

        x = self.forward_layers(x, encoder_padding_mask, return_all_hiddens, encoder_states,
                                fc_results)

        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.training and not torch.jit.is_scripting():
            # what the decoder's cross-attention reads; ~1 = a collapsed encoder
            self.last_token_cos = token_cosine(x, encoder_padding_mask)

        src_lengths = (
            src_tokens.ne(self.padding_idx)
            .sum(dim=1, dtype=torch.int32)
            .reshape(-1, 1)
            .contiguous()
        )
        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "encoder_states": encoder_states,  # List[T x B x C]
            "fc_results": fc_results,  # List[T x B x C]
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }

    def forward_layers(self, x, encoder_padding_mask, return_all_hiddens: bool,
                       encoder_states: List[Tensor], fc_results: List[Optional[Tensor]]):
        """The layers on the embedding output ``x`` ``(T, B, C)``: fairseq's loop (states
        appended when ``return_all_hiddens``). A scheme that carries more than ``x`` from
        layer to layer (ResiDual's dual stream) overrides this."""
        for layer in self.layers:
            lr = layer(x, encoder_padding_mask=encoder_padding_mask)

            if isinstance(lr, tuple) and len(lr) == 2:
                x, fc_result = lr
            else:
                x = lr
                fc_result = None

            if return_all_hiddens and not torch.jit.is_scripting():
                assert encoder_states is not None
                encoder_states.append(x)
                fc_results.append(fc_result)
        return x


class HostSyncFreeDecoderBase(TransformerDecoderBase):
    """fairseq's ``TransformerDecoderBase`` whose forward never reads a tensor back to the host.

    fairseq builds the self-attention padding mask only ``if
    prev_output_tokens.eq(pad).any()``: a device-to-host read in every training forward and
    every decoding step. Here:

    * full forward (training, scoring): the mask ``(B, T)`` is always passed, which gives the
      same numbers (a mask without pads adds 0 to the scores);
    * incremental decoding: no mask. Each step feeds the one token generated last, which
      fairseq's generators never make a pad (they set its log-probability to -inf), so
      fairseq's check is always False there. A caller that feeds pads step by step would
      have them attended to, where fairseq would mask them.

    Everything else is fairseq's ``extract_features_scriptable`` (0.12.3), unchanged, its
    layer loop moved into :meth:`forward_layers`.

    Shapes: ``prev_output_tokens`` ``(B, T)``; features ``(B, T, C)``.
    """

    def extract_features_scriptable(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        bs, slen = prev_output_tokens.size()
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1

        enc: Optional[Tensor] = None
        padding_mask: Optional[Tensor] = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        # embed positions
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(
                prev_output_tokens, incremental_state=incremental_state
            )

        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]

        # Prevent torchscript exporting issue for dynamic quant embedding
        prev_output_tokens = prev_output_tokens.contiguous()
        # embed tokens and positions
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)

        if self.quant_noise is not None:
            x = self.quant_noise(x)

        if self.project_in_dim is not None:
            x = self.project_in_dim(x)

        if positions is not None:
            x += positions

        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)

        x = self.dropout_module(x)

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        # the one change: no `.any()` read (see the class docstring)
        self_attn_padding_mask: Optional[Tensor] = None
        if self.cross_self_attention or incremental_state is None:
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)

        x, attn, inner_states = self.forward_layers(
            x, enc, padding_mask, incremental_state, self_attn_padding_mask,
            full_context_alignment, alignment_layer,
        )

        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:alignment_heads]

            # average probabilities over heads
            attn = attn.mean(dim=0)

        if self.layer_norm is not None:
            x = self.layer_norm(x)

        # T x B x C -> B x T x C
        x = x.transpose(0, 1)

        if self.project_out_dim is not None:
            x = self.project_out_dim(x)

        return x, {"attn": [attn], "inner_states": inner_states}

    def forward_layers(
        self,
        x,
        enc: Optional[Tensor],
        padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]],
        self_attn_padding_mask: Optional[Tensor],
        full_context_alignment: bool,
        alignment_layer: int,
    ):
        """The layers on the embedding output ``x`` ``(T, B, C)``: fairseq's loop. Returns
        ``(x, attention of alignment_layer or None, inner states)``. A scheme that carries
        more than ``x`` from layer to layer (ResiDual's dual stream) overrides this."""
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for idx, layer in enumerate(self.layers):
            if incremental_state is None and not full_context_alignment:
                self_attn_mask = self.buffered_future_mask(x)
            else:
                self_attn_mask = None

            x, layer_attn, _ = layer(
                x,
                enc,
                padding_mask,
                incremental_state,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
                need_attn=bool((idx == alignment_layer)),
                need_head_weights=bool((idx == alignment_layer)),
            )
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        return x, attn, inner_states
