"""What every deploy-speed measurement shares: the decoding settings, one timed run of
``fairseq-generate`` and of CTranslate2, the rounds in rotating order, and the CSV with its
runs, its ratios to the 6L-6L row of the same run and its markdown table.

Speed is translation alone, as in the demo's benchmark: fairseq-generate's own timer (its
"Translated N sentences ... in X s" line times the generator only) and the wall time of
CTranslate2's ``translate_batch`` calls; loading, tokenisation and scoring are outside both.
At batch 64 the figure is sentences per second; at batch 1 the same time divided by the
sentences is the latency of one sentence (``ms_per_sentence``). Every figure is the median
over the rounds; ``round_values`` keeps each round's figure.

CTranslate2's time includes ``fairseq_admin_pos.export.ct2.translate``'s fairseq last step
(a second beam search and one ``score_batch`` call per sentence whose best hypothesis reached
the length limit); ``fallback_sentences`` counts those sentences and ``fallback_seconds`` is
the median over the rounds of the seconds that step took (0 for fairseq-generate, which
forces EOS inside its own search, and for fixed output lengths).

Each invocation of ``deploy_speed.py`` is one timing run with its own ``run`` id (UTC start
time and a label); its rows are merged into the CSV (rows of the same run and key replaced,
all others kept), and ``ratio_to_6l6l`` divides by the 6L-6L row of the same run, kind,
scheme, engine, precision, batch and threads (docs/deployment.md, "Deployed speed of the
depth study's cells").
"""
from __future__ import annotations

import csv
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# the demo's (and the depth study's) decoding: beam 4, length penalty 0.6, at most
# 1.2 * source + 10 tokens
BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B = 4, 0.6, 1.2, 10
PLUGIN, CT2 = "fairseq + plugin", "CTranslate2"
BASE_SHAPE = "6L-6L"

FIELDS = [
    "run", "kind", "shape", "encoder_layers", "decoder_layers", "embed_dim", "ffn_dim", "heads",
    "vocab", "scheme", "seed", "train_status", "engine", "precision", "batch", "threads",
    "sentences", "mean_batch", "rounds", "sentences_per_s", "ms_per_sentence",
    "ratio_to_6l6l", "round_values", "fallback_sentences", "fallback_seconds", "bleu", "note",
    "cpu", "checkpoint",
]
#: what makes a row one measurement: a run's rows with the same key replace each other
ROW_KEY = ("run", "kind", "shape", "scheme", "seed", "engine", "precision", "batch", "threads")
#: the rows a ratio's 6L-6L row shares: the same timing run, scheme and engine settings
RATIO_KEY = ("run", "kind", "scheme", "engine", "precision", "batch", "threads")


def tool(name: str) -> str:
    """The console script next to this interpreter (the project's venv), else ``name``."""
    path = BIN / name
    return str(path) if path.exists() else name


def thread_env(threads: int) -> Dict[str, str]:
    """fairseq's environment with ``threads`` OpenMP/MKL threads (torch takes its count from
    them) and no unsafe checkpoint-loading escape hatch."""
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
             PYTHONWARNINGS="ignore")
    e.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    return e


def cpu_name() -> str:
    """The CPU model and the number of CPUs this process sees."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs"


def detok(pieces: Sequence[str]) -> str:
    """What fairseq's ``--post-process sentencepiece`` does to a hypothesis."""
    return "".join(pieces).replace("\u2581", " ").strip()


