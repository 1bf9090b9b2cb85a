r"""Peri-LN, Mix-LN and DyT inside fairseq's layers: where each LayerNorm sits, and what it is.

Two orthogonal choices (fairseq glue over the pure-torch :mod:`fairseq_admin_pos.placements`
and :mod:`fairseq_admin_pos.norms`, which hold the formulas, the papers and the per-stack
rules):

* **placement** of a stack's LayerNorms, one of ``placements.PLACEMENTS``: ``post-ln``
  (fairseq's default, ``LN(x + f(x))``), ``pre-ln`` (``--*-normalize-before``, ``x +
  f(LN(x))``), ``peri-ln`` (``--admin-residual peri-ln``, ``x + dropout(LN_out(F(LN(x))))``)
  or ``mix-ln`` (``--admin-residual mix-ln``: Post-LN in the first ``floor(alpha L)`` layers of
  the stack, Pre-LN above, ``--mix-ln-alpha``);
* **module** of every normalisation, ``--admin-norm``: ``layernorm`` (fairseq's
  ``LayerNorm``) or ``dyt`` (:class:`fairseq_admin_pos.norms.DynamicTanh`, ``g * tanh(a x) +
  b``, ``a`` from ``--dyt-alpha-init``).

What this does to fairseq's layers and stacks (:class:`StackNorms` describes one stack; the
model builds one per stack from its flags):

* a Post-LN or Pre-LN layer is fairseq's layer with ``normalize_before`` False or True (its
  forward in :mod:`fairseq_admin_pos.models.layers` reads that per layer, so a Mix-LN stack
  is fairseq's layers with the flag set layer by layer);
* a Peri-LN layer is a Pre-LN layer plus one LayerNorm per sub-layer on the branch output,
  applied before the branch's dropout: ``self_attn_out_layer_norm``,
  ``encoder_attn_out_layer_norm`` (decoder) and ``ffn_out_layer_norm`` (:data:`OUT_NORMS`;
  the layers' branch methods apply them when present);
* the stack ends with fairseq's final ``layer_norm`` iff
  :func:`fairseq_admin_pos.placements.stack_final_norm` says so (Peri-LN: always; Mix-LN: iff
  at least one layer is Pre-LN, so alpha = 1 is exactly Post-LN and alpha = 0 exactly Pre-LN):
  :func:`stack_config` hands fairseq a configuration whose ``normalize_before`` is that
  answer, and fairseq builds the LayerNorm itself;
* with ``dyt``, every normalisation module of the model is a DyT: the sub-layer LayerNorms,
  Peri-LN's output ones, the stacks' final ones, and fairseq's optional
  ``--layernorm-embedding`` and NormFormer (``--scale-attn``, ``--scale-fc``) LayerNorms
  (:data:`LAYER_NORMS`, :data:`STACK_NORMS`). They keep their names (``weight``, ``bias``,
  plus DyT's ``alpha``).

Random numbers: neither LayerNorm nor DyT draws any when built, and every module added or
replaced here is built after fairseq's own, so a Peri-LN, Mix-LN or DyT model has, for the
same seed, exactly the embedding, attention and FFN weights of the Post-LN / Pre-LN model
(``--admin-residual mix-ln --mix-ln-alpha 0`` *is* the Pre-LN model, parameter for
parameter; the tests check it).
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import List, Optional

import torch.nn as nn

from fairseq.modules import LayerNorm

from fairseq_admin_pos.norms import DYT_ALPHA_INIT, check_norm_kind, make_norm
from fairseq_admin_pos.placements import (
    MIX_LN_ALPHA,
    check_placement,
    layer_placements,
    stack_final_norm,
    sublayer_norms,
)

#: the ``--admin-residual`` choices that are LayerNorm placements (plain shortcut ``x + f``)
PLACEMENT_SCHEMES = ("peri-ln", "mix-ln")

#: a layer's sub-layer LayerNorm -> Peri-LN's LayerNorm on that sub-layer's branch output
OUT_NORMS = {
    "self_attn_layer_norm": "self_attn_out_layer_norm",
    "encoder_attn_layer_norm": "encoder_attn_out_layer_norm",
    "final_layer_norm": "ffn_out_layer_norm",
}

#: the normalisation modules fairseq builds in a layer (``--admin-norm dyt`` replaces each one
#: present): the sub-layer LayerNorms, NormFormer's ``attn_ln`` (``--scale-attn``) and
#: ``ffn_layernorm`` (``--scale-fc``). Peri-LN's output ones are built of the right kind.
LAYER_NORMS = (*OUT_NORMS, "attn_ln", "ffn_layernorm")

#: the stack's own: the final LayerNorm and ``--layernorm-embedding``'s
STACK_NORMS = ("layer_norm", "layernorm_embedding")


@dataclass(frozen=True)
class StackNorms:
    """The LayerNorm placement and normalisation module of one stack (encoder or decoder).

    ``placement``: one of ``placements.PLACEMENTS``; ``num_layers``: the stack's layers;
    ``kind``: ``--admin-norm`` (``layernorm`` or ``dyt``); ``mix_ln_alpha``: Mix-LN's
    fraction of Post-LN layers (read for ``mix-ln`` only); ``dyt_alpha_init``: DyT's initial
    ``alpha`` (read for ``dyt`` only); ``export``: fairseq's ``--export`` (its LayerNorm
    factory's TorchScript switch).
    """

    placement: str
    num_layers: int
    kind: str = "layernorm"
    mix_ln_alpha: float = MIX_LN_ALPHA
    dyt_alpha_init: float = DYT_ALPHA_INIT
    export: bool = False

    def __post_init__(self):
        check_placement(self.placement)
        check_norm_kind(self.kind)

    def layer_placements(self) -> List[str]:
        """Each layer's own placement (``post-ln``, ``pre-ln`` or ``peri-ln``), bottom up."""
        if self.num_layers == 0:
            return []
        return layer_placements(self.placement, self.num_layers, self.mix_ln_alpha)

    def final_norm(self) -> bool:
        """Whether the stack ends with a LayerNorm (``placements.stack_final_norm``; a stack
        without layers keeps the final LayerNorm of Pre-LN and Peri-LN, as fairseq's Pre-LN
        does, and Mix-LN refuses 0 layers when the flags are checked)."""
        if self.num_layers == 0:
            return self.placement in ("pre-ln", "peri-ln")
        return stack_final_norm(self.placement, self.num_layers, self.mix_ln_alpha)

    def make(self, dim: int) -> nn.Module:
        """One normalisation module over ``dim`` channels: fairseq's ``LayerNorm`` (exactly
        what fairseq builds) or a :class:`~fairseq_admin_pos.norms.DynamicTanh`."""
        return make_norm(self.kind, dim, dyt_alpha_init=self.dyt_alpha_init,
                         layer_norm=functools.partial(LayerNorm, export=self.export))


