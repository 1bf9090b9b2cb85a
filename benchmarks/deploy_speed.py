"""BLEU and speed of the demo's model as trained and as deployed, side by side in one run.

The model ``make demo`` trained (``demo_out/admin/checkpoints/checkpoint_last.pt``) is
exported with ``fairseq-admin-export`` (a stock fairseq ``transformer`` file and two
CTranslate2 models, float32 and int8) and translates Multi30k test2016 four ways, with the
demo's settings (beam 4, length penalty 0.6, at most ``1.2 * source + 10`` tokens, batches
of 64 sentences, CPU, the same number of threads):

* ``fairseq + plugin``: ``fairseq-generate --user-dir fairseq_admin_pos`` on the original;
* ``fairseq, exported``: plain ``fairseq-generate`` (no ``--user-dir``) on the export;
* ``CTranslate2 float32`` / ``CTranslate2 int8``: ``ctranslate2.Translator`` through
  ``fairseq_admin_pos.export.ct2.translate`` (fairseq's settings mapped onto CTranslate2's).

Speed is sentences per second of translation alone: fairseq-generate's own timer (its
"Translated N sentences ... in X s" line, which times the generator and nothing else) and
the wall time of CTranslate2's ``translate_batch`` calls; loading, tokenisation and scoring
are outside both. The four are measured ``--rounds`` times in rotating order (so a load
change on a shared machine hits all alike); the table gives the median and the ratio to
``fairseq + plugin``. BLEU is sacreBLEU on the detokenised output (sentencepiece pieces
joined) against the raw references, as the demo scores it; "same as plugin" counts
sentences whose output equals the plugin's.

    python benchmarks/deploy_speed.py                 # demo_out/admin, 1 thread, 3 rounds
    python benchmarks/deploy_speed.py --threads 2 --rounds 5 --work bench_out/deploy
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B, BATCH = 4, 0.6, 1.2, 10, 64
WAYS = ("fairseq + plugin", "fairseq, exported", "CTranslate2 float32", "CTranslate2 int8")


def tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else name


def thread_env(threads: int) -> Dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
             PYTHONWARNINGS="ignore")
    e.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    return e


def export(args, work: Path) -> Dict[str, Path]:
    paths = {"stock": work / "stock.pt", "ct2": work / "ct2-float32", "int8": work / "ct2-int8"}
    if not (paths["stock"].exists() and paths["ct2"].exists()):
        if paths["ct2"].exists():
            raise SystemExit(f"{paths['ct2']} exists without {paths['stock']}: remove {work}")
        cmd = [tool("fairseq-admin-export"), args.checkpoint, "--out", paths["stock"],
               "--ctranslate2", paths["ct2"]]
        print("+ " + " ".join(map(str, cmd)), flush=True)
        subprocess.run([str(c) for c in cmd], check=True)
    if not paths["int8"].exists():
        # the same export, quantised by CTranslate2's converter (the fairseq file is the same)
        cmd = [tool("fairseq-admin-export"), args.checkpoint, "--out", work / "stock-int8.pt",
               "--ctranslate2", paths["int8"], "--quantization", "int8"]
        print("+ " + " ".join(map(str, cmd)), flush=True)
        subprocess.run([str(c) for c in cmd], check=True)
        (work / "stock-int8.pt").unlink()
    return paths


def read_lines(path: Path) -> List[str]:
    return path.read_text(encoding="utf-8").splitlines()


def detok(pieces: List[str]) -> str:
    # what fairseq's --post-process sentencepiece does to a hypothesis
    return "".join(pieces).replace("\u2581", " ").strip()


def run_fairseq(args, checkpoint: Path, plugin: bool) -> (List[str], float):
    cmd = [tool("fairseq-generate"), args.data, "--path", checkpoint, "--gen-subset", "test",
           "--beam", str(BEAM), "--lenpen", str(LENPEN), "--batch-size", str(BATCH),
           "--max-len-a", str(MAX_LEN_A), "--max-len-b", str(MAX_LEN_B),
           "--remove-bpe", "sentencepiece", "--cpu", "--num-workers", "0",
           # stock fairseq's batching drops a split's last (len % 8) sentences; the plugin
           # fixes that (README, "Fixes to the fairseq we run on"), plain fairseq needs this
           "--required-batch-size-multiple", "1"]
    if plugin:
        cmd[2:2] = ["--user-dir", REPO / "fairseq_admin_pos"]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          env=thread_env(args.threads))
    if proc.returncode != 0:
        raise SystemExit(f"fairseq-generate failed:\n{proc.stderr[-3000:]}")
    hyps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("D-"):
            sid, _, text = line.split("\t", 2)
            hyps[int(sid[2:])] = text
    m = re.search(r"Translated ([\d,]+) sentences \(.*?\) in ([\d.]+)s", proc.stdout + proc.stderr)
    if m is None:
        raise SystemExit("fairseq-generate printed no 'Translated N sentences ... in Xs' line")
    n, seconds = int(m.group(1).replace(",", "")), float(m.group(2))
    if sorted(hyps) != list(range(len(hyps))):
        raise SystemExit(f"fairseq-generate {checkpoint}: sentence ids are not 0..N-1")
    return [hyps[i] for i in range(len(hyps))], n / seconds


def run_ct2(args, folder: Path, compute_type: str, sources, references
            ) -> (List[str], float):
    import ctranslate2

    from fairseq_admin_pos.export.ct2 import translate

    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type=compute_type,
                                        intra_threads=args.threads, inter_threads=1)
    t0 = time.perf_counter()
    # the references only order the batches as fairseq-generate orders a split with targets
    out = translate(translator, sources, BEAM, LENPEN, MAX_LEN_A, MAX_LEN_B, batch_size=BATCH,
                    references=references)
    seconds = time.perf_counter() - t0
    return [detok(tokens) for tokens, _ in out], len(sources) / seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo-out", type=Path, default=Path("demo_out"),
                   help="make demo's output folder (default demo_out)")
    p.add_argument("--scheme", default="admin", help="the demo run to deploy (default admin)")
    p.add_argument("--work", type=Path, default=None,
                   help="where the exports go (default DEMO_OUT/SCHEME/deploy)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads of every engine (OMP/MKL for fairseq, intra_threads for "
                   "CTranslate2; default 1)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per engine (default 3)")
    args = p.parse_args(argv)
    run_dir = args.demo_out / args.scheme
    args.checkpoint = run_dir / "checkpoints" / "checkpoint_last.pt"
    args.data = args.demo_out / "data-bin"
    if not args.checkpoint.exists():
        raise SystemExit(f"{args.checkpoint} not found: run `make demo` first")
    work = args.work or run_dir / "deploy"
    work.mkdir(parents=True, exist_ok=True)
    paths = export(args, work)

    import sacrebleu

    refs = read_lines(args.demo_out / "raw" / "test_2016_flickr.de")
    sources = [line.split() for line in read_lines(args.demo_out / "spm" / "test.en")]
    pieces = [line.split() for line in read_lines(args.demo_out / "spm" / "test.de")]
    runners = {
        WAYS[0]: lambda: run_fairseq(args, args.checkpoint, plugin=True),
        WAYS[1]: lambda: run_fairseq(args, paths["stock"], plugin=False),
        WAYS[2]: lambda: run_ct2(args, paths["ct2"], "float32", sources, pieces),
        WAYS[3]: lambda: run_ct2(args, paths["int8"], "int8", sources, pieces),
    }
    speeds: Dict[str, List[float]] = {w: [] for w in WAYS}
    outputs: Dict[str, List[str]] = {}
    for r in range(args.rounds):
        order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
        for way in order:
            hyps, speed = runners[way]()
            if way in outputs and outputs[way] != hyps:
                raise SystemExit(f"{way}: the output changed between rounds")
            outputs[way] = hyps
            speeds[way].append(speed)
            print(f"round {r + 1} {way:<22} {speed:8.1f} sentences/s", flush=True)

    base = statistics.median(speeds[WAYS[0]])
    rows = []
    for way in WAYS:
        hyps = outputs[way]
        if len(hyps) != len(refs):
            raise SystemExit(f"{way}: {len(hyps)} translations for {len(refs)} references")
        bleu = sacrebleu.metrics.BLEU().corpus_score(hyps, [refs]).score
        same = sum(a == b for a, b in zip(hyps, outputs[WAYS[0]]))
        med = statistics.median(speeds[way])
        rows.append({"engine": way, "bleu": round(bleu, 2), "sentences_per_s": round(med, 1),
                     "ratio": round(med / base, 2), "same_as_plugin": same,
                     "rounds": [round(s, 1) for s in speeds[way]]})
    print(f"\nMulti30k test2016 ({len(refs)} sentences), beam {BEAM}, lenpen {LENPEN}, "
          f"batch {BATCH}, {args.threads} thread(s), median of {args.rounds} rounds\n")
    print("| engine | sacreBLEU | sentences/s | ratio | same output as plugin |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['engine']} | {row['bleu']:.2f} | {row['sentences_per_s']:.1f} | "
              f"{row['ratio']:.2f} | {row['same_as_plugin']} / {len(refs)} |")
    result = {"threads": args.threads, "rounds": args.rounds, "rows": rows,
              "cpu": _cpu_name(), "checkpoint": str(args.checkpoint)}
    (work / "deploy_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{_cpu_name()}; results in {work / 'deploy_speed.json'}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
