"""Pure-python helpers behind the recipes in ``examples/<task>/`` (prepare, train, eval).

It lives next to the scripts that use it (``examples/common/lib.sh`` calls it as
``python examples/common/recipes.py CMD``) and imports neither torch, fairseq nor the
plugin, so each call costs a fraction of a second; the text tools (sacremoses, sacrebleu,
regex) are imported only by the sub-commands that need them.

Sub-commands (``--help`` on each):

* ``gpus``          number of visible GPUs (``CUDA_VISIBLE_DEVICES``, ``nvidia-smi -L``);
* ``update-freq``   ``--update-freq`` such that GPUs x max-tokens x update-freq equals the
                    recipe's effective batch, or a refusal naming valid alternatives;
* ``run-config``    record a run's defining settings on first start, refuse a resume whose
                    settings differ (a run folder is resumed, never reused for another run);
* ``fetch``         download an archive (``.part`` then rename) and check it (gzip / tar
                    integrity read to the end, sha256 when known); no network -> a message;
* ``extract``       unpack a checked archive and check that the expected members exist;
* ``tokenize``      Moses tokenisation with sacremoses (punctuation normalisation, removal of
                    non-printing characters, aggressive hyphen splitting ``-a``, lowercasing),
                    from plain text, WMT/IWSLT SGML ``<seg>`` files or IWSLT ``train.tags``;
* ``clean``         length / ratio filter of a parallel corpus (clean-corpus-n.perl rules);
* ``score``         from ``fairseq-generate`` output: tokenized BLEU (the Admin paper's
                    scoring), detokenized sacreBLEU with its signature, and for En-De the
                    compound-split BLEU (tensor2tensor's convention), each labelled;
* ``split-args``    split a string such as ``EXTRA_ARGS`` into words as the shell does
                    (quotes, backslashes; no expansion) and print them shell-quoted.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple


class RecipeError(Exception):
    """An input the recipe cannot work with; the message names the setting and the fix.

    ``main`` prints the message (no traceback) and exits with ``code``.
    """

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------
# Effective batch -> --update-freq
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchPlan:
    """One way of reaching a recipe's effective batch (tokens per optimizer update).

    ``effective_batch == num_gpus * max_tokens * update_freq`` holds exactly. fairseq's
    ``--max-tokens`` is an upper bound on the padded tokens of one GPU's batch, so the
    papers' batch sizes (e.g. 4 GPUs x 8192 tokens for WMT14 En-De) are nominal in the same
    way; keeping the product fixed keeps the optimisation the same when the GPU count changes.
    """

    num_gpus: int
    max_tokens: int
    update_freq: int

    @property
    def effective_batch(self) -> int:
        return self.num_gpus * self.max_tokens * self.update_freq


def _positive_int(value, name: str) -> int:
    try:
        number = int(str(value).strip())
    except (TypeError, ValueError):
        raise RecipeError(f"{name} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise RecipeError(f"{name} must be a positive integer, got {number}")
    return number


def suggest_max_tokens(effective_batch: int, num_gpus: int, cap: int) -> Optional[BatchPlan]:
    """The largest ``max_tokens <= cap`` with an integer update-freq, or None when
    ``effective_batch`` is not divisible by ``num_gpus`` (no max-tokens can fix that)."""
    if effective_batch % num_gpus:
        return None
    per_gpu = effective_batch // num_gpus
    # smallest update-freq first: it gives the largest per-GPU batch that fits under the cap
    for update_freq in range(max(1, math.ceil(per_gpu / cap)), per_gpu + 1):
        if per_gpu % update_freq == 0:
            return BatchPlan(num_gpus, per_gpu // update_freq, update_freq)
    return None  # pragma: no cover  (update_freq == per_gpu always divides)


def suggest_gpu_counts(effective_batch: int, max_tokens: int, limit: int = 256) -> List[int]:
    """GPU counts (<= limit) that reach ``effective_batch`` exactly with ``max_tokens``."""
    return [g for g in range(1, limit + 1) if effective_batch % (g * max_tokens) == 0]


def plan_update_freq(effective_batch, num_gpus, max_tokens) -> BatchPlan:
    """``--update-freq`` so that ``num_gpus * max_tokens * update_freq == effective_batch``.

    Refuses (``RecipeError``) a combination that cannot reach the batch exactly: a
    non-integer update-freq, or one below 1 (more tokens per step than the recipe's batch).
    The message names ``EFFECTIVE_BATCH`` / ``NUM_GPUS`` / ``MAX_TOKENS`` (the recipe's
    settings) and suggests a ``MAX_TOKENS`` for these GPUs and GPU counts for this MAX_TOKENS.
    """
    effective_batch = _positive_int(effective_batch, "EFFECTIVE_BATCH")
    num_gpus = _positive_int(num_gpus, "NUM_GPUS")
    max_tokens = _positive_int(max_tokens, "MAX_TOKENS")
    per_step = num_gpus * max_tokens
    if effective_batch % per_step == 0:
        return BatchPlan(num_gpus, max_tokens, effective_batch // per_step)
    ratio = effective_batch / per_step
    lines = [
        f"cannot reach the recipe's effective batch of {effective_batch} tokens per update "
        f"with NUM_GPUS={num_gpus} x MAX_TOKENS={max_tokens} (= {per_step} tokens per step): "
        f"--update-freq would be {ratio:.4g}, which is not a positive integer."
    ]
    fix = suggest_max_tokens(effective_batch, num_gpus, max_tokens)
    if fix is not None:
        lines.append(
            f"  use MAX_TOKENS={fix.max_tokens} (--update-freq {fix.update_freq}) on "
            f"{num_gpus} GPU(s)"
        )
    else:
        lines.append(f"  no MAX_TOKENS works: {effective_batch} is not divisible by {num_gpus} GPUs")
    gpus = suggest_gpu_counts(effective_batch, max_tokens, limit=max(64, 2 * num_gpus))
    if gpus:
        lines.append(
            f"  or run on NUM_GPUS in {{{', '.join(map(str, gpus))}}} with MAX_TOKENS={max_tokens}"
        )
    lines.append("  (EFFECTIVE_BATCH=... changes the recipe itself; the result is then not the "
                 "published setting)")
    raise RecipeError("\n".join(lines))


# --------------------------------------------------------------------------------------
# Visible GPUs
# --------------------------------------------------------------------------------------


def count_cuda_visible_devices(value: str) -> int:
    """Devices CUDA exposes for a ``CUDA_VISIBLE_DEVICES`` value.

    CUDA reads the comma-separated list up to the first invalid entry, so ``""`` and
    ``"-1"`` mean no GPU and ``"0,-1,1"`` means one. Entries may be indices or UUIDs
    (``GPU-...``, ``MIG-...``).
    """
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            break
        if re.fullmatch(r"-?\d+", entry):
            if int(entry) < 0:
                break
        elif not re.match(r"(GPU|MIG)-", entry):
            break
        count += 1
    return count


def count_nvidia_smi_gpus(listing: str) -> int:
    """GPUs in ``nvidia-smi -L`` output (one ``GPU i: ...`` line each; MIG lines indented)."""
    return sum(1 for line in listing.splitlines() if re.match(r"GPU \d+:", line))


def count_visible_gpus(env: Mapping[str, str], nvidia_smi_listing: Optional[str]) -> int:
    """Visible GPUs: ``CUDA_VISIBLE_DEVICES`` when set (bounded by what nvidia-smi sees,
    as CUDA skips indices that do not exist), else ``nvidia-smi -L``, else 0."""
    smi = count_nvidia_smi_gpus(nvidia_smi_listing) if nvidia_smi_listing is not None else None
    if "CUDA_VISIBLE_DEVICES" in env:
        visible = count_cuda_visible_devices(env["CUDA_VISIBLE_DEVICES"])
        return visible if smi is None else min(visible, smi)
    return smi or 0


def _nvidia_smi_listing() -> Optional[str]:
    try:
        result = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


# --------------------------------------------------------------------------------------
# Run folders: resumed, never reused for a different run
# --------------------------------------------------------------------------------------

RUN_CONFIG = "recipe.json"


def check_run_config(run_dir: str, settings: Dict[str, str]) -> str:
    """Record ``settings`` in ``run_dir/recipe.json`` on the first start; on a resume,
    refuse settings that differ from the recorded ones. Returns ``"new"`` or ``"resume"``.

    The settings are the ones that define the run (task, scheme, architecture, optimiser
    settings, effective batch, data); the GPU count, max-tokens and update-freq may change
    between resumes as long as the effective batch stays the same.
    """
    path = os.path.join(run_dir, RUN_CONFIG)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            recorded = json.load(handle)
        diffs = [
            f"{key}: recorded {recorded.get(key)!r}, now {settings.get(key)!r}"
            for key in sorted(set(recorded) | set(settings))
            if recorded.get(key) != settings.get(key)
        ]
        if diffs:
            raise RecipeError(
                f"run folder {run_dir} holds a run with other settings ("
                + "; ".join(diffs)
                + "). A run folder is only resumed with its own settings: choose another "
                "RUN_DIR or SEED for a new run (or edit recipe.json if only a path moved)."
            )
        return "resume"
    os.makedirs(run_dir, exist_ok=True)
    _atomic_write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return "new"


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------
# Download and archive checks
# --------------------------------------------------------------------------------------

_CHUNK = 1 << 20


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def read_checksums(path: Optional[str]) -> Dict[str, str]:
    """``sha256sum``-format file (``HEX  name`` per line) -> {basename: hex}."""
    if not path:
        return {}
    sums = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
                raise RecipeError(
                    f"CHECKSUMS file {path}, line {number}: expected '<sha256 hex>  <file name>'"
                )
            sums[os.path.basename(parts[1].lstrip("*"))] = parts[0].lower()
    return sums


def check_archive(path: str, expected_sha256: Optional[str] = None,
                  name: Optional[str] = None) -> str:
    """Read a downloaded archive to its end and return its sha256.

    gzip (``.tgz``/``.gz``): decompressed to the end, which checks the end-of-stream marker,
    CRC and length. tar (``.tgz``/``.tar.gz``/``.tar``): every member is read through and its
    length compared with its header; at least one member is required. Other file types are
    only hashed. A wrong ``expected_sha256`` is an error naming both digests.
    """
    name = os.path.basename(name or path)  # the final name decides the format (not ".part")
    try:
        if name.endswith((".tgz", ".gz")):
            # the gzip module checks the end-of-stream marker, CRC and length; tarfile's
            # stream reader alone accepts a gzip stream cut short
            with gzip.open(path, "rb") as handle:
                while handle.read(_CHUNK):
                    pass
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            members = 0
            with tarfile.open(path, mode="r|*") as archive:
                for member in archive:
                    members += 1
                    if member.isfile():
                        extracted = archive.extractfile(member)
                        size = 0
                        for block in iter(lambda: extracted.read(_CHUNK), b""):
                            size += len(block)
                        if size != member.size:
                            raise RecipeError(
                                f"archive {path} is incomplete: {member.name} has {size} of "
                                f"{member.size} bytes", code=4)
            if members == 0:
                raise RecipeError(f"archive {path} is empty", code=4)
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as error:
        raise RecipeError(f"archive {path} is damaged or incomplete ({error})", code=4) from None
    digest = sha256_of(path)
    if expected_sha256 and digest != expected_sha256.lower():
        raise RecipeError(
            f"archive {path} has sha256 {digest}, expected {expected_sha256} (from CHECKSUMS); "
            "delete it to download it again, or fix the CHECKSUMS entry",
            code=4,
        )
    return digest


def fetch(url: str, dest: str, expected_sha256: Optional[str] = None, timeout: float = 60) -> str:
    """Download ``url`` to ``dest`` unless a checked copy is there; return its sha256.

    A checked copy has a ``dest.sha256`` marker written after :func:`check_archive` passed
    (so an interrupted download or check is redone). The download goes to ``dest.part``
    and is renamed only once complete. Network failures raise ``RecipeError`` (exit 3) with
    the URL and how to work around it.
    """
    marker = dest + ".sha256"
    if os.path.exists(dest) and os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            recorded = handle.read().strip()
        if not expected_sha256 or recorded == expected_sha256.lower():
            print(f"fetch: {dest} already downloaded and checked (sha256 {recorded})")
            return recorded
    if os.path.exists(dest):
        print(f"fetch: checking existing {dest}")
        try:
            digest = check_archive(dest, expected_sha256)
        except RecipeError as error:
            print(f"fetch: {error}; downloading it again", file=sys.stderr)
            os.remove(dest)
        else:
            _atomic_write_text(marker, digest + "\n")
            return digest
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + ".part"
    print(f"fetch: downloading {url} -> {dest}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            total = response.headers.get("Content-Length")
            copied = 0
            for block in iter(lambda: response.read(_CHUNK), b""):
                out.write(block)
                copied += len(block)
            if total is not None and copied != int(total):
                raise RecipeError(
                    f"download of {url} stopped after {copied} of {total} bytes", code=3
                )
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        if os.path.exists(part):
            os.remove(part)
        reason = getattr(error, "reason", error)
        raise RecipeError(
            f"could not download {url}: {reason}.\n"
            "  No network here? Copy the file by other means to "
            f"{dest} (it is checked before use), or point the recipe's base-URL variable "
            "(WMT14_BASE_URL / IWSLT14_URL) at a mirror.",
            code=3,
        ) from None
    try:
        digest = check_archive(part, expected_sha256, name=dest)
    except RecipeError:
        os.remove(part)
        raise
    os.replace(part, dest)
    _atomic_write_text(marker, digest + "\n")
    if not expected_sha256:
        print(f"fetch: {os.path.basename(dest)} sha256 {digest} (no CHECKSUMS entry; "
              "add it to pin this download)")
    return digest


def extract(archive: str, dest: str, expect: Sequence[str]) -> None:
    """Unpack ``archive`` into ``dest`` and check that every path in ``expect`` exists.

    Members are unpacked with tarfile's ``data`` filter where available (no absolute
    paths, no links out of ``dest``).
    """
    os.makedirs(dest, exist_ok=True)
    try:
        with tarfile.open(archive, mode="r:*") as handle:
            if hasattr(tarfile, "data_filter"):
                handle.extractall(dest, filter="data")
            else:  # pragma: no cover  (Python < 3.11.4)
                handle.extractall(dest)
    except (tarfile.TarError, OSError) as error:
        raise RecipeError(f"cannot unpack {archive}: {error}", code=4) from None
    missing = [p for p in expect if not os.path.exists(os.path.join(dest, p))]
    if missing:
        raise RecipeError(
            f"{archive} does not contain the expected file(s) {', '.join(missing)}: is it the "
            "right archive (check the base URL)?",
            code=4,
        )


# --------------------------------------------------------------------------------------
# Text: extraction, Moses tokenisation, cleaning
# --------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------

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


def shell_quoted_words(text: str, name: str = "value") -> str:
    """``text`` split into words by the shell's rules (:func:`shlex.split`: quotes and
    backslashes; no variable, command or glob expansion), printed shell-quoted and
    space-separated: what ``eval "array=($output)"`` turns back into exactly those words."""
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise RecipeError(f"{name} cannot be split into arguments ({error}): {text!r}") from None
    return " ".join(shlex.quote(w) for w in words)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _cmd_gpus(args) -> None:
    print(count_visible_gpus(os.environ, _nvidia_smi_listing()))


def _cmd_update_freq(args) -> None:
    print(plan_update_freq(args.effective_batch, args.num_gpus, args.max_tokens).update_freq)


def _cmd_run_config(args) -> None:
    settings = {}
    for item in args.settings:
        if "=" not in item:
            raise RecipeError(f"run-config: setting {item!r} is not KEY=VALUE")
        key, value = item.split("=", 1)
        settings[key] = value
    print(check_run_config(args.run_dir, settings))


def _cmd_fetch(args) -> None:
    sums = read_checksums(args.checksums)
    expected = args.sha256 or sums.get(os.path.basename(args.dest))
    fetch(args.url, args.dest, expected, timeout=args.timeout)


def _cmd_extract(args) -> None:
    extract(args.archive, args.dest, args.expect)
    print(f"extract: {args.archive} -> {args.dest}")


def _cmd_tokenize(args) -> None:
    pipeline = MosesPipeline(args.lang, args.aggressive, args.normalize_punct,
                             args.remove_non_printing, args.rsquo, args.lowercase)
    for path in args.inputs:
        if not os.path.exists(path):
            raise RecipeError(f"tokenize: input {path} does not exist")
    count = tokenize_files(args.inputs, args.output, pipeline, args.input_format,
                           args.raw_output, args.workers)
    print(f"tokenize: {count} lines -> {args.output}")


def _cmd_clean(args) -> None:
    read, kept = clean_corpus(
        f"{args.prefix}.{args.src}", f"{args.prefix}.{args.tgt}",
        f"{args.out_prefix}.{args.src}", f"{args.out_prefix}.{args.tgt}",
        args.min, args.max, args.ratio, args.lowercase,
    )
    print(f"clean: {args.prefix}: kept {kept} of {read} pairs "
          f"({args.min}..{args.max} tokens, ratio <= {args.ratio})")


def _cmd_score(args) -> None:
    result = score_generation(args.generate_output, args.tok_ref, args.raw_ref, args.lang,
                              args.compound_split, args.lowercase)
    hyps = result.pop("detokenized_hypotheses")
    if args.detok_output:
        with open(args.detok_output, "w", encoding="utf-8") as handle:
            handle.writelines(h + "\n" for h in hyps)
    print(f"tokenized BLEU (the Admin paper's scoring: fairseq-generate's BLEU4 on the "
          f"Moses-tokenized reference): {result['tokenized']:.2f}")
    print(f"detokenized sacreBLEU: {result['sacrebleu']:.2f}  "
          f"signature: {result['sacrebleu_signature']}")
    if args.compound_split:
        print(f"tokenized BLEU, compound split (a-b -> a ##AT##-##AT## b, tensor2tensor's "
              f"get_ende_bleu.sh convention; not the Admin paper's scoring): "
              f"{result['compound_split']:.2f}")
    if args.json:
        _atomic_write_text(args.json, json.dumps(result, indent=2, sort_keys=True) + "\n")


def _cmd_split_args(args) -> None:
    print(shell_quoted_words(args.value, args.name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recipes.py", description="helpers for the recipes in examples/<task>/"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("gpus", help="number of visible GPUs")
    p.set_defaults(func=_cmd_gpus)

    p = sub.add_parser("update-freq", help="--update-freq reaching the effective batch")
    p.add_argument("--effective-batch", required=True, help="tokens per optimizer update")
    p.add_argument("--num-gpus", required=True, help="data-parallel processes, all nodes")
    p.add_argument("--max-tokens", required=True, help="fairseq --max-tokens per GPU")
    p.set_defaults(func=_cmd_update_freq)

    p = sub.add_parser("run-config", help="record / check a run folder's settings")
    p.add_argument("--run-dir", required=True)
    p.add_argument("settings", nargs="*", help="KEY=VALUE")
    p.set_defaults(func=_cmd_run_config)

    p = sub.add_parser("fetch", help="download and check an archive")
    p.add_argument("--url", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--sha256", help="expected sha256 (else looked up in --checksums)")
    p.add_argument("--checksums", help="sha256sum-format file of known digests")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without data")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("extract", help="unpack a checked archive")
    p.add_argument("--archive", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--expect", nargs="*", default=[], help="paths that must exist afterwards")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser("tokenize", help="Moses tokenisation (sacremoses)")
    p.add_argument("--lang", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--input-format", choices=("plain", "sgm", "iwslt-tags"), default="plain")
    p.add_argument("--raw-output", help="also write the extracted, untokenized text here")
    p.add_argument("--aggressive", action="store_true", help="tokenizer.perl -a")
    p.add_argument("--normalize-punct", action="store_true")
    p.add_argument("--remove-non-printing", action="store_true")
    p.add_argument("--rsquo", action="store_true", help="U+2019 -> ' before tokenizing")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("inputs", nargs="+")
    p.set_defaults(func=_cmd_tokenize)

    p = sub.add_parser("clean", help="length/ratio filter (clean-corpus-n.perl rules)")
    p.add_argument("prefix")
    p.add_argument("src")
    p.add_argument("tgt")
    p.add_argument("out_prefix")
    p.add_argument("min", type=int)
    p.add_argument("max", type=int)
    p.add_argument("--ratio", type=float, default=1.5)
    p.add_argument("--lowercase", action="store_true")
    p.set_defaults(func=_cmd_clean)

    p = sub.add_parser("score", help="tokenized + detokenized BLEU of fairseq-generate output")
    p.add_argument("--generate-output", required=True)
    p.add_argument("--tok-ref", required=True, help="Moses-tokenized reference")
    p.add_argument("--raw-ref", required=True, help="untokenized reference")
    p.add_argument("--lang", required=True, help="target language (detokenizer)")
    p.add_argument("--compound-split", action="store_true",
                   help="also print the compound-split BLEU (WMT En-De convention)")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive sacreBLEU")
    p.add_argument("--detok-output", help="write the detokenized hypotheses here")
    p.add_argument("--json", help="write the scores here")
    p.set_defaults(func=_cmd_score)

    p = sub.add_parser("split-args", help="split a string into shell words, print them quoted")
    p.add_argument("--name", default="value", help="what the string is (for error messages)")
    p.add_argument("value", help="the string, e.g. the value of EXTRA_ARGS (put -- before it)")
    p.set_defaults(func=_cmd_split_args)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
