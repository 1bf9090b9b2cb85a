"""Position modules in fairseq's calling convention, one choice per side.

Choices (``--encoder-pos-emb`` / ``--decoder-pos-emb``):

* ``sinusoidal``: fairseq's own ``SinusoidalPositionalEmbedding`` (concatenated [sin | cos]
  halves, no parameters); the default, so admin checkpoints and stock ones agree.
* ``scaled-sinusoidal``: the seed's sinusoid table times one learnable scalar initialised to
  ``1/sqrt(d)`` (FLASH, arXiv 2202.10447, App. D), :class:`ScaledSinusoidalPositions`.
* ``learned``: fairseq's ``LearnedPositionalEmbedding`` (what ``--*-learned-pos`` gives).
* ``none``: no absolute positions on that side.

All modules take token ids ``(B, T)`` and return ``(B, T, C)`` (``(B, 1, C)`` for one
incremental step). Positions follow fairseq's ``make_positions``: non-pad tokens are numbered
``padding_idx + 1, padding_idx + 2, ...`` from the left, pads get ``padding_idx`` (a zero row),
so a left-padded sentence gets the same positions as the unpadded one.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fairseq import utils
from fairseq.modules import PositionalEmbedding

from fairseq_admin_pos.positional import SinusoidalEmbeddings

POS_EMB_CHOICES = ("sinusoidal", "scaled-sinusoidal", "learned", "none")


class ScaledSinusoidalPositions(nn.Module):
    """Seed sinusoid table with a learnable scale, addressed by fairseq positions.

    ``out = table[make_positions(tokens)] * g`` with ``g`` a scalar parameter initialised to
    ``1/sqrt(C)`` (the seed's and x-transformers' choice; note fairseq multiplies token
    embeddings by ``sqrt(C)``, so positions start small next to tokens and ``g`` learns the
    balance). The table has ``max_positions + padding_idx + 1`` rows like fairseq's learned
    table; row ``padding_idx`` is zero. Longer inputs are filtered by fairseq through
    :attr:`max_positions` (``--skip-invalid-size-inputs-valid-test``) or rejected with an
    error naming ``n_position``; they never index out of range silently.

    Shapes: tokens ``(B, T)`` -> ``(B, T, C)``.
    """

    def __init__(self, max_positions: int, embedding_dim: int, padding_idx: int):
        super().__init__()
        self.padding_idx = padding_idx
        self.max_positions = max_positions
        self.embed = SinusoidalEmbeddings(
            max_positions + padding_idx + 1,
            embedding_dim,
            learnable_scaling=True,
            padding_idx=padding_idx,
        )

    def forward(
        self,
        input: torch.Tensor,
        incremental_state: Optional[dict] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if positions is None:
            if incremental_state is not None:
                # one decoding step: every hypothesis is at the same position
                positions = input.new_full((1, 1), self.padding_idx + input.size(1))
            else:
                positions = utils.make_positions(input, self.padding_idx)
        return self.embed(positions)


def build_positions(
    choice: str, max_positions: int, embedding_dim: int, padding_idx: int
) -> Optional[nn.Module]:
    """The position module for one side (``None`` for ``none``)."""
    if choice == "none":
        return None
    if choice == "scaled-sinusoidal":
        return ScaledSinusoidalPositions(max_positions, embedding_dim, padding_idx)
    if choice in ("sinusoidal", "learned"):
        return PositionalEmbedding(
            max_positions, embedding_dim, padding_idx, learned=(choice == "learned")
        )
    raise ValueError(
        f"unknown position embedding {choice!r}; valid choices: {', '.join(POS_EMB_CHOICES)}"
    )
