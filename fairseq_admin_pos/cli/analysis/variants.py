"""The model families ``fairseq-admin-analyze`` compares: :data:`VARIANTS` maps a name to its
extra ``admin_transformer`` flags and an optional ``prepare(model, net_input)`` run after
building (Admin's profiling, :func:`profile_admin`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from fairseq_admin_pos.models import admin_profile


def profile_admin(model, net_input, seed: int = 1) -> None:
    """Admin's profiling on the analysis batch, as ``--admin-init profile`` does on the first
    training batch: in the model's ``--admin-profile-mode`` (clinic, the default: a
    training-mode pass whose dropout masks come from ``seed``, as fairseq seeds its first
    step; eval: no dropout). The caller's random stream is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        omegas, _ = admin_profile.measure(model, [net_input], mode=model.admin_profile.mode)
    admin_profile.apply(model, omegas)


@dataclass(frozen=True)
class Variant:
    """One model family: ``model_args`` are extra ``admin_transformer`` flags; ``prepare``
    (optional) runs once on the built float32 eval model and the input batch."""

    label: str
    model_args: Tuple[str, ...]
    prepare: Optional[Callable] = field(default=None, compare=False)


#: name -> variant; a new residual scheme is one more entry with its admin_transformer flags.
VARIANTS: Dict[str, Variant] = {
    "post-ln": Variant("Post-LN", ("--admin-init", "none")),
    "pre-ln": Variant(
        "Pre-LN",
        ("--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before"),
    ),
    "admin-closed-form": Variant(
        "Admin closed-form O(log N)",
        ("--admin-init", "closed-form", "--admin-output-change-scale", "O(logn)"),
    ),
    # eval-mode statistics: the omegas of a dropout-free pass, comparable across depths (the
    # default clinic mode adds the dropout masks of one step; see fairseq_admin_pos.profiling)
    "admin-profile": Variant("Admin profiled (eval mode)",
                             ("--admin-init", "profile", "--admin-profile-mode", "eval"),
                             prepare=profile_admin),
    # the rivals (fairseq_admin_pos.schemes)
    "deepnorm": Variant("DeepNorm", ("--admin-residual", "deepnorm")),
    "rezero": Variant("ReZero (no LN)", ("--admin-residual", "rezero")),
    "rezero-post-ln": Variant("ReZero Post-LN", ("--admin-residual", "rezero-post-ln")),
    "b2t": Variant("B2T connection", ("--admin-residual", "b2t")),
    "resi-dual": Variant("ResiDual", ("--admin-residual", "resi-dual")),
    # the LayerNorm placements of issue 39 (fairseq_admin_pos.placements) and DyT in place of
    # LayerNorm (fairseq_admin_pos.norms); Admin's omegas are not defined with DyT
    "peri-ln": Variant("Peri-LN", ("--admin-residual", "peri-ln")),
    "mix-ln": Variant("Mix-LN (alpha 0.25)", ("--admin-residual", "mix-ln")),
    "post-ln-dyt": Variant("Post-LN, DyT", ("--admin-init", "none", "--admin-norm", "dyt")),
    "pre-ln-dyt": Variant(
        "Pre-LN, DyT",
        ("--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before",
         "--admin-norm", "dyt"),
    ),
    "peri-ln-dyt": Variant("Peri-LN, DyT", ("--admin-residual", "peri-ln", "--admin-norm", "dyt")),
    "mix-ln-dyt": Variant("Mix-LN (alpha 0.25), DyT",
                          ("--admin-residual", "mix-ln", "--admin-norm", "dyt")),
}

#: what ``--variants`` runs when not given
DEFAULT_VARIANTS = ("post-ln", "pre-ln", "admin-closed-form", "admin-profile")
