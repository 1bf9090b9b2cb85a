"""``admin_transformer``: fairseq's Transformer with Admin residuals and position choices.

Every residual sub-layer computes ``LN(x * omega + dropout(f(x)))`` (Liu et al. 2020,
"Understanding the Difficulty of Training Transformers", Eq. 6): encoder self-attention and
FFN, decoder self-attention, encoder-attention and FFN, one omega per sub-layer.

omega comes from ``--admin-init``:

* ``closed-form``: ``omega = sqrt(calculate_init(N, --admin-output-change-scale))`` (admin-torch),
  with N the number of residual sub-layers of that stack: ``2 * encoder_layers`` for every
  encoder omega, ``3 * decoder_layers`` for every decoder omega (2 per layer without
  encoder attention);
* ``profile``: Admin's profiling initialisation (the paper's own Admin): omega = 1 until
  just before the first update, when the sub-layer output variances of the first training
  batch are measured the way ``--admin-profile-mode`` says (``clinic``, the default:
  Transformer-Clinic's training-mode pass; ``eval``: dropout-free, over the first
  ``--admin-profile-batches`` batches), summed over data-parallel ranks, the omegas and the
  persistent ``admin_profiled`` flag are set, and training goes on; a profile file given
  with ``--admin-profile-path`` is checked when the model is built. See
  ``models/admin_profile.py`` and ``fairseq_admin_pos/profiling.py``;
* ``none``: omega = 1, which with ``--admin-omega buffer`` is exactly fairseq's ``transformer``
  (same parameters for the same seed, same loss, same translations).

``--admin-omega buffer`` keeps omega a fixed scalar buffer; ``parameter`` makes it a trainable
vector of size ``embed_dim`` (Transformer-Clinic's form).

``--admin-residual`` swaps the residual scheme for Admin's rivals, one flag apart
(formulas, constants and papers in :mod:`fairseq_admin_pos.schemes`):

* ``admin`` (default): the above;
* ``deepnorm``: ``LN(alpha * x + f(x))`` with DeepNet's alpha per stack (a float32 buffer in
  the ``omega`` slot), and the FFN, value and output projections re-drawn Xavier-normal with
  gain beta (q/k gain 1) right after fairseq built each layer, encoder and decoder with
  their own constants;
* ``rezero``: ``x + a * f(x)``, ``a`` a trainable scalar starting at 0, the sub-layer
  LayerNorms replaced by identities (each stack is the identity at initialisation);
* ``rezero-post-ln``: ``LN(x + a * f(x))``;
* ``b2t``: Post-LN with B2T's bottom-to-top connection, the layer input added into each
  layer's last LayerNorm (``LN(h + f(h) + x)``), every Linear weight of a layer scaled by
  ``N^(-1/2)`` at initialisation;
* ``resi-dual``: ResiDual's Post-LN stream ``LN(x + f(x))`` plus the dual stream
  ``d + f(x)`` (float32), stack output ``x_N + LN(d_N)``.

B2T's layers and ResiDual's layers and stacks are in
:mod:`fairseq_admin_pos.models.b2t_resi_dual` (formulas and sources there).

The rivals set the shortcut weights themselves: ``--admin-init`` defaults to ``none`` for
them and any other value, ``--admin-omega parameter`` or Pre-LN
(``--*-normalize-before``) is refused with an error naming the flags.

Mixed precision (``--fp16``/``--bf16``): fixed omegas and DeepNorm alphas stay float32
when fairseq casts the model and the residual sum is computed in float32
(:class:`fairseq_admin_pos.schemes.Float32OmegaResidual`); trainable omegas and ReZero's
``a`` are ordinary parameters with fairseq's float32 master copies; ResiDual's dual stream
and its final LayerNorm are float32 whatever the model dtype.

The settings are stored in the model's state dict (``_extra_state``); loading a checkpoint
whose settings differ from the flags given raises an ``AdminFlagError`` (a ``ValueError``)
that names them, instead of silently running with other omegas or positions.
"""
from __future__ import annotations

import logging
import math
from typing import Dict

import torch.nn as nn
from omegaconf import OmegaConf

