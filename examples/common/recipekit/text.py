"""Text: SGML / IWSLT extraction, Moses tokenisation (sacremoses), corpus cleaning."""

from __future__ import annotations

import gzip
import io
import os
import re
from typing import Iterable, Iterator, Optional, Sequence, Tuple

from . import RecipeError

_SEG_OPEN = re.compile(r'<seg id="[0-9]*">\s*')
_SEG_CLOSE = re.compile(r"\s*</seg>\s*")
# lines of IWSLT train.tags files that carry talk metadata, not sentences
_IWSLT_DROP = ("<url>", "<talkid>", "<keywords>")
_IWSLT_STRIP = ("<title>", "</title>", "<description>", "</description>")


def read_lines(path: str) -> Iterator[str]:
    """Lines of a UTF-8 text file (``.gz`` decompressed), split on ``\\n`` only.

    Python's universal newlines would also split on ``\\r`` and other separators that
    some WMT lines contain and break the sentence alignment; undecodable bytes become
    U+FFFD rather than stopping a multi-GB run.
    """
    raw = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="\n") as handle:
        for line in handle:
            yield line[:-1] if line.endswith("\n") else line


def seg_lines(lines: Iterable[str]) -> Iterator[str]:
    """The text of each ``<seg id="N">...</seg>`` line of a WMT/IWSLT SGML/XML file."""
    for line in lines:
        if "<seg id" in line:
            yield _SEG_CLOSE.sub("", _SEG_OPEN.sub("", line))


def iwslt_train_lines(lines: Iterable[str]) -> Iterator[str]:
    """Sentences of an IWSLT ``train.tags.*`` file: metadata lines (url, talkid, keywords)
    dropped, title and description tags removed (their text is kept, on both sides)."""
    for line in lines:
        if any(tag in line for tag in _IWSLT_DROP):
            continue
        for tag in _IWSLT_STRIP:
            line = line.replace(tag, "")
        yield line


class MosesPipeline:
    """Moses preprocessing of one line, configured once per language (picklable).

    Order as in the Moses scripts fairseq's WMT14 preparation pipes through: punctuation
    normalisation (normalize-punctuation.perl), non-printing characters -> space
    (remove-non-printing-char.perl: Unicode category C), right single quote -> apostrophe
    (done for test sets), tokenizer.perl with XML escaping and optionally ``-a`` (aggressive
    hyphen splitting, ``a-b`` -> ``a @-@ b``), then lowercasing (IWSLT).
    """

    def __init__(self, lang: str, aggressive: bool, normalize_punct: bool,
                 remove_non_printing: bool, rsquo: bool, lowercase: bool):
        self.lang = lang
        self.aggressive = aggressive
        self.normalize_punct = normalize_punct
        self.remove_non_printing = remove_non_printing
        self.rsquo = rsquo
        self.lowercase = lowercase
        self._tools = None

    def _load(self):
        from sacremoses import MosesPunctNormalizer, MosesTokenizer
        import regex

        self._tools = (
            MosesPunctNormalizer(lang=self.lang),
            MosesTokenizer(lang=self.lang),
            regex.compile(r"\p{C}"),
        )

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tools"] = None  # rebuilt in each worker process
        return state

    def __call__(self, line: str) -> str:
        if self._tools is None:
            self._load()
        normalizer, tokenizer, control = self._tools
        if self.normalize_punct:
            line = normalizer.normalize(line)
        if self.remove_non_printing:
            line = control.sub(" ", line)
        if self.rsquo:
            line = line.replace("\u2019", "'")
        line = tokenizer.tokenize(
            line, aggressive_dash_splits=self.aggressive, return_str=True, escape=True
        )
        # one sentence per line, whatever separators survived (keeps the corpus aligned)
        line = " ".join(line.split())
        return line.lower() if self.lowercase else line


