"""CTranslate2 beam search with fairseq-generate's settings (the ``deploy`` extra).

How ``fairseq-generate --beam K --lenpen L --max-len-a A --max-len-b B`` (fairseq 0.12
``SequenceGenerator``) maps onto ``ctranslate2.Translator.translate_batch`` (4.8.5,
``src/decoding.cc``):

* **beam**: ``beam_size=K``. Both expand 2K candidates per step, finish a hypothesis when
  one of the first K candidates is EOS, and stop a sentence once K hypotheses are finished
  (CTranslate2's ``patience=1``); neither can end at the first step (``min_len`` /
  ``min_decoding_length`` 1).
* **length penalty**: both rank finished hypotheses by ``sum(log p) / n**L`` with ``n``
  counting the EOS token (fairseq: ``step + 1``; CTranslate2 scores with EOS in the
  hypothesis, then strips it): ``length_penalty=L``. Scores are natural logs in
  CTranslate2, base 2 in fairseq-generate's ``H-`` lines.
* **max length**: fairseq allows ``max_len = int(A * S + B)`` tokens and then forces EOS,
  ``S`` being the *batch's* padded source length with its EOS; CTranslate2 makes at most
  ``max_decoding_length`` steps, EOS included, and at the last step keeps whatever token
  scored best. ``max_decoding_length = max_len + 1`` gives both the same limit; the
  searches are the same up to the last step. :func:`translate` sorts sentences by length
  and gives each batch the limit fairseq would give it.
* **forced EOS** (no CTranslate2 counterpart): at that last step fairseq scores each of the
  K live hypotheses with EOS appended, CTranslate2 keeps the K best free continuations.
  Where CTranslate2's best hypothesis ended with EOS the two agree: a forced hypothesis
  scores at most what the same beam's best continuation scores (same length, and EOS is one
  of the continuations), and every continuation of a beam CTranslate2 dropped scores below
  the ones it kept. Where its best reached the limit, :func:`translate` does fairseq's
  last step afterwards. The live beams are what the same search stopped one step earlier
  (``max_decoding_length = max_len``) returns without EOS: CTranslate2 keeps the K best
  candidates of that step, fairseq's live beams are the K best that are not EOS, the same
  set unless one of the K was EOS. Those, the finished hypotheses of both searches and the
  reached-limit hypotheses cut to ``max_len`` tokens are rescored with EOS appended by
  forced decoding (``score_batch``: fairseq's log-probabilities, CTranslate2 appending EOS)
  and ranked as fairseq ranks them. What can still differ: a live beam that ranked below K
  at the step before the limit, and a hypothesis finished earlier that neither search
  returned (each returns K); on the demo's test set (docs/deployment.md) no sentence was left with a
  difference at the limit.
* **padding**: fairseq never generates ``<pad>`` (its log-probability is set to -inf);
  CTranslate2's converter renames it ``<blank>``, which ``suppress_sequences`` disables.
* **input**: fairseq appends EOS to the source and starts the target with EOS; the
  converter sets ``add_source_eos`` and ``decoder_start_token = </s>`` for that.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["FallbackTime", "max_decoding_length", "translate"]

#: the converter's name for fairseq's <pad> (ctranslate2.converters.fairseq._get_vocab)
CT2_PAD = "<blank>"
#: fairseq's EOS, which the converter keeps as the end token
EOS = "</s>"


@dataclass
class FallbackTime:
    """What :func:`translate` spent on fairseq's last step (module docstring, "forced EOS"):
    ``sentences`` whose best hypothesis reached the length limit, and the ``seconds`` of the
    second beam search and the per-sentence ``score_batch`` calls they took. Pass one to
    ``translate(..., fallback=...)``; it adds to the counts, so one object can sum calls."""

    sentences: int = 0
    seconds: float = 0.0


def max_decoding_length(source_len: int, max_len_a: float, max_len_b: int) -> int:
    """CTranslate2's step limit for a batch whose longest source has ``source_len`` tokens
    (without EOS), matching fairseq's ``int(max_len_a * (source_len + 1) + max_len_b)``
    tokens before the forced EOS."""
    return int(max_len_a * (source_len + 1) + max_len_b) + 1


def translate(translator, sources: Sequence[Sequence[str]], beam: int, lenpen: float,
              max_len_a: float = 0.0, max_len_b: int = 200, batch_size: int = 64,
              references: Optional[Sequence[Sequence[str]]] = None,
              fallback: Optional[FallbackTime] = None) -> List[Tuple[List[str], float]]:
    """``(tokens, score)`` per source, in input order: CTranslate2's best hypothesis with
    fairseq-generate's settings, fairseq's forced EOS done afterwards where the best
    reached the length limit (module docstring); ``score`` is the length-normalised
    natural-log score (with EOS counted).

    Batches are fairseq's (``--batch-size``, no ``--max-tokens``): sentences sorted by
    source length, ties in input order (fairseq-interactive, and fairseq-generate on a split
    without targets), or, given the tokenised ``references``, ties by reference length
    first (fairseq-generate on a split with targets, ``LanguagePairDataset.ordered_indices``).
    The batch decides the length limit, so this matters only where a hypothesis reaches it.

    ``fallback`` (a :class:`FallbackTime`), if given, gets the sentences that took the last
    step and its seconds added: a caller timing ``translate`` can tell CTranslate2's search
    from that step, which costs most on models that run to the limit.
    """
    if references is not None and len(references) != len(sources):
        raise ValueError(f"{len(references)} references for {len(sources)} sources")
    order = sorted(range(len(sources)), key=lambda i: (
        len(sources[i]), 0 if references is None else len(references[i])))
    results: List[Tuple[List[str], float]] = [None] * len(sources)  # type: ignore[list-item]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = [list(sources[i]) for i in chunk]
        limit = max_decoding_length(max(len(s) for s in batch), max_len_a, max_len_b)
        out = translator.translate_batch(
            batch, beam_size=beam, num_hypotheses=beam, length_penalty=lenpen,
            max_decoding_length=limit, return_scores=True, return_end_token=True,
            suppress_sequences=[[CT2_PAD]])
        at_limit = []
        for i, res in zip(chunk, out):
            best = list(res.hypotheses[0])
            if best and best[-1] == EOS:
                results[i] = (best[:-1], float(res.scores[0]))
            else:
                at_limit.append(i)
        if not at_limit:
            continue
        t0 = time.perf_counter()
        # the same searches stopped one step earlier: their unfinished hypotheses are the
        # beams fairseq forces EOS onto
        before = translator.translate_batch(
            [list(sources[i]) for i in at_limit], beam_size=beam, num_hypotheses=beam,
            length_penalty=lenpen, max_decoding_length=limit - 1, return_scores=True,
            return_end_token=True, suppress_sequences=[[CT2_PAD]])
        for i, res in zip(at_limit, before):
            hypotheses = list(out[chunk.index(i)].hypotheses) + list(res.hypotheses)
            results[i] = _force_eos(translator, list(sources[i]), hypotheses, limit - 1, lenpen)
        if fallback is not None:
            fallback.sentences += len(at_limit)
            fallback.seconds += time.perf_counter() - t0
    return results


def _force_eos(translator, source: List[str], hypotheses, max_len: int, lenpen: float
               ) -> Tuple[List[str], float]:
    """fairseq's last step for one sentence whose best hypothesis reached the limit: the
    finished hypotheses as they are, the others cut to ``max_len`` tokens (EOS follows),
    duplicates once, all scored by forced decoding (CTranslate2 appends EOS) and ranked by
    ``sum(log p) / n**lenpen``, ``n`` counting EOS, as fairseq ranks them."""
    candidates: List[List[str]] = []
    for hyp in hypotheses:
        hyp = list(hyp)
        tokens = hyp[:-1] if hyp and hyp[-1] == EOS else hyp[:max_len]
        if tokens not in candidates:
            candidates.append(tokens)
    scored = translator.score_batch([source] * len(candidates), candidates)
    scores = [sum(r.log_probs) / len(r.log_probs) ** lenpen for r in scored]
    best = max(range(len(candidates)), key=lambda k: (scores[k], -k))  # ties: CT2's order
    return candidates[best], float(scores[best])