from fairseq import utils
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from fairseq_admin_pos.admin import calculate_init
from fairseq_admin_pos.errors import AdminFlagError
from fairseq_admin_pos.models import admin_profile
from fairseq_admin_pos.models import config as model_config
from fairseq_admin_pos.models.b2t_resi_dual import (
    B2TDecoderLayer,
    B2TEncoderLayer,
    ResiDualDecoderLayer,
    ResiDualDecoderStack,
    ResiDualEncoderLayer,
    ResiDualEncoderStack,
)
from fairseq_admin_pos.models.layers import (
    AdminTransformerDecoderLayer,
    AdminTransformerEncoderLayer,
    HostSyncFreeDecoderBase,
    HostSyncFreeEncoderBase,
)
from fairseq_admin_pos.models.positions import POS_EMB_CHOICES, SCALED_TABLES, build_positions
from fairseq_admin_pos.speed import compile as speed_compile
from fairseq_admin_pos.schemes import (
    RESIDUAL_SCHEMES,
    Float32OmegaResidual,
    ReZeroResidual,
    b2t_rescale_init_,
    deepnorm_constants,
    deepnorm_init_,
)

logger = logging.getLogger(__name__)

ADMIN_INIT_CHOICES = ("closed-form", "profile", "none")
OUTPUT_CHANGE_SCALES = ("O(logn)", "O(n)", "O(1)")
OMEGA_FORMS = ("buffer", "parameter")

# the flags whose values define the model's omegas and positions (checked on load)
SETTING_KEYS = (
    "admin_residual",
    "admin_init",
    "admin_output_change_scale",
    "admin_omega",
    "encoder_pos_emb",
    "decoder_pos_emb",
    "pos_emb_scaled_table",
    "pos_emb_scale_init",
    "admin_profile_mode",
)


def _choice(cfg, name: str, choices) -> str:
    value = getattr(cfg, name, None)
    if value not in choices:
        flag = "--" + name.replace("_", "-")
        raise AdminFlagError(f"{flag} {value!r} is not valid; valid choices: {', '.join(choices)}")
    return value


def admin_settings(cfg) -> Dict[str, str]:
    """The validated plugin settings from an args namespace or TransformerConfig."""
    settings = {
        "admin_residual": _choice(cfg, "admin_residual", RESIDUAL_SCHEMES),
        "admin_init": _choice(cfg, "admin_init", ADMIN_INIT_CHOICES),
        "admin_output_change_scale": _choice(
            cfg, "admin_output_change_scale", OUTPUT_CHANGE_SCALES
        ),
        "admin_omega": _choice(cfg, "admin_omega", OMEGA_FORMS),
        "encoder_pos_emb": _choice(cfg, "encoder_pos_emb", POS_EMB_CHOICES),
        "decoder_pos_emb": _choice(cfg, "decoder_pos_emb", POS_EMB_CHOICES),
        # None unless a side uses scaled-sinusoid positions (resolve_position_flags)
        "pos_emb_scaled_table": getattr(cfg, "pos_emb_scaled_table", None),
        "pos_emb_scale_init": getattr(cfg, "pos_emb_scale_init", None),
        # None unless --admin-init profile (then clinic or eval)
        "admin_profile_mode": admin_profile.profile_mode(cfg),
    }
    return settings


def check_layer_counts(args) -> None:
    """Negative layer counts are refused (fairseq would silently build an empty stack).
    0 is fairseq's own embedding-only stack and stays allowed where it means something:
    not with DeepNorm (its constants need N, M >= 1) nor with profiling (nothing to profile
    in that stack; :func:`admin_profile.check_profile_flags`)."""
    for side in ("encoder", "decoder"):
        n = getattr(args, f"{side}_layers", None)
        if n is None:
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AdminFlagError(f"--{side}-layers must be a non-negative integer; got {n!r}")
        if n == 0 and residual_scheme(args) == "deepnorm":
            raise AdminFlagError(
                f"--{side}-layers 0 cannot be combined with --admin-residual deepnorm: DeepNet's "
                "constants (N^4 M)^(1/16) need at least one encoder and one decoder layer"
            )


def num_residual_sublayers(cfg, side: str) -> int:
    """N of the closed form: residual sub-layers in one stack (2 per encoder layer, 3 per
    decoder layer, 2 per decoder layer without encoder attention)."""
    if side == "encoder":
        return 2 * cfg.encoder.layers
    per_layer = 2 if cfg.no_cross_attention else 3
    return per_layer * cfg.decoder.layers


