"""Position modules in fairseq's calling convention, one choice per side.

Choices (``--encoder-pos-emb`` / ``--decoder-pos-emb``):

* ``sinusoidal``: fairseq's own ``SinusoidalPositionalEmbedding`` (concatenated [sin | cos]
  halves, no parameters); the default, so admin checkpoints and stock ones agree.
* ``scaled-sinusoidal``: a sinusoid table times one learnable scalar (FLASH, arXiv
  2202.10447, App. D), :class:`ScaledSinusoidalPositions`. The table is
  ``--pos-emb-scaled-table`` (:data:`SCALED_TABLES`; default ``interleaved``) and the
  scalar starts at ``--pos-emb-scale-init`` (default the seed's ``1/sqrt(d)``). With
  ``--pos-emb-scaled-table fairseq --pos-emb-scale-init 1`` the model is, at
  initialisation, exactly the ``sinusoidal`` one plus the learnable scalar.
* ``learned``: fairseq's ``LearnedPositionalEmbedding`` (what ``--*-learned-pos`` gives).
* ``none``: no absolute positions on that side.

All modules take token ids ``(B, T)`` and return ``(B, T, C)`` (``(B, 1, C)`` or
``(1, 1, C)`` for one incremental step). Positions follow fairseq's ``make_positions``:
non-pad tokens are numbered ``padding_idx + 1, padding_idx + 2, ...`` from the left, pads get
``padding_idx`` (a zero row), so a left-padded sentence gets the same positions as the
unpadded one.

No module here reads tensor values back to the host in its forward: the largest position
is bounded by the input's *shape* (at most ``padding_idx + T``), so the range check is a
comparison of Python ints, made before the lookup.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fairseq import utils
from fairseq.modules import PositionalEmbedding

from fairseq_admin_pos.positional import SinusoidalEmbeddings

POS_EMB_CHOICES = ("sinusoidal", "scaled-sinusoidal", "learned", "none")

#: ``--pos-emb-scaled-table`` choice -> ``SinusoidalEmbeddings(frequency_layout=...)``:
#: ``interleaved`` = Vaswani's sin/cos pairs per frequency (the layout ``scaled-sinusoidal``
#: has always used), ``seed`` = the seed module's own per-column exponents, ``fairseq`` =
#: fairseq's [sin | cos] table, bitwise the one the ``sinusoidal`` choice uses
SCALED_TABLES = {"interleaved": "standard", "seed": "seed", "fairseq": "fairseq"}


class ScaledSinusoidalPositions(nn.Module):
    """A sinusoid table with a learnable scale, addressed by fairseq positions.

    ``out = table[make_positions(tokens)] * g`` with ``g`` a scalar parameter initialised to
    ``scale_init`` (default ``1/sqrt(C)``, the seed's and x-transformers' choice; note fairseq
    multiplies token embeddings by ``sqrt(C)``, so with that default positions start about
    ``sqrt(C)`` times weaker than with fairseq's unscaled sinusoid and ``g`` learns the
    balance). ``table`` picks the sinusoid (:data:`SCALED_TABLES`). The table has
    ``max_positions + padding_idx + 1`` rows like fairseq's learned table; row
    ``padding_idx`` is zero. Longer inputs are filtered by fairseq through
    :attr:`max_positions` (``--skip-invalid-size-inputs-valid-test``) or rejected with an
    ``IndexError`` naming ``n_position``, decided from the input's shape on the host (no
    device read); they never index out of range silently.

    The pure module is ``self.embed`` (:class:`fairseq_admin_pos.positional.SinusoidalEmbeddings`),
    so the state-dict keys are ``embed.embedding.weight`` (the table) and ``embed.scaling``.

    Shapes: tokens ``(B, T)`` -> ``(B, T, C)``; one incremental step -> ``(1, 1, C)``
    (broadcast over the batch by the decoder).
    """

    def __init__(
        self,
        max_positions: int,
        embedding_dim: int,
        padding_idx: int,
        table: str = "interleaved",
        scale_init: Optional[float] = None,
    ):
        super().__init__()
        if table not in SCALED_TABLES:
            raise ValueError(
                f"unknown scaled-sinusoid table {table!r}; valid choices: "
                f"{', '.join(SCALED_TABLES)}"
            )
        self.padding_idx = padding_idx
        self.max_positions = max_positions
        self.table = table
        self.embed = SinusoidalEmbeddings(
            max_positions + padding_idx + 1,
            embedding_dim,
            learnable_scaling=True,
            padding_idx=padding_idx,
            frequency_layout=SCALED_TABLES[table],
            scaling_init=scale_init,
        )

    def forward(
        self,
        input: torch.Tensor,
        incremental_state: Optional[dict] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if positions is not None:
            # arbitrary caller-given positions: the pure module's value check
            return self.embed(positions)
        # make_positions gives at most padding_idx + T; so does one incremental step
        last = self.padding_idx + input.size(1)
        if last >= self.embed.n_position:
            raise IndexError(
                f"scaled-sinusoid positions: an input of {input.size(1)} tokens needs position "
                f"padding_idx + {input.size(1)} = {last}, but the table has n_position = "
                f"{self.embed.n_position} rows (max positions {self.max_positions}: "
                "--max-source-positions / --max-target-positions)"
            )
        if incremental_state is not None:
            # one decoding step: every hypothesis is at the same position
            positions = input.new_full((1, 1), last)
        else:
            positions = utils.make_positions(input, self.padding_idx)
        return self.embed.lookup(positions)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, max_positions={self.max_positions}"


def build_positions(
    choice: str,
    max_positions: int,
    embedding_dim: int,
    padding_idx: int,
    scaled_table: Optional[str] = None,
    scale_init: Optional[float] = None,
) -> Optional[nn.Module]:
    """The position module for one side (``None`` for ``none``). ``scaled_table`` (default
    ``interleaved``) and ``scale_init`` (default ``1/sqrt(embedding_dim)``) only apply to
    ``scaled-sinusoidal``."""
    if choice == "none":
        return None
    if choice == "scaled-sinusoidal":
        return ScaledSinusoidalPositions(
            max_positions, embedding_dim, padding_idx,
            table=scaled_table or "interleaved", scale_init=scale_init,
        )
    if choice in ("sinusoidal", "learned"):
        return PositionalEmbedding(
            max_positions, embedding_dim, padding_idx, learned=(choice == "learned")
        )
    raise ValueError(
        f"unknown position embedding {choice!r}; valid choices: {', '.join(POS_EMB_CHOICES)}"
    )
