"""``make demo``: train a deep-encoder admin_transformer on Multi30k En-De on the CPU.

Steps (each prints the command it runs and is skipped when its output is complete):

1. raw text: ``{train,val,test_2016_flickr}.{en,de}[.gz]`` from ``--data`` (a folder), or
   downloaded from the multi30k/dataset repository's ``data/task1/raw`` (override the base
   URL with ``MULTI30K_BASE_URL``);
2. a joint sentencepiece unigram vocabulary trained on the training side only;
3. ``fairseq-preprocess --joined-dictionary``;
4. ``fairseq-train --user-dir fairseq_admin_pos --arch admin_transformer`` with a deep encoder
   (default 12L encoder, 3L decoder, width 128) and the residual scheme of ``--scheme``
   (default ``admin``: Admin closed-form omegas, a trainable vector);
5. ``fairseq-generate`` on test2016 with beam 4, then sacreBLEU against the raw references.

``--device`` (``make demo DEVICE=...``): ``auto`` (default) trains and translates on the GPU
when torch sees one, else on the CPU; ``cpu`` and ``cuda`` force one (``cuda`` without a
CUDA GPU stops before anything is made). The CPU run is the same commands as always
(``--cpu``); the GPU run is the same recipe (float32, the same batch) on one GPU
(``--distributed-world-size 1`` instead of ``--cpu``). ``results.json`` records the device.

Data goes under ``--out`` (``raw/``, ``spm/``, ``data-bin/``, shared by every scheme); each
scheme's run goes under ``--out/<scheme>/`` (``--out/<scheme>-<E>L-<D>L/`` at other depths:
checkpoints, logs, ``results.json`` with the BLEU, its signature and timings; a folder keeps
the recipe it started with), so ``--scheme post-ln`` trains the baseline next to the
default with the same data and recipe, and the last lines compare every scheme run so far.
The schemes are :data:`fairseq_admin_pos.scheme_flags.SCHEMES` (one table for the demo, the
depth study, the analysis tool and the recipes). Measured times and BLEU, with the machines
they were measured on: docs/demo.md.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Sequence

from fairseq_admin_pos.scheme_flags import SCHEMES, TABLE

DEFAULT_BASE_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
LANGS = ("en", "de")
# the --user-dir target: the package folder (this file is in its cli/ subfolder)
PKG_DIR = Path(__file__).resolve().parents[1]

def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def tool(name: str) -> List[str]:
    """The command of a fairseq tool (``fairseq-train``, ...): the console script next to
    the interpreter running us (the project's venv), else the one on PATH, else
    ``python -m fairseq_cli.<tool>`` with this interpreter (a Python whose fairseq has no
    console scripts on PATH, e.g. on a GPU machine without the venv)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return [str(candidate)]
    if shutil.which(name):
        return [name]
    return [sys.executable, "-m", "fairseq_cli." + name.split("-", 1)[1].replace("-", "_")]


def run(cmd: Sequence[str], log_file: Path = None) -> None:
    cmd = [str(c) for c in cmd]
    print("+ " + " ".join(cmd), flush=True)
    if log_file is None:
        subprocess.run(cmd, check=True)
        return
    # stream to the console (the training log is the progress display) and to a file
    with open(log_file, "a") as fh:
        # torch's deprecation warnings about fairseq internals drown the training log
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        for line in proc.stdout:
            fh.write(line)
            if "| INFO |" not in line or any(k in line for k in (
                    "| train_inner |", "| train |", "| valid |", "done training")):
                sys.stdout.write(line)
                sys.stdout.flush()
        if proc.wait() != 0:
            raise SystemExit(f"[demo] command failed ({proc.returncode}); full log: {log_file}")


def _read_lines(path: Path) -> List[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh]


def find_raw(data: Path, out: Path, base_url: str) -> Path:
    """A folder with plain ``{split}.{lang}`` files, copied/decompressed into ``out/raw``."""
    raw = out / "raw"
    done = raw / ".done"
    if done.exists():
        return raw
    raw.mkdir(parents=True, exist_ok=True)
    for split in SPLITS.values():
        for lang in LANGS:
            name = f"{split}.{lang}"
            src = None
            if data is not None:
                for cand in (data / name, data / f"{name}.gz"):
                    if cand.exists():
                        src = cand
                        break
            if src is None:
                if data is not None and data.exists():
                    log(f"{name}(.gz) not in {data}; downloading it")
                src = raw / f"{name}.gz"
                url = f"{base_url.rstrip('/')}/{name}.gz"
                log(f"download {url}")
                try:
                    with urllib.request.urlopen(url, timeout=60) as r, open(src, "wb") as fh:
                        shutil.copyfileobj(r, fh)
                except (urllib.error.URLError, OSError) as e:
                    src.unlink(missing_ok=True)
                    raise SystemExit(
                        f"[demo] cannot find {name}(.gz) under --data {data} and cannot download "
                        f"{url} ({e}). Pass --data with a folder holding Multi30k's raw files "
                        f"(train/val/test_2016_flickr .en/.de, optionally .gz), or set "
                        f"MULTI30K_BASE_URL to a reachable mirror."
                    )
            lines = _read_lines(src)
            tmp = raw / f"{name}.tmp"
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
            tmp.rename(raw / name)
    en, de = (len(_read_lines(raw / f"train.{lang}")) for lang in LANGS)
    if en != de:
        raise SystemExit(f"[demo] train.en has {en} lines but train.de has {de}")
    done.touch()
    return raw


def sentencepiece(raw: Path, out: Path, vocab: int) -> Path:
    import sentencepiece as spm

    spm_dir = out / "spm"
    done = spm_dir / ".done"
    if done.exists():
        return spm_dir
    spm_dir.mkdir(parents=True, exist_ok=True)
    prefix = spm_dir / "spm"
    log(f"sentencepiece: joint unigram {vocab} on train.en + train.de (training side only)")
    spm.SentencePieceTrainer.train(
        input=f"{raw / 'train.en'},{raw / 'train.de'}", model_prefix=str(prefix),
        vocab_size=vocab, model_type="unigram", character_coverage=1.0, input_sentence_size=0,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    for key, split in SPLITS.items():
        for lang in LANGS:
            pieces = sp.encode(_read_lines(raw / f"{split}.{lang}"), out_type=str)
            (spm_dir / f"{key}.{lang}").write_text(
                "\n".join(" ".join(p) for p in pieces) + "\n", encoding="utf-8")
    done.touch()
    return spm_dir


def preprocess(spm_dir: Path, out: Path) -> Path:
    dest = out / "data-bin"
    if (dest / ".done").exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)  # half-written by an interrupted run
    run([*tool("fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
         "--trainpref", spm_dir / "train", "--validpref", spm_dir / "valid",
         "--testpref", spm_dir / "test", "--destdir", dest, "--joined-dictionary",
         "--workers", "2"])
    (dest / ".done").touch()
    return dest


DEVICES = ("auto", "cpu", "cuda")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(choice: str, has_cuda=cuda_available) -> str:
    """``cpu`` or ``cuda`` for ``--device``: ``auto`` is ``cuda`` when torch sees a GPU;
    ``cuda`` without one stops with one line (before anything is made)."""
    if choice == "cpu":
        return "cpu"
    if has_cuda():
        return "cuda"
    if choice == "cuda":
        import torch

        raise SystemExit(
            f"[demo] --device cuda: torch {torch.__version__} in {sys.executable} sees no CUDA "
            "GPU (torch.cuda.is_available() is False); use --device cpu, or --device auto "
            "(the default), which takes the GPU when there is one")
    return "cpu"


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name (for results.json: figures with hardware)."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    import platform

    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def device_flags(device: str) -> List[str]:
    # one GPU, so the batch per update is the CPU recipe's (fairseq would otherwise train
    # data-parallel on every visible GPU)
    return ["--cpu"] if device == "cpu" else ["--distributed-world-size", "1"]


def train_command(args, data_bin: Path, save_dir: Path, device: str = "cpu") -> List[str]:
    scheme = SCHEMES[args.scheme]
    # a scheme may bring its own optimizer (admin-paper: RAdam, as Transformer-Clinic)
    optimizer = [] if TABLE[args.scheme].optimizer else ["--optimizer", "adam"]
    return [
        *tool("fairseq-train"), data_bin, "--user-dir", PKG_DIR,
        "--arch", "admin_transformer", *device_flags(device), "--seed", str(args.seed),
        "--encoder-layers", str(args.encoder_layers), "--decoder-layers", str(args.decoder_layers),
        "--encoder-embed-dim", str(args.dim), "--decoder-embed-dim", str(args.dim),
        "--encoder-ffn-embed-dim", str(4 * args.dim), "--decoder-ffn-embed-dim", str(4 * args.dim),
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", *scheme,
        "--share-all-embeddings", "--dropout", "0.1",
        *optimizer, "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
        "--lr", str(args.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(args.warmup),
        "--warmup-init-lr", "1e-07",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", str(args.max_tokens), "--max-update", str(args.max_update),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--save-interval-updates",
        str(args.save_interval_updates), "--keep-interval-updates", "1",
        "--log-format", "simple", "--log-interval", "20", "--no-progress-bar",
        "--num-workers", "0",
    ]


# the demo's model: a deep encoder over a shallow decoder
DEMO_DEPTHS = (12, 3)

# the settings a run folder is tied to: resuming a checkpoint trained with others would fail
# inside fairseq (other shapes) or silently mix two recipes (other lr, batch, seed)
RUN_SETTINGS = ("dim", "vocab", "max_tokens", "lr", "warmup", "seed")


def run_name(args) -> str:
    """``<scheme>`` at the demo's depths, ``<scheme>-<E>L-<D>L`` at others, so that
    ``--scheme post-ln --decoder-layers 12`` does not resume the 12L-3L run."""
    if (args.encoder_layers, args.decoder_layers) == DEMO_DEPTHS:
        return args.scheme
    return f"{args.scheme}-{args.encoder_layers}L-{args.decoder_layers}L"


def check_run_settings(run_dir: Path, args) -> None:
    """Record the run's settings in ``run_dir/settings.json``; a folder holding a run with
    other settings is an error naming them (``--max-update`` may grow: training resumes)."""
    wanted = {k: getattr(args, k) for k in RUN_SETTINGS}
    path = run_dir / "settings.json"
    if path.exists():
        have = json.loads(path.read_text())
        diff = [f"--{k.replace('_', '-')} {have.get(k)} there, {wanted[k]} now"
                for k in RUN_SETTINGS if have.get(k) != wanted[k]]
        if diff:
            raise SystemExit(f"[demo] {run_dir} holds a run with other settings ("
                             + "; ".join(diff) + "): pass another --out, or remove that folder")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2) + "\n")


def compare(out: Path) -> None:
    """One line per scheme run under ``out`` so far (``results.json``)."""
    rows = []
    for path in sorted(out.glob("*/results.json")):
        r = json.loads(path.read_text())
        rows.append(f"  {r.get('scheme', path.parent.name):<12} {r['arch']:<28} "
                    f"valid nll {r.get('valid_nll_bits', float('nan')):6.3f} bits   "
                    f"sacreBLEU {r['bleu']:6.2f}   train {r['train_seconds']:.0f}s "
                    f"({r.get('device', 'cpu')})")
    if len(rows) > 1:
        print("\nEvery scheme run in " + str(out) + ":\n" + "\n".join(rows))


def last_valid_nll(log_file: Path) -> float:
    """The last ``valid_nll_loss`` / ``nll_loss`` of a validation line in fairseq's log."""
    value = float("nan")
    for line in log_file.read_text(encoding="utf-8").splitlines():
        if "| valid |" in line:
            for key in ("valid_nll_loss", "nll_loss"):
                m = re.search(rf"\b{key}[ =]([0-9.]+)", line)
                if m:
                    value = float(m.group(1))
                    break
    return value


def generate_command(data_bin: Path, ckpt: Path, device: str = "cpu") -> List[str]:
    return [*tool("fairseq-generate"), data_bin, "--user-dir", PKG_DIR, "--path", ckpt,
            "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--batch-size", "64",
            # Multi30k targets are at most ~1.2x the source; fairseq's default 200 tokens would
            # let an undertrained model babble for minutes
            "--max-len-a", "1.2", "--max-len-b", "10",
            "--remove-bpe", "sentencepiece", *(["--cpu"] if device == "cpu" else []),
            "--num-workers", "0"]


def generate_and_score(args, data_bin: Path, raw: Path, ckpt: Path, out: Path,
                       device: str = "cpu") -> dict:
    import sacrebleu

    gen_out = out / "generate-test.txt"
    cmd = generate_command(data_bin, ckpt, device)
    print("+ " + " ".join(map(str, cmd)) + f" > {gen_out}", flush=True)
    t0 = time.time()
    with open(gen_out, "w") as fh:
        subprocess.run([str(c) for c in cmd], check=True, stdout=fh)
    gen_seconds = time.time() - t0
    hyps = {}
    for line in gen_out.read_text(encoding="utf-8").splitlines():
        if line.startswith("D-"):
            sid, _, text = line.split("\t", 2)
            hyps[int(sid[2:])] = text
    refs = _read_lines(raw / f"{SPLITS['test']}.de")
    srcs = _read_lines(raw / f"{SPLITS['test']}.en")
    if len(hyps) != len(refs):
        raise SystemExit(f"[demo] generated {len(hyps)} translations for {len(refs)} references")
    ordered = [hyps[i] for i in range(len(refs))]
    (out / "test.hyp.de").write_text("\n".join(ordered) + "\n", encoding="utf-8")
    metric = sacrebleu.metrics.BLEU()
    score = metric.corpus_score(ordered, [refs])
    print("\nSample translations (test2016):")
    for i in (0, 1, 2, 100, 500):
        if i < len(refs):
            print(f"  SRC {srcs[i]}\n  REF {refs[i]}\n  HYP {ordered[i]}\n")
    return {"bleu": round(score.score, 2), "signature": str(metric.get_signature()),
            "sacrebleu": str(score), "generate_seconds": round(gen_seconds, 1),
            "test_sentences": len(refs)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None,
                   help="folder with Multi30k raw files (train/val/test_2016_flickr .en/.de, "
                   ".gz or plain); missing files are downloaded")
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder (default demo_out)")
    p.add_argument("--encoder-layers", type=int, default=DEMO_DEPTHS[0],
                   help=f"encoder depth (default {DEMO_DEPTHS[0]})")
    p.add_argument("--decoder-layers", type=int, default=DEMO_DEPTHS[1],
                   help=f"decoder depth (default {DEMO_DEPTHS[1]})")
    p.add_argument("--dim", type=int, default=128, help="model width; FFN is 4x (default 128)")
    p.add_argument("--scheme", default="admin", choices=tuple(SCHEMES),
                   help="residual scheme (default admin; docs/schemes.md); each run goes to "
                   "--out/SCHEME")
    p.add_argument("--vocab", type=int, default=8000, help="joint sentencepiece size (default 8000)")
    p.add_argument("--max-update", type=int, default=700,
                   help="training updates (default 700, about 5 epochs of Multi30k)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch (default 4096)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--warmup", type=int, default=400, help="warmup updates (default 400)")
    p.add_argument("--save-interval-updates", type=int, default=200,
                   help="checkpoint every N updates, so an interrupted demo resumes (default 200)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (default): the GPU when torch sees one, else the CPU; cpu; cuda "
                   "(refused when there is no CUDA GPU). Same recipe either way")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("encoder_layers", "decoder_layers", "dim", "vocab", "max_update", "max_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.dim % 4:
        p.error("--dim must be divisible by the 4 attention heads")
    if args.data is not None and not args.data.is_dir():
        log(f"--data {args.data} is not a folder; Multi30k will be downloaded")
        args.data = None

    device = resolve_device(args.device)  # before anything is made
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log(f"writing everything under {out}; device: {device} ({device_name(device)})")
    t_start = time.time()
    raw = find_raw(args.data.resolve() if args.data else None, out,
                   os.environ.get("MULTI30K_BASE_URL", DEFAULT_BASE_URL))
    spm_dir = sentencepiece(raw, out, args.vocab)
    data_bin = preprocess(spm_dir, out)

    run_dir = out / run_name(args)
    check_run_settings(run_dir, args)
    save_dir = run_dir / "checkpoints"
    t_train = time.time()
    run(train_command(args, data_bin, save_dir, device), log_file=run_dir / "train.log")
    train_seconds = time.time() - t_train
    result = generate_and_score(args, data_bin, raw, save_dir / "checkpoint_last.pt", run_dir,
                                device)
    result.update({
        "device": device, "device_name": device_name(device),
        "scheme": args.scheme, "scheme_flags": " ".join(SCHEMES[args.scheme]),
        "arch": f"admin_transformer {args.encoder_layers}L-{args.decoder_layers}L d={args.dim}",
        "max_update": args.max_update, "valid_nll_bits": last_valid_nll(run_dir / "train.log"),
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
    })
    (run_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"sacreBLEU on test2016 ({args.scheme}): {result['sacrebleu']}")
    print(f"signature: {result['signature']}")
    log(f"done in {result['total_seconds']:.0f}s; results in {run_dir / 'results.json'}")
    compare(out)
    log("measured runs of the demo, with their machines: docs/demo.md")


if __name__ == "__main__":
    main()
