"""The registered ``admin_transformer`` architectures: published sizes and depths.

``--arch admin_transformer`` itself is Transformer base with the plugin's defaults
(:func:`fairseq_admin_pos.models.flags.admin_base_architecture`: the recommended Admin, the
scheme called ``admin`` in :mod:`fairseq_admin_pos.scheme_flags`); the others set sizes and
depths first, each a flag the command line can still override, and keep those defaults.
"""
from __future__ import annotations

from fairseq.models import register_model_architecture

# the model must be registered before its architectures
from fairseq_admin_pos.models import admin_transformer  # noqa: F401
from fairseq_admin_pos.models.flags import admin_base_architecture

register_model_architecture("admin_transformer", "admin_transformer")(admin_base_architecture)


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

# Deep encoder, shallow decoder (Kasai, Pappas, Peng, Cross & Smith, "Deep Encoder, Shallow
# Decoder: Reevaluating Non-autoregressive Machine Translation", ICLR 2021, arXiv 2006.10369;
# code jungokasai/deep-shallow), at the same base width, trained there as stock fairseq
# ``transformer`` (Post-LN). Each decoder layer has 3 residual sub-layers, so the closed form's
# decoder N is 3 for a 1-layer decoder (6 for 2 layers). name: (encoder, decoder, source)
_KASAI = "Kasai et al., ICLR 2021 (arXiv 2006.10369)"
_CLINIC_REPORT = ("a shape with which users of Admin's reference code (Transformer-Clinic) "
                  "report divergence on WMT14 En-De where 12L-12L trains")
SHALLOW_DECODER_PRESETS = {
    "6l_1l": (6, 1, f"{_KASAI}: the published WMT16 En-De 6-1 model (27.4 BLEU with "
                    "distillation)"),
    "12l_1l": (12, 1, f"{_KASAI}: the published WMT16 En-De 12-1 model (26.9 BLEU; 28.3 "
                      "with distillation)"),
    "12l_2l": (12, 2, f"deep encoder, shallow decoder ({_KASAI}); {_CLINIC_REPORT}"),
    "18l_1l": (18, 1, f"deep encoder, shallow decoder ({_KASAI}); {_CLINIC_REPORT}"),
    "18l_2l": (18, 2, f"deep encoder, shallow decoder ({_KASAI}); {_CLINIC_REPORT}"),
    "24l_1l": (24, 1, f"deep encoder, shallow decoder ({_KASAI}): a deeper encoder than "
                      "the published 12-1"),
}


def _register_deep(name: str, enc: int, dec: int, source: str = ""):
    def arch(args):
        args.encoder_layers = getattr(args, "encoder_layers", enc)
        args.decoder_layers = getattr(args, "decoder_layers", dec)
        admin_transformer_wmt_en_de(args)

    arch.__doc__ = (f"WMT14 base width 512/2048/8 heads, {enc}L encoder, {dec}L decoder"
                    + (f": {source}." if source else "."))
    arch.__name__ = f"admin_transformer_wmt_en_de_{name}"
    register_model_architecture("admin_transformer", arch.__name__)(arch)


for _name, (_enc, _dec) in DEEP_PRESETS.items():
    _register_deep(_name, _enc, _dec)
for _name, (_enc, _dec, _source) in SHALLOW_DECODER_PRESETS.items():
    _register_deep(_name, _enc, _dec, _source)
