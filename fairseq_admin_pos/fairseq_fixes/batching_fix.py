"""Keep the last sentences of a split that fairseq's batching drops.

The compiled ``batch_by_size_vec`` of the fairseq build we run on (ve-fairseq 0.12.3, upstream
main) drops the tail of the index list when fewer than ``required_batch_size_multiple``
(default 8) sentences are left: 20 sentences come back as one batch of 16, newstest2014's
3003 as 3000. ``fairseq-generate`` then translates, and scores, only part of the test set,
and ``fairseq-validate`` measures part of the valid set, without a word.

:func:`install` wraps ``fairseq.data.data_utils.batch_by_size`` (the one function every
dataset's ``batch_by_size`` calls): whatever indices are missing from its result are
appended, in their original order, as final batch(es) of at most ``max_sentences``. When
nothing is missing the result is returned untouched.
"""
from __future__ import annotations

import functools

import numpy as np

from fairseq_admin_pos.fairseq_fixes import patches


def _complete(batch_by_size):
    @functools.wraps(batch_by_size)
    def wrapper(indices, num_tokens_fn, num_tokens_vec=None, max_tokens=None, max_sentences=None,
                required_batch_size_multiple=1, fixed_shapes=None):
        batches = batch_by_size(indices, num_tokens_fn, num_tokens_vec=num_tokens_vec,
                                max_tokens=max_tokens, max_sentences=max_sentences,
                                required_batch_size_multiple=required_batch_size_multiple,
                                fixed_shapes=fixed_shapes)
        if fixed_shapes is not None:
            return batches  # fixed shapes drop what does not fit by design
        indices = np.asarray(indices, dtype=np.int64)
        covered = sum(len(b) for b in batches)
        if covered >= len(indices):
            return batches
        seen = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        missing = indices[~np.isin(indices, seen)]
        step = int(max_sentences) if max_sentences else len(missing)
        batches = list(batches)
        for start in range(0, len(missing), max(step, 1)):
            batches.append(missing[start:start + step])
        return batches

    return wrapper


def install() -> None:
    """Wrap ``fairseq.data.data_utils.batch_by_size`` once (idempotent; listed in
    :mod:`.patches`, which imports fairseq only now)."""
    patches.wrap("fairseq.data.data_utils.batch_by_size", _complete)
