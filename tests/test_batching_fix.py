"""fairseq's compiled batch_by_size drops the tail (< required_batch_size_multiple sentences);
with the plugin loaded every index is batched exactly once."""
import numpy as np
import pytest

import fairseq_admin_pos  # noqa: F401
from fairseq.data import data_utils


@pytest.mark.parametrize("n", [1, 7, 20, 24, 3003])
@pytest.mark.parametrize("max_tokens,max_sentences", [(None, 64), (4096, None), (100, 5)])
@pytest.mark.parametrize("mult", [1, 8])
def test_every_index_batched_once(n, max_tokens, max_sentences, mult):
    rng = np.random.default_rng(n)
    indices = rng.permutation(n).astype(np.int64)
    sizes = rng.integers(3, 12, size=n).astype(np.int64)
    batches = data_utils.batch_by_size(indices, None, num_tokens_vec=sizes[indices],
                                       max_tokens=max_tokens, max_sentences=max_sentences,
                                       required_batch_size_multiple=mult)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(n))
    assert flat.tolist() == indices.tolist()  # original order kept
    if max_sentences:
        assert max(len(b) for b in batches) <= max_sentences
