"""The model families ``fairseq-admin-analyze`` compares: :data:`VARIANTS` maps a scheme name
of :mod:`fairseq_admin_pos.scheme_flags` to its ``admin_transformer`` flags and an optional
``prepare(model, net_input)`` run after building (Admin's profiling, :func:`profile_admin`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

import fairseq  # noqa: F401  (the plugin registers first: its model modules import fairseq)
from fairseq_admin_pos.models import admin_profile
from fairseq_admin_pos.scheme_flags import TABLE


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


#: the schemes whose omegas are profiled: their ``prepare`` profiles on the analysis batch
PROFILED = ("admin-paper", "admin-profile")

#: the table's schemes the tool compares (``post-ln-paper``, ``pre-ln-paper`` and ``kasai``
#: differ from ``post-ln`` / ``pre-ln`` in their training only)
NAMES = ("post-ln", "pre-ln", "admin", "admin-paper", "admin-profile", "deepnorm", "rezero",
         "rezero-post-ln", "b2t", "resi-dual", "peri-ln", "mix-ln", "post-ln-dyt", "pre-ln-dyt",
         "peri-ln-dyt", "mix-ln-dyt")

#: name -> variant, from :data:`fairseq_admin_pos.scheme_flags.TABLE` (the model flags of
#: the scheme of that name; its optimizer does not matter at initialisation). A new scheme
#: is one more entry there. ``admin-paper`` profiles as Transformer-Clinic (a training-mode
#: pass with the dropout masks of one step); ``admin-profile`` takes eval-mode statistics,
#: a dropout-free pass whose omegas are comparable across depths (docs/analysis.md).
VARIANTS: Dict[str, Variant] = {
    name: Variant(TABLE[name].label, TABLE[name].model,
                  prepare=profile_admin if name in PROFILED else None)
    for name in NAMES
}

#: what ``--variants`` runs when not given
DEFAULT_VARIANTS = ("post-ln", "pre-ln", "admin", "admin-profile")
