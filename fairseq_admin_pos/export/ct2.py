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
  outputs agree exactly where no hypothesis reaches it (fairseq's forced EOS has no
  CTranslate2 counterpart). :func:`translate` sorts sentences by length and gives each
  batch the limit fairseq would give it.
* **padding**: fairseq never generates ``<pad>`` (its log-probability is set to -inf);
  CTranslate2's converter renames it ``<blank>``, which ``suppress_sequences`` disables.
* **input**: fairseq appends EOS to the source and starts the target with EOS; the
  converter sets ``add_source_eos`` and ``decoder_start_token = </s>`` for that.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["max_decoding_length", "translate"]

#: the converter's name for fairseq's <pad> (ctranslate2.converters.fairseq._get_vocab)
CT2_PAD = "<blank>"


def max_decoding_length(source_len: int, max_len_a: float, max_len_b: int) -> int:
    """CTranslate2's step limit for a batch whose longest source has ``source_len`` tokens
    (without EOS), matching fairseq's ``int(max_len_a * (source_len + 1) + max_len_b)``
    tokens before the forced EOS."""
    return int(max_len_a * (source_len + 1) + max_len_b) + 1


def translate(translator, sources: Sequence[Sequence[str]], beam: int, lenpen: float,
              max_len_a: float = 0.0, max_len_b: int = 200, batch_size: int = 64
              ) -> List[Tuple[List[str], float]]:
    """``(tokens, score)`` per source, in input order: CTranslate2's best hypothesis with
    fairseq-generate's settings (module docstring); ``score`` is the length-normalised
    natural-log score."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: List[Tuple[List[str], float]] = [None] * len(sources)  # type: ignore[list-item]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = [list(sources[i]) for i in chunk]
        limit = max_decoding_length(max(len(s) for s in batch), max_len_a, max_len_b)
        out = translator.translate_batch(
            batch, beam_size=beam, length_penalty=lenpen, max_decoding_length=limit,
            return_scores=True, suppress_sequences=[[CT2_PAD]])
        for i, res in zip(chunk, out):
            results[i] = (list(res.hypotheses[0]), float(res.scores[0]))
    return results