def run_process(cmd: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    """Run a fairseq console script, its output captured. (The tests replace this to fork
    ``fairseq-generate`` from their zygote: the same run without an interpreter's start-up.)"""
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def fairseq_generate(data: Path, checkpoint: Path, batch: int, threads: int, plugin: bool
                     ) -> Tuple[List[str], int, float]:
    """``(detokenised translations in sentence order, sentences, seconds)`` of
    ``fairseq-generate`` on the test split, with or without ``--user-dir``."""
    cmd = [tool("fairseq-generate"), data, "--path", checkpoint, "--gen-subset", "test",
           "--beam", BEAM, "--lenpen", LENPEN, "--batch-size", batch,
           "--max-len-a", MAX_LEN_A, "--max-len-b", MAX_LEN_B,
           "--remove-bpe", "sentencepiece", "--cpu", "--num-workers", "0",
           # stock fairseq's batching drops a split's last (len % 8) sentences; the plugin
           # fixes that (README, "Fixes to the fairseq we run on"), plain fairseq needs this
           "--required-batch-size-multiple", "1"]
    if plugin:
        cmd[2:2] = ["--user-dir", REPO / "fairseq_admin_pos"]
    proc = run_process([str(c) for c in cmd], thread_env(threads))
    if proc.returncode != 0:
        raise SystemExit(f"fairseq-generate {checkpoint} failed:\n{proc.stderr[-3000:]}")
    hyps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("D-"):
            sid, _, text = line.split("\t", 2)
            hyps[int(sid[2:])] = text
    # "Translated N sentences (T tokens) in X.Xs (S.SS sentences/s, ...)": the seconds are
    # printed to 0.1 s, the rate to 4-5 digits, so the time is taken from the rate
    m = re.search(r"Translated ([\d,]+) sentences \(.*?\) in [\d.]+s \(([\d.]+) sentences/s",
                  proc.stdout + proc.stderr)
    if m is None:
        raise SystemExit("fairseq-generate printed no 'Translated N sentences ... in Xs' line")
    if sorted(hyps) != list(range(len(hyps))):
        raise SystemExit(f"fairseq-generate {checkpoint}: sentence ids are not 0..N-1")
    n = int(m.group(1).replace(",", ""))
    return [hyps[i] for i in range(len(hyps))], n, n / float(m.group(2))


def ct2_translator(folder: Path, compute_type: str, threads: int):
    import ctranslate2

    return ctranslate2.Translator(str(folder), device="cpu", compute_type=compute_type,
                                  intra_threads=threads, inter_threads=1)


def ct2_translate(translator, sources, references, batch: int):
    """``(tokens per sentence, sentences, seconds, fallback)``: the package's fairseq-matched
    CTranslate2 beam search (``fairseq_admin_pos.export.ct2.translate``), ``seconds`` all of
    it, ``fallback`` (a ``FallbackTime``) the sentences and seconds of its fairseq last step
    within them; the references only order the batches as fairseq-generate orders a split
    with targets."""
    from fairseq_admin_pos.export.ct2 import FallbackTime, translate

    fallback = FallbackTime()
    t0 = time.perf_counter()
    out = translate(translator, sources, BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B, batch_size=batch,
                    references=references, fallback=fallback)
    seconds = time.perf_counter() - t0
    return [tokens for tokens, _ in out], len(sources), seconds, fallback


def rotating_rounds(units: Sequence, rounds: int, measure: Callable, label: Callable = str
                    ) -> Dict[int, List]:
    """``{unit index: [measure(unit) of each round]}``. Round r starts ``r * len / rounds``
    units further along the list (wrapping around), so a load change on a shared machine
    falls on different units in each round, and no unit is always first after a model of
    another shape."""
    results: Dict[int, List] = {i: [] for i in range(len(units))}
    for r in range(rounds):
        k = (r * len(units)) // rounds
        for i in list(range(k, len(units))) + list(range(k)):
            results[i].append(measure(units[i]))
            print(f"round {r + 1}/{rounds} {label(units[i])}", flush=True)
    return results


def speed_fields(per_round: Sequence[Tuple[int, float]],
                 fallback: Sequence[Tuple[int, float]] = ()) -> Dict[str, str]:
    """The timing columns from each round's ``(sentences, seconds)``: the median of the
    rounds' sentences per second, milliseconds per sentence from that median, each round's
    figure; and from each round's ``fallback`` ``(sentences, seconds)`` (CTranslate2's
    fairseq last step, within those seconds) its sentences and median seconds."""
    speeds = [n / s for n, s in per_round]
    med = statistics.median(speeds)
    # six significant digits: the latency of a tiny model is a fraction of a millisecond
    out = {"sentences": str(per_round[0][0]), "rounds": str(len(per_round)),
           "sentences_per_s": f"{med:.6g}", "ms_per_sentence": f"{1000.0 / med:.6g}",
           "round_values": ";".join(f"{x:.6g}" for x in speeds),
           "fallback_sentences": "", "fallback_seconds": ""}
    if fallback:
        counts = [n for n, _ in fallback]  # each round's; one value where they agree
        out["fallback_sentences"] = (str(counts[0]) if len(set(counts)) == 1
                                     else ";".join(map(str, counts)))
        out["fallback_seconds"] = f"{statistics.median(s for _, s in fallback):.6g}"
    return out


def run_id(label: str, now: datetime = None) -> str:
    """A timing run's id: its UTC start time and ``label``, e.g. ``20261206T092607Z-cells``."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", label):
        raise SystemExit(f"--run-label: {label!r} is not letters, digits, '.', '_' or '-'")
    return f"{(now or datetime.now(timezone.utc)):%Y%m%dT%H%M%SZ}-{label}"


def add_ratios(rows: List[Dict[str, str]]) -> None:
    """``ratio_to_6l6l``: the row's sentences per second over those of the 6L-6L row of the
    same run, kind, scheme, engine, precision, batch and threads (:data:`RATIO_KEY`), both as
    written in the CSV; empty where that run has no such row."""
    key = lambda r: tuple(str(r.get(k, "")) for k in RATIO_KEY)  # noqa: E731
    base = {}
    for r in rows:
        if r["shape"] == BASE_SHAPE:
            if key(r) in base:
                raise ValueError(f"two 6L-6L rows for {key(r)}: a run times one per scheme")
            base[key(r)] = float(r["sentences_per_s"])
    for r in rows:
        b = base.get(key(r))
        r["ratio_to_6l6l"] = f"{float(r['sentences_per_s']) / b:.3f}" if b else ""


def merge_rows(old: List[Dict[str, str]], new: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """``old`` without the rows that ``new`` measures again (same :data:`ROW_KEY`), then
    ``new``: other runs' rows are kept as they were, in their order."""
    key = lambda r: tuple(str(r.get(k, "")) for k in ROW_KEY)  # noqa: E731
    again = {key(r) for r in new}
    return [r for r in old if key(r) not in again] + list(new)


def merge_csv(path: Path, rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    """Merge one run's ``rows`` into the CSV at ``path`` (created if missing); the rows
    written, as written (the CSV's columns, strings). A CSV without a ``run`` column is
    refused: its ratios' runs are unknown."""
    old = read_csv(path) if path.is_file() else []
    if old and "run" not in old[0]:
        raise SystemExit(f"--csv {path}: no run column, so its rows' timing runs are unknown; "
                         "give a new --csv (docs/deployment.md)")
    merged = [{f: str(r.get(f, "")) for f in FIELDS} for r in merge_rows(old, rows)]
    write_csv(path, merged)
    return merged


def write_csv(path: Path, rows: List[Dict[str, str]]) -> None:
    """Write the rows (atomically: a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def markdown(rows: List[Dict[str, str]]) -> List[str]:
    """The rows as a markdown table (one line per CSV row), each distinct note once below
    it, numbered. Fallback: sentences at the length limit / seconds of CTranslate2's fairseq
    last step (module docstring)."""
    notes = list(dict.fromkeys(r["note"] for r in rows if r["note"]))
    lines = ["| shape | scheme | seed | engine | precision | batch | threads | sentences/s | "
             "ms/sentence | ratio to 6L-6L | fallback | BLEU | note |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        note = f"({notes.index(r['note']) + 1})" if r["note"] else ""
        fallback = (f"{r['fallback_sentences']} / {float(r['fallback_seconds']):.2f} s"
                    if r.get("fallback_seconds") else "-")
        lines.append(f"| {r['shape']} | {r['scheme']} | {r['seed'] or '-'} | {r['engine']} | "
                     f"{r['precision']} | {r['batch']} | {r['threads']} | "
                     f"{float(r['sentences_per_s']):.1f} | {float(r['ms_per_sentence']):.2f} | "
                     f"{r['ratio_to_6l6l'] or '-'} | {fallback} | {r['bleu'] or '-'} | {note} |")
    return lines + [""] + [f"({i}) {n}" for i, n in enumerate(notes, 1)]


def parse_ints(text: str, flag: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: {text!r} is not a comma list of positive integers")
    return values