def omega_init_value(cfg, side: str) -> float:
    # profile: 1 until the first training batch is profiled (models/admin_profile.py)
    if cfg.admin_init in ("none", "profile"):
        return 1.0
    return calculate_init(num_residual_sublayers(cfg, side), cfg.admin_output_change_scale)


def residual_scheme(cfg) -> str:
    # checkpoints and configs from before --admin-residual existed are Admin models
    return getattr(cfg, "admin_residual", None) or "admin"


def deepnorm_side_constants(cfg, side: str):
    """``(alpha, beta)`` of DeepNorm for one stack (N, M = encoder, decoder layers)."""
    c = deepnorm_constants(cfg.encoder.layers, cfg.decoder.layers)
    if side == "encoder":
        return c.encoder_alpha, c.encoder_beta
    return c.decoder_alpha, c.decoder_beta


def residual_factory(cfg, side: str):
    """``embed_dim -> residual module`` for this side and ``--admin-residual``.

    admin: :class:`Float32OmegaResidual` with this side's initial omega and the chosen form;
    deepnorm: the same with omega = DeepNorm's alpha of this side (a float32 buffer);
    rezero / rezero-post-ln: :class:`ReZeroResidual` (``x + a * f_x``, ``a`` = 0);
    b2t / resi-dual: the plain ``x + f_x`` (omega = 1 as a buffer: stock fairseq's sum).
    """
    scheme = residual_scheme(cfg)
    if scheme in ("rezero", "rezero-post-ln"):
        return lambda embed_dim: ReZeroResidual(0.0)
    if scheme in ("b2t", "resi-dual"):
        return lambda embed_dim: Float32OmegaResidual(1.0, as_parameter=False)
    if scheme == "deepnorm":
        alpha = deepnorm_side_constants(cfg, side)[0]
        return lambda embed_dim: Float32OmegaResidual(alpha, as_parameter=False)
    init = omega_init_value(cfg, side)
    as_parameter = cfg.admin_omega == "parameter"

    def build(embed_dim: int) -> nn.Module:
        return Float32OmegaResidual(init, as_parameter=as_parameter, embed_dim=embed_dim)

    return build


#: the layer classes of the schemes that change the layer itself (the others: residual modules)
ENCODER_LAYERS = {"b2t": B2TEncoderLayer, "resi-dual": ResiDualEncoderLayer}
DECODER_LAYERS = {"b2t": B2TDecoderLayer, "resi-dual": ResiDualDecoderLayer}


def _scheme_layer(cfg, side: str, layer: nn.Module) -> nn.Module:
    # DeepNorm re-draws the FFN/value/output projections after fairseq's init (beta of this
    # side); B2T scales every Linear weight by N^(-1/2) (N: this side's layers); nothing to
    # do for the other schemes
    scheme = residual_scheme(cfg)
    if scheme == "deepnorm":
        deepnorm_init_(layer, deepnorm_side_constants(cfg, side)[1])
    elif scheme == "b2t":
        b2t_rescale_init_(layer, getattr(cfg, side).layers)
    return layer


def _wrap_layer(cfg, layer: nn.Module) -> nn.Module:
    # same wrapping as fairseq's build_*_layer, so --checkpoint-activations and FSDP work
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not checkpoint else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


