"""``fairseq_admin_pos.export.ct2.translate``'s fairseq last step timed apart from the search.

A stand-in translator whose searches and forced decoding take known times (sleeps) and return
fixed hypotheses: ``translate(..., fallback=FallbackTime())`` returns what it returns without
one, counts exactly the sentences whose best hypothesis reached the length limit, and its
seconds hold the second search and the per-sentence ``score_batch`` calls but not the first
search; a batch with no such sentence adds nothing; one object sums several calls. (The same
on a real CTranslate2 model: tests/test_export_cli.py and tests/test_deploy_speed_cells.py.)
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from fairseq_admin_pos.export.ct2 import FallbackTime, translate

FIRST, SECOND, SCORE = 0.06, 0.04, 0.02  # seconds each call of the stand-in takes


class Slow:
    """Sources ``rK`` reach the limit (no EOS), the others end with EOS; every call sleeps."""

    def __init__(self):
        self.calls = []

    def translate_batch(self, batch, max_decoding_length, **kw):
        first = max_decoding_length == 3  # max_len_b 2 + 1; the second search stops at 2
        self.calls.append(("first" if first else "second", [s for s, in batch]))
        time.sleep(FIRST if first else SECOND)
        out = []
        for (s,) in batch:
            hyps = [["a", "b", "c"], ["a", "</s>"]] if s.startswith("r") else [["d", "</s>"]]
            out.append(SimpleNamespace(hypotheses=hyps, scores=[-0.5, -0.7]))
        return out

    def score_batch(self, sources, targets):
        self.calls.append(("score", [s for s, in sources]))
        time.sleep(SCORE)
        return [SimpleNamespace(log_probs=[-0.1] * (len(t) + 1)) for t in targets]


def test_fallback_counts_and_times_only_the_last_step():
    sources = [["r1"], ["x"], ["r2"], ["y"]]
    plain = translate(Slow(), sources, beam=2, lenpen=1.0, max_len_b=2)
    slow, fallback = Slow(), FallbackTime()
    t0 = time.perf_counter()
    timed = translate(slow, sources, beam=2, lenpen=1.0, max_len_b=2, fallback=fallback)
    total = time.perf_counter() - t0
    assert timed == plain
    assert [kind for kind, _ in slow.calls] == ["first", "second", "score", "score"]
    assert slow.calls[1] == ("second", ["r1", "r2"])
    assert fallback.sentences == 2
    # the second search and both score_batch calls are inside, the first search is not
    assert SECOND + 2 * SCORE <= fallback.seconds <= total - FIRST


def test_no_sentence_at_the_limit_adds_nothing_and_calls_add_up():
    fallback = FallbackTime()
    translate(Slow(), [["x"], ["y"]], beam=2, lenpen=1.0, max_len_b=2, fallback=fallback)
    assert fallback == FallbackTime(0, 0.0)
    translate(Slow(), [["r1"]], beam=2, lenpen=1.0, max_len_b=2, fallback=fallback)
    seconds = fallback.seconds
    translate(Slow(), [["r2"], ["r3"]], beam=2, lenpen=1.0, max_len_b=2, batch_size=1,
              fallback=fallback)
    assert fallback.sentences == 3
    assert fallback.seconds >= seconds + 2 * (SECOND + SCORE)


def test_translate_without_fallback_object_is_unchanged():
    """The default: no object, the same results (the forced-EOS step still runs)."""
    slow = Slow()
    out = translate(slow, [["r1"], ["x"]], beam=2, lenpen=1.0, max_len_b=2)
    assert [kind for kind, _ in slow.calls] == ["first", "second", "score"]
    assert out[1] == (["d"], pytest.approx(-0.5))
