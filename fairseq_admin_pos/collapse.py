r"""Encoder collapse: how alike an encoder makes different source tokens (pure torch).

The measure is the mean cosine similarity over all pairs of different token vectors,

    cos = (|sum_i u_i|^2 - N) / (N (N - 1)),     u_i = x_i / |x_i|,

over the ``N`` real (non-pad) tokens of a batch, every sentence's tokens pooled: the sum of the
``N x N`` cosine matrix is ``|sum_i u_i|^2``, its diagonal ``N``, so the matrix itself is never
built (``O(N C)``, not ``O(N^2 C)``). A value near 1 is a *collapsed* encoder: every token of
every sentence hands the decoder nearly one vector, and the translation cannot depend on the
source (the rank collapse of deep attention stacks, Dong, Cordonnier and Loukas 2021,
"Attention is not all you need: pure attention loses rank doubly exponentially with depth",
arXiv 2103.03404). What the measure showed in the package's depth study, and on which runs
the warning's line was set: docs/training.md#the-encoder-collapse-warning.

Two entry points share the formula:

* :func:`mean_pairwise_cosine` on an ``(N, C)`` matrix, in float64, returning a Python float:
  the offline measure (``fairseq-admin-analyze --checkpoint``, the depth study's probe);
* :func:`token_cosine` on a stack's ``(T, B, C)`` output and fairseq's ``(B, T)`` padding mask,
  in float32, returning a 0-dim tensor on the input's device without reading anything back to
  the host: what the encoder records in each training forward and the training monitor logs
  as ``enc_tok_cos`` (:mod:`fairseq_admin_pos.models.monitoring`). Pads are weighted out
  instead of indexed out, since boolean indexing would need the count on the host.

:func:`collapse_warning` turns one logging interval's mean of that training value into the
monitor's one-line warning: over :data:`COLLAPSE_COS` for a whole interval after the warmup.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

#: The rule: an interval-mean ``enc_tok_cos`` above this, for a whole logging interval after
#: the learning rate's warmup, is reported as a collapsed encoder (a run that trains may pass
#: above it while it first learns the target language, before its warmup ends). The line was
#: set on one recipe and one width, so the monitor warns and never stops a run; the runs it was
#: set and checked on: docs/training.md#the-encoder-collapse-warning.
COLLAPSE_COS = 0.9


def collapse_warning(cos: float, first_update: int, last_update: int,
                     warmup_updates: int) -> Optional[str]:
    """The training monitor's warning for a logging interval whose updates ``first_update`` to
    ``last_update`` had a mean encoder token cosine ``cos``, or None: None unless the learning
    rate has a warmup (``warmup_updates > 0``; without one nothing says when a high value stops
    being the early phase every run passes through), the whole interval is after it
    (``first_update > warmup_updates``) and ``cos > COLLAPSE_COS`` (NaN, an interval with no
    two real source tokens, is never above)."""
    if warmup_updates <= 0 or first_update <= warmup_updates or math.isnan(cos) \
            or cos <= COLLAPSE_COS:
        return None
    return (f"enc_tok_cos {cos:.4f} over updates {first_update}-{last_update}, after the "
            f"{warmup_updates}-update warmup: the encoder gives different source tokens nearly "
            f"the same output (a collapsed encoder), so the decoder can hardly use the source "
            f"(rule: a whole logging interval after the warmup above {COLLAPSE_COS}; a warning, "
            f"not a stop). A lower --lr or a longer schedule (--warmup-updates, --max-update) "
            f"may avoid it: docs/training.md#the-encoder-collapse-warning; warned once per run")


def mean_pairwise_cosine(vectors: Tensor) -> float:
    """Mean cosine similarity over all pairs of different rows of ``vectors`` ``(N, C)``,
    N >= 2 (float64; the formula in the module docstring). 1 when every row points the same
    way; about 0 for unrelated directions."""
    if vectors.size(0) < 2:
        raise ValueError(f"mean_pairwise_cosine needs 2 or more rows, got {vectors.size(0)}")
    u = torch.nn.functional.normalize(vectors.double(), dim=-1)
    n = u.size(0)
    return float((u.sum(0).pow(2).sum() - n) / (n * (n - 1)))


def token_cosine(x: Tensor, pad_mask: Tensor) -> Tensor:
    """The mean pairwise cosine of the real tokens of ``x`` ``(T, B, C)`` (``pad_mask``
    ``(B, T)``, True at pads): a 0-dim float32 tensor on ``x``'s device, NaN with fewer than
    two real tokens. No autograd, no host read; float32 also under ``--amp``'s autocast,
    which would run the product below in half precision, where ``|sum_i u_i|^2`` overflows
    past about 256 tokens."""
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        xf = x.detach().float()
        real = (~pad_mask).t().to(xf.dtype)  # (T, B)
        # sum_i u_i as one (1, TB) @ (TB, C) product with per-token weights 1/|x_i| (0 at
        # pads): no normalised copy of x (6x faster than F.normalize then a masked sum on
        # one CPU thread at (30, 140, 128)); the clamp is F.normalize's eps
        weight = real / torch.linalg.vector_norm(xf, dim=-1).clamp_min(1e-12)
        t, b, c = xf.shape
        total = weight.reshape(1, t * b) @ xf.reshape(t * b, c)
        n = real.sum()
        value = (total.pow(2).sum() - n) / (n * (n - 1)).clamp_min(1.0)
        return torch.where(n >= 2, value, torch.full_like(value, float("nan")))