class AdminTransformerEncoder(HostSyncFreeEncoderBase):
    """fairseq's Transformer encoder with Admin residuals and the chosen positions (its
    forward reads nothing back to the host, see ``layers.HostSyncFreeEncoderBase``)."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        # fairseq built sinusoidal or learned positions (the learned ones from cfg, so the
        # random stream is the stock one); swap in the other choices after the fact.
        if cfg.encoder_pos_emb in ("scaled-sinusoidal", "none"):
            self.embed_positions = build_positions(
                cfg.encoder_pos_emb,
                cfg.max_source_positions,
                embed_tokens.embedding_dim,
                self.padding_idx,
                scaled_table=getattr(cfg, "pos_emb_scaled_table", None),
                scale_init=getattr(cfg, "pos_emb_scale_init", None),
            )

    def build_encoder_layer(self, cfg):
        layer_cls = ENCODER_LAYERS.get(residual_scheme(cfg), AdminTransformerEncoderLayer)
        layer = layer_cls(
            cfg,
            residual_factory(cfg, "encoder"),
            return_fc=self.return_fc,
            sublayer_layer_norm=residual_scheme(cfg) != "rezero",
        )
        return _wrap_layer(cfg, _scheme_layer(cfg, "encoder", layer))


class AdminTransformerDecoder(HostSyncFreeDecoderBase):
    """fairseq's Transformer decoder with Admin residuals and the chosen positions (its
    forward reads nothing back to the host, see ``layers.HostSyncFreeDecoderBase``)."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(
            cfg,
            dictionary,
            embed_tokens,
            no_encoder_attn=no_encoder_attn,
            output_projection=output_projection,
        )
        if cfg.decoder_pos_emb in ("scaled-sinusoidal", "none"):
            self.embed_positions = build_positions(
                cfg.decoder_pos_emb,
                cfg.max_target_positions,
                cfg.decoder.embed_dim,
                self.padding_idx,
                scaled_table=getattr(cfg, "pos_emb_scaled_table", None),
                scale_init=getattr(cfg, "pos_emb_scale_init", None),
            )

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer_cls = DECODER_LAYERS.get(residual_scheme(cfg), AdminTransformerDecoderLayer)
        layer = layer_cls(
            cfg,
            residual_factory(cfg, "decoder"),
            no_encoder_attn=no_encoder_attn,
            sublayer_layer_norm=residual_scheme(cfg) != "rezero",
        )
        return _wrap_layer(cfg, _scheme_layer(cfg, "decoder", layer))


class ResiDualTransformerEncoder(ResiDualEncoderStack, AdminTransformerEncoder):
    """``--admin-residual resi-dual`` encoder: output ``x_N + LN_d(d_N)`` with the dual stream
    ``d`` carried through the layers (``b2t_resi_dual.ResiDualEncoderStack``); positions and
    host-sync-free forward as :class:`AdminTransformerEncoder`."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        self.init_dual(embed_tokens.embedding_dim)


class ResiDualTransformerDecoder(ResiDualDecoderStack, AdminTransformerDecoder):
    """``--admin-residual resi-dual`` decoder: features ``x_M + LN_d(d_M)``, the dual stream
    carried through the layers, step by step when decoding incrementally
    (``b2t_resi_dual.ResiDualDecoderStack``)."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        self.init_dual(cfg.decoder.embed_dim)


def resolve_position_flags(args) -> None:
    """Make ``--{encoder,decoder}-pos-emb`` and fairseq's own position flags agree.

    Without the choice flag, fairseq's flags decide (``--no-token-positional-embeddings`` ->
    ``none``, ``--*-learned-pos`` -> ``learned``, else ``sinusoidal``). With it, fairseq's flags
    are set to match, and a contradiction is an error naming both flags.
    """
    no_pos = bool(getattr(args, "no_token_positional_embeddings", False))
    for side in ("encoder", "decoder"):
        key = f"{side}_pos_emb"
        learned_key = f"{side}_learned_pos"
        learned = bool(getattr(args, learned_key, False))
        choice = getattr(args, key, None)
        if choice is None:
            choice = "none" if no_pos else ("learned" if learned else "sinusoidal")
        elif choice not in POS_EMB_CHOICES:
            raise AdminFlagError(
                f"--{side}-pos-emb {choice!r} is not valid; valid choices: "
                f"{', '.join(POS_EMB_CHOICES)}"
            )
        if no_pos and choice != "none":
            raise AdminFlagError(
                f"--no-token-positional-embeddings contradicts --{side}-pos-emb {choice}; "
                f"use --{side}-pos-emb none (or drop one of the two flags)"
            )
        if learned and choice != "learned":
            raise AdminFlagError(
                f"--{side}-learned-pos contradicts --{side}-pos-emb {choice}; "
                f"use --{side}-pos-emb learned (or drop one of the two flags)"
            )
        setattr(args, key, choice)
        setattr(args, learned_key, choice == "learned")
    # fairseq's global switch only when both sides have no positions; one-sided `none` is
    # handled by the encoder/decoder above.
    args.no_token_positional_embeddings = (
        args.encoder_pos_emb == "none" and args.decoder_pos_emb == "none"
    )
    resolve_scaled_position_flags(args)


