"""Scoring ``fairseq-generate`` output: tokenized BLEU, sacreBLEU, compound-split BLEU."""

from __future__ import annotations

import re
from typing import Dict

from . import RecipeError
from .text import read_lines

_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split(line: str) -> str:
    """``a-b`` -> ``a ##AT##-##AT## b`` (non-overlapping, left to right), as in
    tensor2tensor's get_ende_bleu.sh and fairseq's compound_split_bleu.sh, applied to the
    tokenized hypothesis and reference before BLEU. On ``-a`` tokenized text the Moses
    ``@-@`` becomes ``@ ##AT##-##AT## @``: the convention behind the published WMT numbers."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def read_generate_hypotheses(path: str) -> Dict[int, str]:
    """``{sentence id: hypothesis}`` from ``fairseq-generate`` output (``H-<id>\\t<score>\\t<text>``
    lines; with ``--nbest > 1`` the first, best, hypothesis of each id)."""
    hyps: Dict[int, str] = {}
    for line in read_lines(path):
        if line.startswith("H-"):
            fields = line.split("\t")
            sent_id = int(fields[0][2:])
            if sent_id not in hyps:
                hyps[sent_id] = fields[2] if len(fields) > 2 else ""
    return hyps


def score_generation(generate_output: str, tok_ref: str, raw_ref: str, lang: str,
                     compound: bool, lowercase: bool) -> Dict[str, object]:
    """BLEU of a ``fairseq-generate --remove-bpe`` output.

    * ``tokenized``: corpus BLEU-4 without smoothing (multi-bleu.perl; sacrebleu
      ``tokenize="none"``) of the hypotheses against the Moses-tokenized reference. This is
      the Admin paper's scoring: Transformer-Clinic's ``eval_*.sh`` report the BLEU4 line of
      ``fairseq-generate --remove-bpe``, i.e. this BLEU against the tokenized references of
      the binarized test set (those hold ``<unk>`` where a reference character is missing
      from the dictionary; here the reference text itself is used);
    * ``compound_split`` (with ``compound``): the same after :func:`compound_split` of
      hypotheses and references, tensor2tensor's ``get_ende_bleu.sh`` convention (Vaswani
      et al. 2017, fairseq's ``compound_split_bleu.sh``); not the Admin paper's scoring;
    * ``sacrebleu``: the hypotheses detokenized with sacremoses, scored against the raw,
      untokenized reference with sacreBLEU's defaults (13a), ``lowercase`` for the
      lowercased IWSLT setup, with the signature.
    """
    from sacrebleu.metrics import BLEU
    from sacremoses import MosesDetokenizer

    refs_tok = list(read_lines(tok_ref))
    refs_raw = list(read_lines(raw_ref))
    if len(refs_tok) != len(refs_raw):
        raise RecipeError(f"{tok_ref} has {len(refs_tok)} lines but {raw_ref} {len(refs_raw)}")
    hyps = read_generate_hypotheses(generate_output)
    missing = [i for i in range(len(refs_tok)) if i not in hyps]
    if missing or len(hyps) != len(refs_tok):
        raise RecipeError(
            f"{generate_output} has {len(hyps)} hypotheses for a {len(refs_tok)}-line reference "
            f"(missing ids e.g. {missing[:5]}): was the test set generated completely?"
        )
    hyp_tok = [hyps[i] for i in range(len(refs_tok))]
    plain = BLEU(tokenize="none", smooth_method="none", force=True)
    result: Dict[str, object] = {
        "sentences": len(hyp_tok),
        "tokenized": plain.corpus_score(hyp_tok, [refs_tok]).score,
    }
    if compound:
        split = BLEU(tokenize="none", smooth_method="none", force=True)
        result["compound_split"] = split.corpus_score(
            [compound_split(h) for h in hyp_tok], [[compound_split(r) for r in refs_tok]]
        ).score
    detok = MosesDetokenizer(lang=lang)
    hyp_detok = [detok.detokenize(h.split()) for h in hyp_tok]
    sacre = BLEU(lowercase=lowercase)
    result["sacrebleu"] = sacre.corpus_score(hyp_detok, [refs_raw]).score
    result["sacrebleu_signature"] = str(sacre.get_signature())
    result["detokenized_hypotheses"] = hyp_detok
    return result