def _input_lines(paths: Sequence[str], fmt: str) -> Iterator[str]:
    for path in paths:
        lines = read_lines(path)
        if fmt == "sgm":
            lines = seg_lines(lines)
        elif fmt == "iwslt-tags":
            lines = iwslt_train_lines(lines)
        yield from lines


def tokenize_files(paths: Sequence[str], output: str, pipeline: MosesPipeline, fmt: str = "plain",
                   raw_output: Optional[str] = None, workers: int = 1) -> int:
    """Tokenise the concatenation of ``paths`` into ``output`` (and the extracted, untouched
    text into ``raw_output``); returns the number of lines. Writes to ``*.tmp`` first."""
    tmp = output + ".tmp"
    raw_tmp = raw_output + ".tmp" if raw_output else None
    count = 0
    raw_handle = open(raw_tmp, "w", encoding="utf-8") if raw_tmp else None

    def source():
        for line in _input_lines(paths, fmt):
            if raw_handle is not None:
                raw_handle.write(line.strip() + "\n")
            yield line

    try:
        with open(tmp, "w", encoding="utf-8") as out:
            if workers > 1:
                import multiprocessing

                with multiprocessing.get_context("fork").Pool(workers) as pool:
                    for line in pool.imap(pipeline, source(), chunksize=2000):
                        out.write(line + "\n")
                        count += 1
            else:
                for line in map(pipeline, source()):
                    out.write(line + "\n")
                    count += 1
    finally:
        if raw_handle is not None:
            raw_handle.close()
    os.replace(tmp, output)
    if raw_output:
        os.replace(raw_tmp, raw_output)
    return count


def keep_pair(src: str, tgt: str, min_len: int, max_len: int, ratio: float,
              max_word_length: int = 1000) -> Optional[Tuple[str, str]]:
    """clean-corpus-n.perl's rule for one sentence pair: whitespace collapsed and trimmed;
    dropped when a side is empty, has fewer than ``min_len`` or more than ``max_len``
    tokens, the token-count ratio exceeds ``ratio`` either way, or a token is longer than
    ``max_word_length`` characters. Returns the normalised pair or None."""
    src_tokens, tgt_tokens = src.split(), tgt.split()
    if not src_tokens or not tgt_tokens:
        return None
    for tokens in (src_tokens, tgt_tokens):
        if len(tokens) < min_len or len(tokens) > max_len:
            return None
        if any(len(token) > max_word_length for token in tokens):
            return None
    if len(src_tokens) / len(tgt_tokens) > ratio or len(tgt_tokens) / len(src_tokens) > ratio:
        return None
    return " ".join(src_tokens), " ".join(tgt_tokens)


def clean_corpus(src_in: str, tgt_in: str, src_out: str, tgt_out: str, min_len: int,
                 max_len: int, ratio: float, lowercase: bool = False) -> Tuple[int, int]:
    """Apply :func:`keep_pair` to two aligned files; returns (read, kept)."""
    read = kept = 0
    with open(src_out + ".tmp", "w", encoding="utf-8") as src_h, \
            open(tgt_out + ".tmp", "w", encoding="utf-8") as tgt_h:
        src_lines, tgt_lines = read_lines(src_in), read_lines(tgt_in)
        for src in src_lines:
            tgt = next(tgt_lines, None)
            if tgt is None:
                raise RecipeError(f"{tgt_in} has fewer lines than {src_in}: corpus not aligned")
            read += 1
            pair = keep_pair(src, tgt, min_len, max_len, ratio)
            if pair is None:
                continue
            kept += 1
            src_clean, tgt_clean = pair
            if lowercase:
                src_clean, tgt_clean = src_clean.lower(), tgt_clean.lower()
            src_h.write(src_clean + "\n")
            tgt_h.write(tgt_clean + "\n")
        if next(tgt_lines, None) is not None:
            raise RecipeError(f"{src_in} has fewer lines than {tgt_in}: corpus not aligned")
    os.replace(src_out + ".tmp", src_out)
    os.replace(tgt_out + ".tmp", tgt_out)
    return read, kept