def stack_config(cfg, side: str, norms: StackNorms):
    """The configuration fairseq builds the ``side`` stack from: ``cfg`` itself, or for
    Peri-LN and Mix-LN a copy whose ``<side>.normalize_before`` is
    :meth:`StackNorms.final_norm` (fairseq builds the stack's final LayerNorm iff that flag is
    set; each layer's own placement is set afterwards by :func:`configure_layer`)."""
    if norms.placement not in PLACEMENT_SCHEMES:
        return cfg
    cfg = copy.deepcopy(cfg)
    getattr(cfg, side).normalize_before = norms.final_norm()
    return cfg


def _dim(module: nn.Module) -> int:
    # LayerNorm and DyT both carry their channel shape
    return int(module.normalized_shape[-1])


def configure_layer(layer: nn.Module, norms: StackNorms, index: int) -> nn.Module:
    """Give layer ``index`` (0 = the stack's bottom) of a freshly built fairseq layer its
    placement and normalisation modules (module docstring): ``normalize_before`` per layer for
    Peri-LN/Mix-LN, Peri-LN's output LayerNorms, and DyT in place of every LayerNorm. Other
    schemes' layers are returned untouched under ``layernorm``."""
    if norms.placement in PLACEMENT_SCHEMES:
        placement = norms.layer_placements()[index]
        layer.normalize_before = placement != "post-ln"
        if sublayer_norms(placement).out_norm:
            for name, out_name in OUT_NORMS.items():
                if isinstance(getattr(layer, name, None), nn.Module):
                    setattr(layer, out_name, norms.make(layer.embed_dim))
    if norms.kind != "layernorm":
        _replace(layer, LAYER_NORMS, norms)
    return layer


def configure_stack(stack: nn.Module, norms: StackNorms) -> None:
    """DyT in place of the stack's own LayerNorms (its final one and ``--layernorm-embedding``'s)
    under ``--admin-norm dyt``; nothing otherwise."""
    if norms.kind != "layernorm":
        _replace(stack, STACK_NORMS, norms)


def _replace(module: nn.Module, names, norms: StackNorms) -> None:
    for name in names:
        old: Optional[nn.Module] = getattr(module, name, None)
        if isinstance(old, nn.Module) and not isinstance(old, nn.Identity):
            setattr(module, name, norms.make(_dim(old)))