def resolve_scaled_position_flags(args) -> None:
    """``--pos-emb-scaled-table`` / ``--pos-emb-scale-init`` configure ``scaled-sinusoidal``
    positions only: refused (naming both flags) when no side uses them, validated, and the
    table defaulted to ``interleaved``; both stay None otherwise."""
    table = getattr(args, "pos_emb_scaled_table", None)
    scale = getattr(args, "pos_emb_scale_init", None)
    if "scaled-sinusoidal" not in (args.encoder_pos_emb, args.decoder_pos_emb):
        given = [f"--pos-emb-scaled-table {table}" if table is not None else None,
                 f"--pos-emb-scale-init {scale}" if scale is not None else None]
        given = [g for g in given if g]
        if given:
            raise AdminFlagError(
                f"{' and '.join(given)} only apply to scaled-sinusoid positions, but "
                f"--encoder-pos-emb is {args.encoder_pos_emb} and --decoder-pos-emb is "
                f"{args.decoder_pos_emb}; use --encoder-pos-emb/--decoder-pos-emb "
                "scaled-sinusoidal or drop --pos-emb-scaled-table/--pos-emb-scale-init"
            )
        args.pos_emb_scaled_table = None
        args.pos_emb_scale_init = None
        return
    if table is None:
        table = "interleaved"
    elif table not in SCALED_TABLES:
        raise AdminFlagError(
            f"--pos-emb-scaled-table {table!r} is not valid; valid choices: "
            f"{', '.join(SCALED_TABLES)}"
        )
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale):
            raise AdminFlagError(f"--pos-emb-scale-init must be a finite number; got {scale!r}")
        scale = float(scale)
    args.pos_emb_scaled_table = table
    args.pos_emb_scale_init = scale


def check_compile_flags(args) -> None:
    """``--admin-compile layers`` compiles the layers themselves; fairseq's activation
    checkpointing wraps them in a function that recomputes the forward, which the compiled
    layers do not support."""
    if args.admin_compile not in speed_compile.COMPILE_CHOICES:
        raise AdminFlagError(f"--admin-compile {args.admin_compile!r} is not valid; valid choices: "
                         f"{', '.join(speed_compile.COMPILE_CHOICES)}")
    if args.admin_compile == "layers" and (getattr(args, "checkpoint_activations", False)
                                           or getattr(args, "offload_activations", False)):
        raise AdminFlagError(
            "--admin-compile layers cannot be combined with --checkpoint-activations / "
            "--offload-activations; use one of the two (--admin-compile none keeps "
            "activation checkpointing)"
        )


def check_normalize_before(args) -> None:
    """Pre-LN with Admin omegas is not a published configuration: refuse it clearly."""
    pre_ln = [
        flag
        for flag, on in (
            ("--encoder-normalize-before", getattr(args, "encoder_normalize_before", False)),
            ("--decoder-normalize-before", getattr(args, "decoder_normalize_before", False)),
        )
        if on
    ]
    if pre_ln and args.admin_init != "none":
        raise AdminFlagError(
            f"{' and '.join(pre_ln)} (Pre-LN) cannot be combined with --admin-init "
            f"{args.admin_init}: Admin rescales the shortcut of Post-LN layers. For the Pre-LN "
            "baseline use --admin-init none."
        )


