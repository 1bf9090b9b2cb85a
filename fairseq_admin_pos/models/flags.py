"""The flags of ``admin_transformer`` and their checks (fairseq glue, no model code).

* :func:`add_args`: the plugin's flags and their help text, one group per step
  (:func:`add_residual_args`, :func:`add_norm_args`, :func:`add_position_args`, the
  profiling flags, :func:`add_compile_args`); ``docs/usage.md`` has each flag in full;
* :func:`admin_base_architecture`: their defaults (the ``admin_transformer`` architecture;
  the plugin's flags have no argparse default, so None means "not given"), the recommended
  Admin: closed-form omegas, each a trainable vector (:func:`omega_applies`);
* :func:`check_flags`: every check of a value or a combination, raising
  :class:`~fairseq_admin_pos.errors.AdminFlagError` with one line naming the flags and the
  valid choices (fairseq's tools print it as ``<prog>: error: ...``, exit status 2);
* :func:`admin_settings`: the settings that travel with the weights and are compared when a
  checkpoint is loaded (:data:`SETTING_KEYS`).
"""
from __future__ import annotations

import math
from typing import Dict

from fairseq.models.transformer.transformer_legacy import base_architecture

from fairseq_admin_pos.errors import AdminFlagError
from fairseq_admin_pos.models import admin_profile
from fairseq_admin_pos.models.norm_layers import PLACEMENT_SCHEMES
from fairseq_admin_pos.models.positions import POS_EMB_CHOICES, SCALED_TABLES
from fairseq_admin_pos.norms import DYT_ALPHA_INIT, NORM_CHOICES, check_dyt_alpha_init
from fairseq_admin_pos.placements import MIX_LN_ALPHA, check_mix_ln_alpha
from fairseq_admin_pos.schemes import RESIDUAL_SCHEMES
from fairseq_admin_pos.speed import compile as speed_compile

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
    "admin_norm",
    "mix_ln_alpha",
    "dyt_alpha_init",
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
        # layernorm (checkpoints from before --admin-norm) or dyt
        "admin_norm": getattr(cfg, "admin_norm", None) or "layernorm",
        # None unless --admin-residual mix-ln / --admin-norm dyt (check_norm_flags)
        "mix_ln_alpha": getattr(cfg, "mix_ln_alpha", None),
        "dyt_alpha_init": getattr(cfg, "dyt_alpha_init", None),
    }
    if settings["admin_norm"] not in NORM_CHOICES:
        _choice(cfg, "admin_norm", NORM_CHOICES)
    return settings


def check_layer_counts(args) -> None:
    """Negative layer counts are refused (fairseq would silently build an empty stack).
    0 is fairseq's own embedding-only stack and stays allowed for the encoder (the decoder
    then attends to the source embeddings), but not with DeepNorm (its constants need
    N, M >= 1) nor with profiling (nothing to profile in that stack;
    :func:`admin_profile.check_profile_flags`). A decoder of 0 layers is refused: it would
    be the target embedding and the output projection alone, with no encoder attention, so
    the translation could not depend on the source (DeepNorm's own message comes first)."""
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
        if n == 0 and side == "decoder":
            raise AdminFlagError(
                "--decoder-layers 0 leaves admin_transformer a decoder of only the target "
                "embedding and the output projection, with no attention to the encoder: the "
                "translation would not depend on the source; valid: --decoder-layers 1 or more "
                "(1 is the deep-encoder, shallow-decoder shape)"
            )


def residual_scheme(cfg) -> str:
    # checkpoints and configs from before --admin-residual existed are Admin models
    return getattr(cfg, "admin_residual", None) or "admin"


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


def pre_ln_flags(args) -> list:
    """The ``--*-normalize-before`` (Pre-LN) flags given, in flag order."""
    return [flag for flag, key in (("--encoder-normalize-before", "encoder_normalize_before"),
                                   ("--decoder-normalize-before", "decoder_normalize_before"))
            if getattr(args, key, False)]


