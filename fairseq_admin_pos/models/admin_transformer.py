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
  ``d + f(x)`` (float32), stack output ``x_N + LN(d_N)``;
* ``peri-ln``: ``x + dropout(LN_out(f(LN(x))))`` and a final LayerNorm per stack;
* ``mix-ln``: Post-LN in the first ``floor(alpha L)`` layers of each stack, Pre-LN above
  (``--mix-ln-alpha``, 0.25), a final LayerNorm unless every layer is Post-LN.

``--admin-norm dyt`` makes every normalisation module a DyT (``g * tanh(alpha x) + b``),
whatever the placement. Peri-LN, Mix-LN and DyT are built by
:mod:`fairseq_admin_pos.models.norm_layers` (placements and modules in
:mod:`fairseq_admin_pos.placements` and :mod:`fairseq_admin_pos.norms`).

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

import torch.nn as nn
from omegaconf import OmegaConf

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model
from fairseq.models.transformer import TransformerConfig, TransformerModel
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from fairseq_admin_pos.admin import calculate_init
from fairseq_admin_pos.errors import AdminFlagError
from fairseq_admin_pos.models import admin_profile
from fairseq_admin_pos.models import config as model_config
from fairseq_admin_pos.models import flags
from fairseq_admin_pos.models.b2t_resi_dual import (
    B2TDecoderLayer,
    B2TEncoderLayer,
    ResiDualDecoderLayer,
    ResiDualDecoderStack,
    ResiDualEncoderLayer,
    ResiDualEncoderStack,
)
from fairseq_admin_pos.models.host_sync_free import HostSyncFreeDecoderBase, HostSyncFreeEncoderBase
from fairseq_admin_pos.models.layers import (
    AdminTransformerDecoderLayer,
    AdminTransformerEncoderLayer,
)
from fairseq_admin_pos.models.flags import (  # noqa: F401  (importable from here, as before)
    ADMIN_INIT_CHOICES,
    OMEGA_FORMS,
    OUTPUT_CHANGE_SCALES,
    SETTING_KEYS,
    admin_base_architecture,
    admin_settings,
    residual_scheme,
)
from fairseq_admin_pos.models import norm_layers
from fairseq_admin_pos.models.positions import build_positions
from fairseq_admin_pos.speed import compile as speed_compile
from fairseq_admin_pos.schemes import (
    Float32OmegaResidual,
    ReZeroResidual,
    b2t_rescale_init_,
    deepnorm_constants,
    deepnorm_init_,
)

logger = logging.getLogger(__name__)

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
    b2t / resi-dual / peri-ln / mix-ln: the plain ``x + f_x`` (omega = 1 as a buffer: stock
    fairseq's sum).
    """
    scheme = residual_scheme(cfg)
    if scheme in ("rezero", "rezero-post-ln"):
        return lambda embed_dim: ReZeroResidual(0.0)
    if scheme in ("b2t", "resi-dual", *norm_layers.PLACEMENT_SCHEMES):
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


def stack_norms(cfg, side: str) -> norm_layers.StackNorms:
    """The LayerNorm placement and module of the ``side`` stack from the model's flags
    (``cfg`` a TransformerConfig with the plugin's settings, flags already checked)."""
    scheme = residual_scheme(cfg)
    if scheme in norm_layers.PLACEMENT_SCHEMES:
        placement = scheme
    else:
        placement = "pre-ln" if getattr(cfg, side).normalize_before else "post-ln"
    options = {k: getattr(cfg, k) for k in ("mix_ln_alpha", "dyt_alpha_init")
               if getattr(cfg, k, None) is not None}
    return norm_layers.StackNorms(placement, getattr(cfg, side).layers,
                                  kind=getattr(cfg, "admin_norm", None) or "layernorm",
                                  export=bool(getattr(cfg, "export", False)), **options)


def _next_layer_index(stack: nn.Module) -> int:
    # fairseq builds a stack's layers bottom up, one build_*_layer call each
    index = stack.__dict__.get("_layers_built", 0)
    stack.__dict__["_layers_built"] = index + 1
    return index


def _wrap_layer(cfg, layer: nn.Module) -> nn.Module:
    # same wrapping as fairseq's build_*_layer, so --checkpoint-activations and FSDP work
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not checkpoint else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


class AdminTransformerEncoder(HostSyncFreeEncoderBase):
    """fairseq's Transformer encoder with Admin residuals and the chosen positions (its
    forward reads nothing back to the host, see ``host_sync_free.HostSyncFreeEncoderBase``)."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        norms = stack_norms(cfg, "encoder")
        cfg = norm_layers.stack_config(cfg, "encoder", norms)
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        norm_layers.configure_stack(self, norms)
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
        norm_layers.configure_layer(layer, stack_norms(cfg, "encoder"), _next_layer_index(self))
        return _wrap_layer(cfg, _scheme_layer(cfg, "encoder", layer))


class AdminTransformerDecoder(HostSyncFreeDecoderBase):
    """fairseq's Transformer decoder with Admin residuals and the chosen positions (its
    forward reads nothing back to the host, see ``host_sync_free.HostSyncFreeDecoderBase``)."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        norms = stack_norms(cfg, "decoder")
        cfg = norm_layers.stack_config(cfg, "decoder", norms)
        super().__init__(
            cfg,
            dictionary,
            embed_tokens,
            no_encoder_attn=no_encoder_attn,
            output_projection=output_projection,
        )
        norm_layers.configure_stack(self, norms)
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
        norm_layers.configure_layer(layer, stack_norms(cfg, "decoder"), _next_layer_index(self))
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


def prepare_args(args):
    """The namespace ``build_model`` builds from: hydra's model section converted
    (models/config.py), the architecture's defaults applied, the position flags resolved and
    every plugin flag checked. A bad value or combination raises
    :class:`~fairseq_admin_pos.errors.AdminFlagError` naming the flags
    (fairseq's tools print it as one line; they also run this on a copy of the configuration
    before anything else, see ``flag_errors.preflight``)."""
    if OmegaConf.is_config(args):
        # fairseq-hydra-train's model section (or a checkpoint it wrote): the namespace
        # fairseq-train would have built, architecture defaults applied (models/config.py)
        args = model_config.namespace_from_config(args, AdminTransformerConfig)
    admin_base_architecture(args)
    flags.check_flags(args)
    return args


@register_model("admin_transformer")
class AdminTransformerModel(TransformerModel):
    """Transformer encoder-decoder (Vaswani et al. 2017) with Admin residuals.

    See the module docstring for the formula; the flags and their checks are in
    :mod:`~fairseq_admin_pos.models.flags`, the architectures with the published sizes and
    depths in :mod:`~fairseq_admin_pos.models.architectures`.
    """

    @classmethod
    def hub_models(cls):
        return {}

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        # fairseq hands us its "Model-specific configuration" group; argparse does not print
        # groups nested in a group, so the flags go straight into it (models/flags.py)
        flags.add_args(parser)

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