def check_residual_scheme(args) -> None:
    """DeepNorm, ReZero, B2T and ResiDual set their shortcut weights themselves and are Post-LN
    (or LN-free) schemes: refuse the combinations that would silently mean something else.
    B2T and ResiDual use the plain shortcut ``x + f(x)``: neither paper weights it, and
    Admin's omega inside their Post-LN sub-layers would be a new, untested scheme."""
    scheme = args.admin_residual
    if scheme == "admin":
        return
    if args.admin_init != "none":
        raise AdminFlagError(
            f"--admin-residual {scheme} sets its own shortcut weights; it cannot be combined "
            f"with --admin-init {args.admin_init} (valid with {scheme}: --admin-init none, "
            f"the default for {scheme}; drop --admin-init), or use --admin-residual admin "
            "for Admin's omegas"
        )
    if args.admin_omega != "buffer":
        raise AdminFlagError(
            f"--admin-omega {args.admin_omega} is Admin's trainable omega and does not apply "
            f"to --admin-residual {scheme} (DeepNorm's alpha is a constant, ReZero's scalar is "
            "always trained, B2T and ResiDual add the plain shortcut x); valid with "
            f"{scheme}: --admin-omega buffer (the default; drop --admin-omega)"
        )
    pre_ln = [
        flag
        for flag, on in (
            ("--encoder-normalize-before", getattr(args, "encoder_normalize_before", False)),
            ("--decoder-normalize-before", getattr(args, "decoder_normalize_before", False)),
        )
        if on
    ]
    if pre_ln:
        kind = "has no sub-layer LayerNorm" if scheme == "rezero" else "is a Post-LN scheme"
        raise AdminFlagError(
            f"{' and '.join(pre_ln)} (Pre-LN) cannot be combined with --admin-residual "
            f"{scheme}: {scheme} {kind}. For the Pre-LN baseline use --admin-residual admin "
            "--admin-init none"
        )


def prepare_args(args):
    """The namespace ``build_model`` builds from: hydra's model section converted
    (models/config.py), the architecture's defaults applied, the position flags resolved and
    every plugin flag checked. A bad value or combination raises
    :class:`~fairseq_admin_pos.fairseq_fixes.flag_errors.AdminFlagError` naming the flags
    (fairseq's tools print it as one line; they also run this on a copy of the configuration
    before anything else, see ``flag_errors.preflight``)."""
    if OmegaConf.is_config(args):
        # fairseq-hydra-train's model section (or a checkpoint it wrote): the namespace
        # fairseq-train would have built, architecture defaults applied (models/config.py)
        args = model_config.namespace_from_config(args, AdminTransformerConfig)
    admin_base_architecture(args)
    resolve_position_flags(args)
    admin_settings(args)  # validates every choice with a message naming the flag
    check_layer_counts(args)
    check_normalize_before(args)
    check_residual_scheme(args)
    admin_profile.check_profile_flags(args)
    check_compile_flags(args)
    return args