def check_normalize_before(args) -> None:
    """Pre-LN with Admin omegas is not a published configuration: refuse it clearly."""
    pre_ln = pre_ln_flags(args)
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
    Admin's omega inside their Post-LN sub-layers would be a new, untested scheme. Peri-LN
    and Mix-LN are LayerNorm placements with the plain shortcut (Post-LN/Pre-LN semantics,
    ``--admin-init none``) that set every layer's placement themselves."""
    scheme = args.admin_residual
    if scheme == "admin":
        return
    if scheme in PLACEMENT_SCHEMES:
        _check_placement_scheme(args, scheme)
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
    pre_ln = pre_ln_flags(args)
    if pre_ln:
        kind = "has no sub-layer LayerNorm" if scheme == "rezero" else "is a Post-LN scheme"
        raise AdminFlagError(
            f"{' and '.join(pre_ln)} (Pre-LN) cannot be combined with --admin-residual "
            f"{scheme}: {scheme} {kind}. For the Pre-LN baseline use --admin-residual admin "
            "--admin-init none"
        )


_PLACEMENT_WHAT = {
    "peri-ln": "a LayerNorm on the input and on the output of every sub-layer",
    "mix-ln": "Post-LN in the first floor(alpha L) layers of each stack, Pre-LN above; "
              "--mix-ln-alpha 0 is Pre-LN",
}


def _check_placement_scheme(args, scheme: str) -> None:
    # Peri-LN / Mix-LN: the plain shortcut x + f(x), their own placement in every layer
    if args.admin_init != "none":
        raise AdminFlagError(
            f"--admin-residual {scheme} uses the plain shortcut x + f(x) (Admin's omegas inside "
            f"another LayerNorm placement would be a new, untested scheme); it cannot be "
            f"combined with --admin-init {args.admin_init} (valid with {scheme}: --admin-init "
            f"none, the default for {scheme}; drop --admin-init), or use --admin-residual admin "
            "for Admin's omegas"
        )
    if args.admin_omega != "buffer":
        raise AdminFlagError(
            f"--admin-omega {args.admin_omega} is Admin's trainable omega and does not apply "
            f"to --admin-residual {scheme} (the plain shortcut x); valid with {scheme}: "
            "--admin-omega buffer (the default; drop --admin-omega)"
        )
    pre_ln = pre_ln_flags(args)
    if pre_ln:
        raise AdminFlagError(
            f"{' and '.join(pre_ln)} (Pre-LN) cannot be combined with --admin-residual "
            f"{scheme}: {scheme} sets every layer's LayerNorm placement itself "
            f"({_PLACEMENT_WHAT[scheme]}); drop {' and '.join(pre_ln)}"
        )
    if scheme == "mix-ln":
        for side in ("encoder", "decoder"):
            if getattr(args, f"{side}_layers", None) == 0:
                raise AdminFlagError(
                    f"--{side}-layers 0 cannot be combined with --admin-residual mix-ln: a "
                    "stack without layers has no Post-LN/Pre-LN split (alpha 0 would end it "
                    "with a LayerNorm, alpha 1 would not); use at least one layer"
                )


#: why ``--admin-norm dyt`` is refused with each of Admin's rivals (one line each)
DYT_REFUSED = {
    "deepnorm": "DeepNet derives its alpha and beta for Post-LN sub-layers whose LayerNorm "
                "normalises each sum LN(alpha x + f(x)), and DyT does not normalise",
    "rezero": "ReZero has no normalisation layer for DyT to replace",
    "rezero-post-ln": "ReZero starts every sub-layer as the identity (a = 0), which a "
                      "LayerNorm of a LayerNorm output keeps and DyT does not: tanh(alpha x) "
                      "shrinks the stream again at every sub-layer",
    "b2t": "B2T's bottom-to-top term and its N^(-1/2) initialisation answer the vanishing "
           "gradient through Post-LN's LayerNorms, an analysis of LayerNorm that does not "
           "carry over to DyT",
    "resi-dual": "ResiDual's stack output x_N + LN(d_N) needs a normalisation of the dual "
                 "stream, an unbounded sum of every branch output, which DyT's tanh would "
                 "saturate instead of normalise",
}


