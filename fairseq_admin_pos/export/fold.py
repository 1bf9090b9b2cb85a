r"""Fold the package's residual weights into a stock fairseq Transformer (pure torch).

This module never imports fairseq. It maps the state dict of an ``admin_transformer`` onto
the parameters of fairseq's ``transformer`` (same key names, fairseq's layout, see
:func:`fold_state_dict`) so that the stock model computes the same function. The fairseq
side (checkpoints, configuration, CTranslate2) is :mod:`fairseq_admin_pos.export.checkpoint`.

Notation: a Post-LN sub-layer of the package computes ``y = LN(w * x + f(x))`` (Admin's
omega, DeepNorm's alpha; Liu et al. 2020, Wang et al. 2022) or ``y = LN(x + a * f(x))``
(ReZero with LayerNorm, Bachlechner et al. 2020), where ``x`` is the sub-layer input, ``f``
the branch (self-attention, cross-attention or FFN; dropout is the identity at inference)
and ``LN_eps(z) = g * (z - mean(z)) / sqrt(var(z) + eps) + b`` over the ``C`` channels.
fairseq's layer computes ``LN(x + f(x))``.

1. **Branch weight a (rezero-post-ln), exact.** ``f`` ends in a Linear (attention
   ``out_proj``, FFN ``fc2``): ``a * f(x)`` is ``f`` with that Linear's weight and bias
   multiplied by ``a``.

2. **Scalar shortcut weight w > 0 (omega buffer: closed form, profiled, ``none``; DeepNorm's
   alpha).** ``LN_eps(w x + f) = LN_eps(w (x + f / w))``, and for a scalar ``w > 0``
   ``mean(w v) = w mean(v)``, ``var(w v) = w^2 var(v)``, so

       LN_eps(w v) = g * (v - mean v) / sqrt(var v + eps / w^2) + b = LN_{eps/w^2}(v).

   Folding ``1 / w`` into ``out_proj`` / ``fc2`` (weight and bias) gives ``v = x + f / w``
   exactly (``scalar_fold="input"`` folds a scalar w as in section 3 instead: exact, at the
   price of section 3's per-side tables). fairseq's LayerNorm has a fixed ``eps`` (1e-5,
   not stored in the checkpoint), so the stock model computes ``LN_eps(v)`` instead of
   ``LN_{eps/w^2}(v)``: its normalised part is the exact one times

       r = sqrt((var v + eps / w^2) / (var v + eps))

   per token, a relative error

       delta = 1 - r = 1 - sqrt(1 - u),   u = eps (1 - 1/w^2) / (var v + eps),
       |delta| = |u| / 2 + O(u^2)  ~  eps |1 - 1/w^2| / (2 var v),

   where ``var v`` is the variance over channels of the normalised sum of the *exported*
   model (``var v = var(w x + f) / w^2``). In a Post-LN stack ``x`` is a LayerNorm output
   (var about mean(g^2), about 1) and ``f / w`` adds to it, so with eps = 1e-5 each affected
   LayerNorm is off by about 5e-6 * (1 - 1/w^2) / var v relative, a few 1e-6 (for w > 1 the
   stock output is that much smaller; for w < 1, larger). Pads, whose stream is near zero,
   see more, but nothing reads them (attention masks them). :func:`eps_relative_error` gives
   delta; ``tests/test_export_fold.py`` measures it per LayerNorm and end to end
   (log-probabilities), and shows that patching each such LayerNorm's eps to ``eps / w^2``
   makes the export exact. w = 1 (Post-LN, Pre-LN, ``O(n)``) is exact.

3. **Vector shortcut weight w (``--admin-omega parameter``), exact.** LayerNorm does not
   absorb a per-channel scale, so ``w * x`` is folded into whatever produced ``x`` and
   ``1 / w`` into every place the branch reads ``x``:

   * the producer is the previous sub-layer's LayerNorm: ``g <- w * g``, ``b <- w * b``;
   * the branch reads ``x`` through its input projections: self-attention ``q``, ``k``,
     ``v``; cross-attention ``q`` only (its ``k``, ``v`` read the encoder output); FFN
     ``fc1``: the weight's input columns are divided, ``W[:, j] <- W[:, j] / w_j``;
   * for a stack's first sub-layer ``x`` is the embedding output
     ``embed_scale * E[token] + P[position]`` (encoder pads zeroed afterwards; fairseq's
     ``make_positions``: non-pad tokens numbered ``padding_idx + 1, ...``, pads
     ``padding_idx``, whose row is zero). Both terms are row lookups, so ``w * x`` is
     ``embed_scale * (E * w)[token] + (P * w)[position]``: each side gets its own token
     table ``E * w`` (a shared table is un-shared: ``share_all_embeddings`` and
     ``share_decoder_input_output_embed`` are dropped, the output projection keeps the
     original ``E``) and its positions become a learned table ``P * w`` of
     ``max_positions + padding_idx + 1`` rows (fairseq's learned layout), ``P`` being
     fairseq's sinusoid, the scaled sinusoid (table times its learned scalar) or the learned
     table; with ``--layernorm-embedding`` that LayerNorm is the producer instead.

   The LayerNorm sees exactly its original input, so no eps term appears (only float32
   rounding).

4. **Positions** (without a vector fold at the embedding): ``sinusoidal`` stays fairseq's
   sinusoid, ``scaled-sinusoidal`` becomes the learned table ``table * scale`` (the same
   lookup, :class:`fairseq_admin_pos.models.positions.ScaledSinusoidalPositions` uses
   fairseq's learned layout), ``learned`` stays, ``none`` on both sides is fairseq's
   ``--no-token-positional-embeddings``; ``none`` on one side only becomes an all-zero
   learned table on that side (fairseq's flag would remove both sides' positions).

5. **Pre-LN** (``x + f(LN(x))``, only with omega = 1) and Post-LN with omega = 1 are stock
   layers already (only the names change).

Refused (:data:`REFUSED`): ``rezero`` (no sub-layer LayerNorm), ``b2t`` (a connection that
skips a sub-layer), ``resi-dual`` (a second residual stream), ``peri-ln`` (a LayerNorm on
each branch output), ``mix-ln`` (two placements in one stack); any ``--admin-norm dyt`` model
(:data:`REFUSED_NORMS`: DyT is no LayerNorm); and a Pre-LN stack whose omega is not 1 (its
shortcut is not normalised, so neither fold applies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from fairseq_admin_pos.positional import SinusoidalEmbeddings

__all__ = [
    "REFUSED",
    "REFUSED_NORMS",
    "NotExportable",
    "StackLayout",
    "ModelLayout",
    "FoldResult",
    "SUBLAYERS",
    "Sublayer",
    "eps_relative_error",
    "fairseq_sinusoid_table",
    "fold_state_dict",
]

#: fairseq's LayerNorm eps (``fairseq.modules.LayerNorm``: torch's default, 1e-5)
LAYER_NORM_EPS = 1e-5

#: schemes with no stock equivalent -> why (the CLI prints it)
REFUSED = {
    "rezero": "ReZero (x + a * f(x)) has no sub-layer LayerNorm, and every layer of fairseq's "
              "transformer normalises each sub-layer",
    "b2t": "B2T adds each layer's input into the layer's last LayerNorm (LN(h + f(h) + x)), "
           "a connection that skips a sub-layer, which fairseq's transformer layers do not have",
    "resi-dual": "ResiDual carries a second (dual) residual stream d + f(x) and ends each stack "
                 "with x_N + LN(d_N), which fairseq's transformer does not have",
    "peri-ln": "Peri-LN normalises each sub-layer's output too (x + LN(f(LN(x)))), a LayerNorm "
               "fairseq's transformer layers do not have",
    "mix-ln": "Mix-LN mixes Post-LN and Pre-LN layers within a stack, and fairseq's "
              "transformer has one placement (--encoder/--decoder-normalize-before) per stack",
}

#: normalisation modules (``--admin-norm``) with no stock equivalent -> why
REFUSED_NORMS = {
    "dyt": "DyT (g * tanh(alpha x) + b) is no LayerNorm, and fairseq's transformer (and "
           "CTranslate2) normalises with LayerNorm only",
}

#: the plugin's residual schemes that fold into fairseq's layers
EXPORTABLE = ("admin", "deepnorm", "rezero-post-ln")


class NotExportable(ValueError):
    """The model has no stock fairseq ``transformer`` equivalent; the message says why."""


@dataclass(frozen=True)
class StackLayout:
    """What the fold needs to know about one stack (``side`` = ``encoder`` or ``decoder``).

    ``positions``: ``sinusoidal``, ``scaled-sinusoidal``, ``learned`` or ``none``;
    ``max_positions``: ``--max-source-positions`` / ``--max-target-positions``;
    ``cross_attention``: the decoder's layers have encoder attention.
    """

    side: str
    layers: int
    embed_dim: int
    padding_idx: int
    max_positions: int
    positions: str
    normalize_before: bool = False
    cross_attention: bool = False
    layernorm_embedding: bool = False


@dataclass(frozen=True)
class ModelLayout:
    """The whole model: the residual scheme (``--admin-residual``), the normalisation module
    (``--admin-norm``) and the two stacks."""

    scheme: str
    encoder: StackLayout
    decoder: StackLayout
    share_all_embeddings: bool = False
    share_decoder_input_output_embed: bool = False
    norm: str = "layernorm"

    def stacks(self) -> Tuple[StackLayout, StackLayout]:
        return (self.encoder, self.decoder)


@dataclass
class FoldResult:
    """The stock state dict and what the stock configuration must say.

    ``positions``: per side, ``sinusoidal`` | ``learned`` | ``none`` (fairseq's three);
    ``unshared``: the token tables were folded per side, so the export drops
    ``share_all_embeddings`` / ``share_decoder_input_output_embed``;
    ``eps_scales``: LayerNorm key prefix -> the scalar ``w`` folded through it (the
    LayerNorms whose exact eps would be ``eps / w^2``, section 2; ``w != 1`` only);
    ``folds``: one line per kind of fold done, for the log.
    """

    state_dict: Dict[str, Tensor]
    positions: Dict[str, str]
    unshared: bool
    eps_scales: Dict[str, float] = field(default_factory=dict)
    folds: List[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True when no LayerNorm's eps term changed (everything else is float32 rounding)."""
        return not self.eps_scales


def eps_relative_error(var: Tensor, w: float, eps: float = LAYER_NORM_EPS) -> Tensor:
    """``delta = 1 - sqrt((var + eps / w^2) / (var + eps))``: the relative error of the
    normalised part of ``LN_eps(v)`` against the exact ``LN_{eps/w^2}(v)`` for a token whose
    channel variance is ``var`` (section 2 of the module docstring); first order
    ``eps (1 - 1/w^2) / (2 var)``. ``var``: any shape; returns the same shape (float64)."""
    var = torch.as_tensor(var, dtype=torch.float64)
    return 1.0 - torch.sqrt((var + eps / w ** 2) / (var + eps))


def fairseq_sinusoid_table(num_positions: int, dim: int, padding_idx: int) -> Tensor:
    """fairseq's ``SinusoidalPositionalEmbedding`` table for ``max_positions =
    num_positions``: ``num_positions + padding_idx + 1`` rows (row ``p`` is the sinusoid of
    ``p``, row ``padding_idx`` zero), ``[sin | cos]`` halves, float32 (the layout
    ``fairseq_admin_pos.positional`` reproduces bitwise)."""
    rows = num_positions + padding_idx + 1
    table = SinusoidalEmbeddings.position_encoding_init(rows, dim, "fairseq").clone()
    table[padding_idx] = 0
    return table


class Sublayer(NamedTuple):
    """One residual sub-layer of a layer, by its module names under the layer."""

    residual: str  #: the residual module holding the shortcut weight (omega/alpha)
    norm: str  #: the LayerNorm after the residual sum (Post-LN)
    out: str  #: the branch's output Linear
    inputs: Tuple[str, ...]  #: the branch's input projections that read the sub-layer input


#: per layer, in execution order
SUBLAYERS = {
    "encoder": (
        Sublayer("self_attn_residual", "self_attn_layer_norm", "self_attn.out_proj",
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Sublayer("final_residual", "final_layer_norm", "fc2", ("fc1",)),
    ),
    "decoder": (
        Sublayer("self_attn_residual", "self_attn_layer_norm", "self_attn.out_proj",
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Sublayer("encoder_attn_residual", "encoder_attn_layer_norm", "encoder_attn.out_proj",
                 ("encoder_attn.q_proj",)),
        Sublayer("final_residual", "final_layer_norm", "fc2", ("fc1",)),
    ),
}

#: the plugin's keys that stock fairseq does not have (besides the residual modules)
_PLUGIN_KEYS = ("_extra_state", "admin_profiled")

#: where a scalar shortcut weight goes: ``output`` = 1/w into out_proj/fc2 (section 2,
#: exact up to the eps term, the model keeps its shared tables and sinusoid); ``input`` =
#: as a vector (section 3: exact, per-side tables, learned positions)
SCALAR_FOLDS = ("output", "input")


@dataclass(frozen=True)
class _Shortcut:
    """The residual weight of one sub-layer, taken out of the state dict."""

    layer: str  #: the layer's key prefix, e.g. ``encoder.layers.3.``
    sublayer: Sublayer
    kind: str  #: ``omega`` (shortcut weight w) or ``alpha`` (ReZero's branch weight a)
    weight: Tensor  #: float32, one element (a scalar) or one per channel (a vector)

    @property
    def residual_key(self) -> str:
        return self.layer + self.sublayer.residual

    @property
    def norm_key(self) -> str:
        return self.layer + self.sublayer.norm

    @property
    def is_vector(self) -> bool:
        return self.weight.numel() > 1

    @property
    def scalar(self) -> float:
        return float(self.weight.reshape(-1)[0])


@dataclass
class _Positions:
    """Per side: the position table as fairseq's learned layout (None: no positions) and the
    kind fairseq will be told (``sinusoidal``, ``learned`` or ``none``)."""

    tables: Dict[str, Optional[Tensor]]
    kinds: Dict[str, str]


def _sublayers(stack: StackLayout):
    for sub in SUBLAYERS[stack.side]:
        if sub.residual == "encoder_attn_residual" and not stack.cross_attention:
            continue
        yield sub


def _residual_weight(sd: Dict[str, Tensor], prefix: str) -> Tuple[str, Tensor]:
    for kind in ("omega", "alpha"):
        if prefix + kind in sd:
            return kind, sd[prefix + kind].detach().to(torch.float32)
    raise KeyError(f"no residual weight under {prefix}(omega|alpha) in the state dict")


def _check_scheme(layout: ModelLayout) -> None:
    if layout.scheme in REFUSED:
        raise NotExportable(
            f"--admin-residual {layout.scheme} cannot be exported to a stock fairseq "
            f"transformer: {REFUSED[layout.scheme]}"
        )
    if layout.scheme not in EXPORTABLE:
        raise NotExportable(f"unknown --admin-residual {layout.scheme!r}; exportable: "
                            f"{', '.join(EXPORTABLE)}")
    if layout.norm in REFUSED_NORMS:
        raise NotExportable(
            f"--admin-norm {layout.norm} cannot be exported to a stock fairseq transformer: "
            f"{REFUSED_NORMS[layout.norm]}"
        )
    if layout.norm != "layernorm":
        raise NotExportable(f"unknown --admin-norm {layout.norm!r}; exportable: layernorm")


def _scale_out(sd, key: str, scale: float) -> None:
    # a Linear's output (weight rows and bias) times a scalar
    for p in ("weight", "bias"):
        if f"{key}.{p}" in sd:
            sd[f"{key}.{p}"] = sd[f"{key}.{p}"] * scale


def _divide_inputs(sd, key: str, w: Tensor) -> None:
    # W x' with x' = w * x: W[:, j] / w_j reads x' and computes W x
    sd[f"{key}.weight"] = sd[f"{key}.weight"] / w.to(sd[f"{key}.weight"].dtype)


def _scale_norm(sd, key: str, w: Tensor) -> None:
    for p in ("weight", "bias"):
        sd[f"{key}.{p}"] = sd[f"{key}.{p}"] * w.to(sd[f"{key}.{p}"].dtype)


def _position_table(sd, stack: StackLayout) -> Optional[Tensor]:
    """The stack's positions as fairseq's learned table (None for ``none``), before any
    fold; removes the plugin's keys of scaled-sinusoid positions."""
    pre = f"{stack.side}.embed_positions."
    if stack.positions == "none":
        return None
    if stack.positions == "learned":
        return sd[pre + "weight"]
    if stack.positions == "sinusoidal":
        return fairseq_sinusoid_table(stack.max_positions, stack.embed_dim, stack.padding_idx)
    if stack.positions == "scaled-sinusoidal":
        table = sd.pop(pre + "embed.embedding.weight")
        scale = sd.pop(pre + "embed.scaling")
        return table * scale.to(table.dtype)
    raise ValueError(f"unknown {stack.side} positions {stack.positions!r}")


# -- the steps of fold_state_dict, in the order it runs them ---------------------------------


def _stock_copy(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """A copy of ``state_dict`` (tensors cloned) without the plugin's own keys."""
    return {k: (v.detach().clone() if isinstance(v, Tensor) else v)
            for k, v in state_dict.items() if k not in _PLUGIN_KEYS}


def _take_shortcuts(sd, stack: StackLayout, scalar_fold: str) -> List[_Shortcut]:
    """The residual weights of every sub-layer of ``stack`` in execution order, removed from
    ``sd``. An untrained vector (all ones) becomes a scalar 1 (nothing to fold); with
    ``scalar_fold="input"`` a Post-LN scalar omega other than 1 becomes a vector."""
    shortcuts = []
    for i in range(stack.layers):
        layer = f"{stack.side}.layers.{i}."
        for sub in _sublayers(stack):
            kind, value = _residual_weight(sd, f"{layer}{sub.residual}.")
            del sd[f"{layer}{sub.residual}.{kind}"]
            if value.numel() > 1 and bool((value == 1).all()):
                value = value.reshape(-1)[:1]
            if (kind == "omega" and value.numel() == 1 and scalar_fold == "input"
                    and not stack.normalize_before and float(value) != 1.0):
                value = value.reshape(1).expand(stack.embed_dim)
            shortcuts.append(_Shortcut(layer=layer, sublayer=sub, kind=kind, weight=value))
    return shortcuts


def _start_positions(sd, layout: ModelLayout) -> _Positions:
    """Each side's position table before any fold, and its kind for fairseq (a scaled
    sinusoid becomes a learned table, section 4)."""
    tables, kinds = {}, {}
    for stack in layout.stacks():
        tables[stack.side] = _position_table(sd, stack)
        kinds[stack.side] = {"scaled-sinusoidal": "learned"}.get(stack.positions,
                                                                  stack.positions)
    return _Positions(tables=tables, kinds=kinds)


def _check_pre_ln(stack: StackLayout, shortcuts: List[_Shortcut]) -> None:
    """A Pre-LN stack is a stock stack when every shortcut weight is 1 (section 5)."""
    bad = [s for s in shortcuts if not bool((s.weight == 1).all())]
    if bad:
        raise NotExportable(
            f"the Pre-LN {stack.side} has shortcut weights other than 1 (first: "
            f"{bad[0].residual_key}): a Pre-LN shortcut is not normalised, so no fold into "
            "fairseq's layers exists"
        )


def _fold_scalar(sd, shortcut: _Shortcut, eps_scales: Dict[str, float]) -> None:
    """Section 2: 1/w into the branch output; the LayerNorm after it is listed in
    ``eps_scales`` when w != 1."""
    w = shortcut.scalar
    if not w > 0 or not math.isfinite(w):
        raise NotExportable(
            f"{shortcut.residual_key}.omega is {w}: the scalar fold "
            "LN(w x + f) = LN(x + f / w) needs w > 0"
        )
    if w != 1.0:
        _scale_out(sd, shortcut.layer + shortcut.sublayer.out, 1.0 / w)
        eps_scales[shortcut.norm_key] = w


def _fold_vector(sd, stack: StackLayout, shortcut: _Shortcut, producer: Optional[_Shortcut],
                 positions: _Positions) -> None:
    """Section 3: w into whatever produced the sub-layer input (the LayerNorm of the
    ``producer`` sub-layer, else the embedding's LayerNorm, else the token and position
    tables), 1/w into the branch's input projections."""
    w = shortcut.weight
    if producer is not None:
        _scale_norm(sd, producer.norm_key, w)
    elif stack.layernorm_embedding:
        _scale_norm(sd, f"{stack.side}.layernorm_embedding", w)
    else:
        tok = f"{stack.side}.embed_tokens.weight"
        sd[tok] = sd[tok] * w.to(sd[tok].dtype)
        table = positions.tables[stack.side]
        if table is not None:
            positions.tables[stack.side] = table * w.to(table.dtype)
            positions.kinds[stack.side] = "learned"
    for key in shortcut.sublayer.inputs:
        _divide_inputs(sd, shortcut.layer + key, w)


def _fold_stack(sd, stack: StackLayout, shortcuts: List[_Shortcut], positions: _Positions,
                eps_scales: Dict[str, float]) -> None:
    """Fold every shortcut weight of one stack into its stock parameters, in execution
    order (a vector fold scales the LayerNorm of the sub-layer before it)."""
    if stack.normalize_before:
        _check_pre_ln(stack, shortcuts)
        return
    for idx, shortcut in enumerate(shortcuts):
        if shortcut.kind == "alpha":  # section 1: a * f(x), exact
            _scale_out(sd, shortcut.layer + shortcut.sublayer.out, shortcut.scalar)
        elif not shortcut.is_vector:
            _fold_scalar(sd, shortcut, eps_scales)
        else:
            _fold_vector(sd, stack, shortcut, shortcuts[idx - 1] if idx > 0 else None,
                         positions)


def _keep_output_projection(sd, state_dict, layout: ModelLayout, vector: bool,
                            folds: List[str]) -> bool:
    """After a vector fold into the token tables, the output projection keeps the original
    table under its own key (the tables are un-shared); returns whether they were."""
    unshared = vector and not any(s.layernorm_embedding for s in layout.stacks())
    if unshared:
        # fairseq saves a tied output_projection.weight under its own key; an untied one is
        # its own anyway
        original = state_dict.get("decoder.output_projection.weight")
        if original is None:
            original = state_dict["decoder.embed_tokens.weight"]
        sd["decoder.output_projection.weight"] = original.detach().clone()
        folds.append("shortcut weights w folded into the LayerNorms before them, the token "
                     "tables (one per side) and positions, 1/w into q/k/v/fc1 (exact)")
    elif vector:
        folds.append("shortcut weights w folded into the LayerNorms before them and "
                     "layernorm_embedding, 1/w into q/k/v/fc1 (exact)")
    return unshared


def _store_positions(sd, layout: ModelLayout, positions: _Positions, none_as_zero_table: bool,
                     vector: bool, folds: List[str]) -> None:
    """Write each learned table into the state dict. A side without positions gets an
    all-zero learned table when the other side has positions (or ``none_as_zero_table``)."""
    kinds = positions.kinds
    if "none" in kinds.values() and (none_as_zero_table or set(kinds.values()) != {"none"}):
        for stack in layout.stacks():
            if kinds[stack.side] == "none":
                rows = stack.max_positions + stack.padding_idx + 1
                positions.tables[stack.side] = torch.zeros(
                    rows, stack.embed_dim, dtype=sd[f"{stack.side}.embed_tokens.weight"].dtype)
                kinds[stack.side] = "learned"
                folds.append(f"{stack.side} positions none -> an all-zero learned table")
    for stack in layout.stacks():
        if kinds[stack.side] == "learned":
            table = positions.tables[stack.side]
            sd[f"{stack.side}.embed_positions.weight"] = table.detach().clone().contiguous()
        if stack.positions == "scaled-sinusoidal" and not vector:
            folds.append(f"{stack.side} scaled-sinusoid positions -> learned table "
                         "(table x scale)")


def _scalar_summary(shortcuts: List[_Shortcut], eps_scales: Dict[str, float]) -> List[str]:
    """The log lines of the scalar folds (ReZero's a; 1/w into the branch outputs)."""
    lines = []
    if any(s.kind == "alpha" for s in shortcuts):
        lines.append("ReZero's a folded into out_proj/fc2 (exact)")
    if eps_scales:
        ws = sorted(eps_scales.values())
        lines.append(f"scalar omega 1/w folded into out_proj/fc2 of {len(ws)} sub-layers "
                     f"(w in [{ws[0]:.4g}, {ws[-1]:.4g}]; exact up to the LayerNorm eps, "
                     "fairseq_admin_pos.export.fold section 2)")
    return lines


def fold_state_dict(state_dict: Dict[str, Tensor], layout: ModelLayout,
                    none_as_zero_table: bool = False, scalar_fold: str = "output"
                    ) -> FoldResult:
    """The state dict of fairseq's ``transformer`` computing what the ``admin_transformer``
    with ``state_dict`` and ``layout`` computes (module docstring: exact up to float32
    rounding, or up to the LayerNorm eps term of section 2, listed in ``eps_scales``).

    Raises :class:`NotExportable` (a message naming the scheme and why) for
    :data:`REFUSED` schemes, :data:`REFUSED_NORMS` normalisations, a Pre-LN stack with
    omega != 1, and a scalar shortcut weight that is not positive. ``state_dict`` is not
    modified. ``none_as_zero_table``: a side without positions gets an all-zero learned
    table even when the other side has none too (CTranslate2's converter refuses
    ``--no-token-positional-embeddings``). ``scalar_fold``: :data:`SCALAR_FOLDS`.
    """
    _check_scheme(layout)
    if scalar_fold not in SCALAR_FOLDS:
        raise ValueError(f"scalar_fold must be one of {', '.join(SCALAR_FOLDS)}; got "
                         f"{scalar_fold!r}")
    sd = _stock_copy(state_dict)
    shortcuts = {stack.side: _take_shortcuts(sd, stack, scalar_fold)
                 for stack in layout.stacks()}
    every = [s for stack in layout.stacks() for s in shortcuts[stack.side]]
    vector = any(s.is_vector for s in every)
    positions = _start_positions(sd, layout)
    eps_scales: Dict[str, float] = {}
    for stack in layout.stacks():
        _fold_stack(sd, stack, shortcuts[stack.side], positions, eps_scales)
    folds: List[str] = []
    unshared = _keep_output_projection(sd, state_dict, layout, vector, folds)
    _store_positions(sd, layout, positions, none_as_zero_table, vector, folds)
    folds += _scalar_summary(every, eps_scales)
    return FoldResult(state_dict=sd, positions=positions.kinds, unshared=unshared,
                      eps_scales=eps_scales, folds=folds)