@register_model("admin_transformer")
class AdminTransformerModel(TransformerModel):
    """Transformer encoder-decoder (Vaswani et al. 2017) with Admin residuals.

    See the module docstring for the formula and the flags; architectures registered below
    give the published sizes and depths.
    """

    @classmethod
    def hub_models(cls):
        return {}

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        # fairseq hands us its "Model-specific configuration" group; argparse does not print
        # groups nested in a group, so the flags go straight into it.
        group = parser
        group.add_argument(
            "--admin-residual",
            choices=RESIDUAL_SCHEMES,
            help="residual scheme of every sub-layer: admin = LN(x * omega + f(x)) (Liu et al. "
            "2020, see --admin-init); deepnorm = LN(alpha * x + f(x)) with DeepNet's alpha and "
            "beta-scaled init (Wang et al. 2022, arXiv 2203.00555); rezero = x + a * f(x), a "
            "a trainable scalar from 0, no LayerNorm (Bachlechner et al. 2020, arXiv "
            "2003.04887); rezero-post-ln = LN(x + a * f(x)); b2t = Post-LN plus the layer "
            "input added into each layer's last LN, LN(h + f(h) + x), Linear weights x "
            "N^-1/2 (Takase et al. 2023, B2T connection, Findings of ACL); resi-dual = "
            "Post-LN stream LN(x + f(x)) plus the dual sum d + f(x), stack output "
            "x_N + LN(d_N) (Xie et al. 2023, ResiDual, arXiv 2304.14802). The rivals of "
            "admin take no --admin-init/--admin-omega and no Pre-LN. Default: admin",
        )
        group.add_argument(
            "--admin-init",
            choices=ADMIN_INIT_CHOICES,
            help="how each residual sub-layer's omega in LN(x * omega + f(x)) is initialised: "
            "closed-form = sqrt of admin-torch's calculate_init(N) with N the residual "
            "sub-layers of that stack (2 per encoder layer, 3 per decoder layer); "
            "profile = Admin's profiling (Liu et al. 2020): omegas from the output variances "
            "measured on the first training batch(es) before the first update, in the same "
            "fairseq-train command (see --admin-profile-*); "
            "none = omega 1 (stock Post-LN, or Pre-LN with --*-normalize-before). "
            "Default: closed-form",
        )
        group.add_argument(
            "--admin-output-change-scale",
            choices=OUTPUT_CHANGE_SCALES,
            help="output change at initialisation targeted by --admin-init closed-form: "
            "O(logn): omega^2 = (N+1)/ln(N+1) - 1; O(1): omega^2 = N; O(n): omega^2 = 1. "
            "Default: O(logn)",
        )
        group.add_argument(
            "--admin-omega",
            choices=OMEGA_FORMS,
            help="buffer: omega is one fixed scalar per sub-layer; parameter: a trainable "
            "vector of size embed_dim per sub-layer (Transformer-Clinic). Default: buffer",
        )
        for side in ("encoder", "decoder"):
            group.add_argument(
                f"--{side}-pos-emb",
                choices=POS_EMB_CHOICES,
                help=f"{side} absolute positions: sinusoidal = fairseq's table; "
                "scaled-sinusoidal = a sinusoid table (--pos-emb-scaled-table) times a "
                "learnable scalar (--pos-emb-scale-init) (FLASH, arXiv 2202.10447); "
                "learned = fairseq's learned table; "
                f"none = no positions. Default: from --{side}-learned-pos / "
                "--no-token-positional-embeddings, else sinusoidal",
            )
        group.add_argument(
            "--pos-emb-scaled-table",
            choices=tuple(SCALED_TABLES),
            help="table of scaled-sinusoidal positions (both sides): interleaved = Vaswani's "
            "sin/cos pairs of one frequency in adjacent columns, exponent 2*floor(i/2)/d; "
            "seed = the seed module's table, exponent 2*i/d per column; fairseq = exactly "
            "the sinusoidal choice's table ([sin | cos] halves, spacing ln(10000)/(d/2 - 1)). "
            "Only with --encoder-pos-emb/--decoder-pos-emb scaled-sinusoidal. "
            "Default: interleaved",
        )
        group.add_argument(
            "--pos-emb-scale-init",
            type=float,
            metavar="FLOAT",
            help="initial value of the learnable scalar of scaled-sinusoidal positions (both "
            "sides). fairseq multiplies tokens by sqrt(d), so 1/sqrt(d) starts positions "
            "about sqrt(d) times weaker than fairseq's sinusoid; 1 with "
            "--pos-emb-scaled-table fairseq starts exactly at the sinusoidal model. "
            "Default: 1/sqrt(d), the seed's",
        )
        admin_profile.add_profile_args(group)
        group.add_argument(
            "--admin-compile",
            choices=speed_compile.COMPILE_CHOICES,
            help="none = eager PyTorch; layers = compile every layer's training forward and "
            "backward with torch.compile (TorchInductor, dynamic shapes), same module tree "
            "and checkpoints, dropout's random numbers as in eager mode, results equal up to "
            "float rounding; the first update pays the compilation. Validation and generation "
            "stay eager. Experimental: on a CPU it measured slower than eager (docs/speed.md), "
            "on a GPU it is not measured yet. Not with --checkpoint-activations. Default: none",
        )

    @classmethod
    def build_model(cls, args, task):
        args = prepare_args(args)
        model = super().build_model(args, task)
        model.admin_settings = admin_settings(args)
        if args.admin_init == "profile":
            admin_profile.configure(model, args, task)
        if args.admin_compile == "layers":
            for layer in [*model.encoder.layers, *model.decoder.layers]:
                speed_compile.enable(layer)
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, *args, **kwargs):
        # --admin-init profile: the first training forward profiles (once) before the loss
        profiler = getattr(self, "admin_profile", None)
        if profiler is not None and self.training:
            profiler.on_training_forward(self, src_tokens, src_lengths, prev_output_tokens)
        return super().forward(src_tokens, src_lengths, prev_output_tokens, *args, **kwargs)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        stack = (ResiDualTransformerEncoder if residual_scheme(args) == "resi-dual"
                 else AdminTransformerEncoder)
        return stack(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        stack = (ResiDualTransformerDecoder if residual_scheme(args) == "resi-dual"
                 else AdminTransformerDecoder)
        return stack(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    # -- settings travel with the weights ------------------------------------------------
    def get_extra_state(self):
        return dict(self.admin_settings)

    def set_extra_state(self, state):
        saved = dict(state)
        current = self.admin_settings
        diffs = [
            f"--{k.replace('_', '-')}: checkpoint {saved.get(k)!r}, flags {current[k]!r}"
            for k in SETTING_KEYS
            if k in saved and saved[k] != current[k]
        ]
        if diffs:
            raise AdminFlagError(
                "admin_transformer checkpoint was trained with other omega/position settings "
                "than the flags given (" + "; ".join(diffs) + "). Pass the checkpoint's "
                "settings, or start a new run instead of --restore-file/resume (fairseq-generate: "
                "leave them out of --model-overrides)."
            )


# the same settings as a config dataclass, generated from add_args: what fairseq-hydra-train's
# model section is checked against (models/config.py says why fairseq's registry is not used)
AdminTransformerConfig = model_config.config_dataclass(
    "AdminTransformerConfig", AdminTransformerModel.add_args
)


# -- architectures ----------------------------------------------------------------------


def _default(args, name, value):
    # the plugin's flags have no argparse default, so None means "not given"
    if getattr(args, name, None) is None:
        setattr(args, name, value)


@register_model_architecture("admin_transformer", "admin_transformer")
def admin_base_architecture(args):
    """Transformer base (512/2048/8 heads, 6L-6L) with Admin closed-form O(logn) omegas."""
    _default(args, "admin_residual", "admin")
    # the rivals set their own shortcut weights: Admin's omega stays 1 for them
    _default(args, "admin_init", "closed-form" if args.admin_residual == "admin" else "none")
    _default(args, "admin_output_change_scale", "O(logn)")
    _default(args, "admin_omega", "buffer")
    _default(args, "admin_compile", "none")
    base_architecture(args)


@register_model_architecture("admin_transformer", "admin_transformer_tiny")
def admin_transformer_tiny(args):
    """64/64/2 heads, 2L-2L: for tests and smoke runs."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 64)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 64)
    args.encoder_layers = getattr(args, "encoder_layers", 2)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 2)
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 2)
    admin_base_architecture(args)


@register_model_architecture("admin_transformer", "admin_transformer_iwslt_de_en")
def admin_transformer_iwslt_de_en(args):
    """IWSLT14 De-En small: 512/1024/4 heads, 6L-6L."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 1024)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 512)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 1024)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    args.decoder_layers = getattr(args, "decoder_layers", 6)
    admin_base_architecture(args)


@register_model_architecture("admin_transformer", "admin_transformer_wmt_en_de")
def admin_transformer_wmt_en_de(args):
    """WMT14 En-De base: 512/2048/8 heads, 6L-6L."""
    admin_base_architecture(args)


@register_model_architecture("admin_transformer", "admin_transformer_vaswani_wmt_en_de_big")
def admin_transformer_vaswani_wmt_en_de_big(args):
    """Transformer big: 1024/4096/16 heads, 6L-6L, dropout 0.3."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 1024)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 4096)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 16)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 1024)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 4096)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 16)
    args.dropout = getattr(args, "dropout", 0.3)
    admin_base_architecture(args)


# The published deep settings (Liu et al. 2020, Table 1; Liu, Liu & Gao 2020 for 60L-12L;
# Transformer-Clinic for 100L-100L), all at WMT14 base width 512/2048/8 heads.
DEEP_PRESETS = {
    "6l_6l": (6, 6),
    "12l_12l": (12, 12),
    "18l_18l": (18, 18),
    "60l_12l": (60, 12),
    "100l_100l": (100, 100),
}


def _register_deep(name: str, enc: int, dec: int):
    def arch(args):
        args.encoder_layers = getattr(args, "encoder_layers", enc)
        args.decoder_layers = getattr(args, "decoder_layers", dec)
        admin_transformer_wmt_en_de(args)

    arch.__doc__ = f"WMT14 base width 512/2048/8 heads, {enc}L encoder, {dec}L decoder."
    arch.__name__ = f"admin_transformer_wmt_en_de_{name}"
    register_model_architecture("admin_transformer", arch.__name__)(arch)


for _name, (_enc, _dec) in DEEP_PRESETS.items():
    _register_deep(_name, _enc, _dec)