def check_norm_flags(args) -> None:
    """``--admin-norm``, ``--dyt-alpha-init`` and ``--mix-ln-alpha``: each refused where it
    would be silently ignored (given without DyT / without Mix-LN) or where the scheme
    assumes LayerNorm (Admin's omegas, closed form or profiled, and the rivals in
    :data:`DYT_REFUSED`); the two
    values validated and defaulted (DyT's 0.5, Mix-LN's 0.25) where they apply, None
    elsewhere."""
    scheme, norm = args.admin_residual, args.admin_norm
    alpha = getattr(args, "mix_ln_alpha", None)
    if alpha is not None and scheme != "mix-ln":
        raise AdminFlagError(
            f"--mix-ln-alpha {alpha} only applies to --admin-residual mix-ln (its fraction of "
            f"Post-LN layers per stack), but --admin-residual is {scheme}; use "
            "--admin-residual mix-ln or drop --mix-ln-alpha"
        )
    dyt_alpha = getattr(args, "dyt_alpha_init", None)
    if dyt_alpha is not None and norm != "dyt":
        raise AdminFlagError(
            f"--dyt-alpha-init {dyt_alpha} only applies to --admin-norm dyt (DyT's initial "
            f"tanh scale alpha), but --admin-norm is {norm}; add --admin-norm dyt or drop "
            "--dyt-alpha-init"
        )
    try:
        args.mix_ln_alpha = (check_mix_ln_alpha(MIX_LN_ALPHA if alpha is None else alpha)
                             if scheme == "mix-ln" else None)
        args.dyt_alpha_init = (check_dyt_alpha_init(DYT_ALPHA_INIT if dyt_alpha is None
                                                    else dyt_alpha)
                               if norm == "dyt" else None)
    except ValueError as e:
        raise AdminFlagError(str(e)) from None
    if norm != "dyt":
        return
    if scheme in DYT_REFUSED:
        raise AdminFlagError(
            f"--admin-norm dyt cannot be combined with --admin-residual {scheme}: "
            f"{DYT_REFUSED[scheme]}; valid with dyt: --admin-residual admin --admin-init none "
            "(Post-LN, Pre-LN), peri-ln, mix-ln"
        )
    if args.admin_init != "none":
        raise AdminFlagError(
            f"--admin-norm dyt cannot be combined with --admin-init {args.admin_init}: Admin's "
            "omegas give back the magnitude a LayerNorm divides out of each sum (the closed "
            "form assumes unit-variance LayerNorm outputs; the profile sets omega to the std "
            "of the sum, LayerNorm's divisor), and DyT (g * tanh(alpha x) + b) divides by no "
            "std (profiled with DyT the omegas fall below 1 and shrink the shortcut, the "
            "opposite of Admin); use --admin-init none (Post-LN or Pre-LN with DyT)"
        )


def check_flags(args) -> None:
    """Resolve the position flags and check every plugin flag of ``args`` (architecture
    defaults already applied); the first problem raises :class:`AdminFlagError`."""
    resolve_position_flags(args)
    admin_settings(args)  # validates every choice with a message naming the flag
    check_layer_counts(args)
    check_normalize_before(args)
    check_residual_scheme(args)
    check_norm_flags(args)
    admin_profile.check_profile_flags(args)
    check_compile_flags(args)


#: where every flag is described in full (the help texts are one or two lines)
FLAGS_DOC = "docs/usage.md#flags"


def add_args(parser) -> None:
    """The plugin's flags (``--admin-*``, ``--*-pos-emb``, ``--pos-emb-*``,
    ``--admin-profile-*``), added to fairseq's model-specific group; none has an argparse
    default, so None means "not given" (:func:`admin_base_architecture` fills them in).
    Their help texts here are one or two lines; ``docs/usage.md`` describes each flag in
    full."""
    add_residual_args(parser)
    add_norm_args(parser)
    add_position_args(parser)
    admin_profile.add_profile_args(parser)
    add_compile_args(parser)


