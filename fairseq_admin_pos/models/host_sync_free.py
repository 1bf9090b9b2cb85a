"""fairseq's encoder and decoder stacks without reads back to the host.

:class:`HostSyncFreeEncoderBase` and :class:`HostSyncFreeDecoderBase` are fairseq's encoder
and decoder without the two places where fairseq reads a tensor back to the host in
every forward (``encoder_padding_mask.any()``, tested again before every encoder layer, and
``prev_output_tokens.eq(pad).any()`` in the decoder). On an accelerator each such read waits
for all queued kernels, so the host can no longer run ahead; here the padding masks are
always passed instead (fairseq's own choice on XLA), which gives the same numbers.

Their layer loops are ``forward_layers`` methods, which the schemes that combine branches
differently (:mod:`fairseq_admin_pos.models.b2t_resi_dual`) replace.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase

from fairseq_admin_pos.collapse import token_cosine


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

        x, prev_output_tokens = self.embed_target(prev_output_tokens, incremental_state)

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

    def embed_target(
        self,
        prev_output_tokens,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> Tuple[Tensor, Tensor]:
        """fairseq's decoder input, unchanged: scaled token embeddings plus positions
        (the last step's only when decoding incrementally), ``(B, T, C)``, and the tokens
        that were embedded (``(B, 1)`` when incremental)."""
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

        return x, prev_output_tokens

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