def add_residual_args(parser) -> None:
    """The residual scheme and Admin's omegas: ``--admin-residual``, ``--admin-init``,
    ``--admin-output-change-scale``, ``--admin-omega``."""
    parser.add_argument(
        "--admin-residual", choices=RESIDUAL_SCHEMES,
        help="residual scheme of every sub-layer: admin = LN(x * omega + f(x)), or one of its "
        "rivals (formulas and papers: docs/schemes.md). Default: admin",
    )
    parser.add_argument(
        "--admin-init", choices=ADMIN_INIT_CHOICES,
        help="Admin's omega: closed-form (from the stack's depth), profile (measured on the "
        "first batch: --admin-profile-*) or none (omega 1: Post-LN/Pre-LN). Default: "
        "closed-form",
    )
    parser.add_argument(
        "--admin-output-change-scale", choices=OUTPUT_CHANGE_SCALES,
        help="--admin-init closed-form: omega^2 = (N+1)/ln(N+1) - 1 (O(logn)), N (O(1)) or "
        "1 (O(n)), N the stack's residual sub-layers. Default: O(logn)",
    )
    parser.add_argument(
        "--admin-omega", choices=OMEGA_FORMS,
        help="parameter = a trainable vector per sub-layer; buffer = a fixed scalar. Default: "
        "parameter with --admin-init closed-form/profile, else buffer",
    )


def add_norm_args(parser) -> None:
    """The normalisation: ``--mix-ln-alpha``, ``--admin-norm``, ``--dyt-alpha-init``."""
    parser.add_argument(
        "--mix-ln-alpha", type=float, metavar="ALPHA",
        help="--admin-residual mix-ln only: the fraction of each stack's layers (from the "
        "bottom) that are Post-LN, in [0, 1]. Default: 0.25",
    )
    parser.add_argument(
        "--admin-norm", choices=NORM_CHOICES,
        help="the normalisation module: layernorm, or dyt = g * tanh(alpha x) + b (with "
        f"Post-LN, Pre-LN, peri-ln, mix-ln only; see {FLAGS_DOC}). Default: layernorm",
    )
    parser.add_argument(
        "--dyt-alpha-init", type=float, metavar="FLOAT",
        help="--admin-norm dyt only: the initial alpha of every DyT, a positive number. "
        "Default: 0.5",
    )


def add_position_args(parser) -> None:
    """The absolute positions: ``--{encoder,decoder}-pos-emb``, ``--pos-emb-scaled-table``,
    ``--pos-emb-scale-init``."""
    for side in ("encoder", "decoder"):
        parser.add_argument(
            f"--{side}-pos-emb", choices=POS_EMB_CHOICES,
            help=f"{side} absolute positions (see {FLAGS_DOC}). Default: from "
            f"--{side}-learned-pos / --no-token-positional-embeddings, else sinusoidal",
        )
    parser.add_argument(
        "--pos-emb-scaled-table", choices=tuple(SCALED_TABLES),
        help="the sinusoid table of scaled-sinusoidal positions (both sides; see "
        f"{FLAGS_DOC}). Default: interleaved",
    )
    parser.add_argument(
        "--pos-emb-scale-init", type=float, metavar="FLOAT",
        help="initial value of the learnable scale of scaled-sinusoidal positions (both "
        "sides). Default: 1/sqrt(d)",
    )


def add_compile_args(parser) -> None:
    """``--admin-compile``."""
    parser.add_argument(
        "--admin-compile", choices=speed_compile.COMPILE_CHOICES,
        help="layers = compile each layer's training forward and backward with torch.compile "
        "(experimental: docs/speed.md); none = eager. Default: none",
    )


def _default(args, name, value):
    # the plugin's flags have no argparse default, so None means "not given"
    if getattr(args, name, None) is None:
        setattr(args, name, value)


def omega_applies(args) -> bool:
    """Whether the model has Admin's omegas: the admin residual with a closed-form or
    profiled initialisation (not omega 1, not a rival's own shortcut weight)."""
    return args.admin_residual == "admin" and args.admin_init in ("closed-form", "profile")


def admin_base_architecture(args):
    """Transformer base (512/2048/8 heads, 6L-6L) with the recommended Admin: closed-form
    O(logn) omegas, each a trainable vector. Where Admin's omega does not apply (``--admin-init
    none``, the rivals) it stays the fixed omega 1 buffer, so Post-LN is stock fairseq."""
    _default(args, "admin_residual", "admin")
    # the rivals set their own shortcut weights: Admin's omega stays 1 for them
    _default(args, "admin_init", "closed-form" if args.admin_residual == "admin" else "none")
    _default(args, "admin_output_change_scale", "O(logn)")
    _default(args, "admin_omega", "parameter" if omega_applies(args) else "buffer")
    _default(args, "admin_norm", "layernorm")
    _default(args, "admin_compile", "none")
    base_architecture(args)
