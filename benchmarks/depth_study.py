#!/usr/bin/env python3
"""Depth study on Multi30k En-De: which residual schemes let deep Transformers train.

The CPU-scale counterpart of the WMT14 En-De depth table of Liu et al. 2020
("Understanding the Difficulty of Training Transformers"): same data, same hyperparameters,
same update budget; only the residual scheme and the depth change (and, for the position
rows, the position module). Two recipes (``--preset``; docs/results.md says what was scaled
and why):

* ``demo`` (default): the recipe of ``make demo``: d 128, FFN 512, 4 heads, dropout 0.1,
  label smoothing 0.1, shared embeddings, Adam (0.9, 0.98) (RAdam for ``admin-paper``),
  inverse_sqrt with lr 2e-3 and 400 warmup updates, 4096 tokens per batch, 700 updates;
* ``d64``: the first study's: d 64, FFN 256, 100 warmup updates, 200 updates (``--quick``
  uses it: two 12L-12L runs in about 7 minutes).

``--plan demo-scale`` runs the whole grid of docs/results.md (most informative runs first);
``--jobs 2 --threads 1`` runs two at a time.

Steps (every fairseq / data command is printed before it runs):

1. Data, cached under ``OUT/data`` and skipped when complete: the raw gzip text of
   Multi30k Task 1 (``train``, ``val``, ``test_2016_flickr``, ``.en`` / ``.de``), a joint
   sentencepiece unigram vocabulary trained on the *training* side only, the encoded
   splits, and ``fairseq-preprocess --joined-dictionary`` (needed by
   ``--share-all-embeddings``).
2. For each run not yet in ``OUT/results.csv``: ``fairseq-train`` with ``--arch
   admin_transformer`` of this package (validation every ``max_update / 4`` updates), then
   ``fairseq-generate`` of ``checkpoint_best.pt`` (lowest validation loss; at the demo
   recipe mostly the last checkpoint, in about a quarter of the runs the epoch-end one at
   update 680) on test_2016_flickr (beam 4, lenpen 0.6) and detokenized sacreBLEU against
   the raw references. A run that trained to the end but was not recorded (the study was
   stopped) is evaluated, not trained again.
3. One CSV row per finished run is added (a later call adds rows, an interrupted grid
   resumes where it stopped), then the markdown table ``OUT/results_table.md`` (summary over
   seeds, every run, the runs of the grid still missing) and the loss-curve figure
   ``OUT/depth_study_loss.png`` are rewritten from all rows (``--publish docs`` also copies
   them into the docs folder and its results.md). Commands are recorded relative to the
   repository root.

Residual schemes (flags of ``fairseq_admin_pos``; the same as ``make demo --scheme``):

* ``post-ln``: ``--admin-init none`` (omega = 1: stock fairseq Post-LN);
* ``pre-ln``: ``--admin-init none --encoder-normalize-before --decoder-normalize-before``;
* ``admin``: ``--admin-init closed-form --admin-omega parameter`` (admin-torch's O(logn)
  closed form, omega a trainable vector: admin-torch's best setting);
* ``admin-paper``: the paper's Admin as Transformer-Clinic runs it: ``--admin-init profile
  --admin-profile-mode clinic --admin-omega parameter --optimizer radam
  --radam-early-steps skip``;
* ``deepnorm``: ``--admin-residual deepnorm`` (Wang et al. 2022);
* ``admin-profile`` (the d=64 study): ``--admin-init profile --admin-profile-mode eval
  --admin-omega parameter`` with Adam.

Position variants (``--positions``; Admin rows at 12L-3L): ``sinusoidal`` (fairseq's),
``scaled-sinusoidal`` (fairseq's table times a learnable scale starting at 1: the same model
at initialisation plus one scalar per side), ``scaled-sinusoidal-seed`` (the seed module: its
own table, scale starting at 1/sqrt(d)), ``learned``. The final learned scale of each run is
recorded (``final_shortcuts``, with the omegas' mean/min/max).

A run's status (see ``classify``), with H the unigram entropy of the German training side
in bits per token (</s> included, as fairseq's ``nll_loss``, which is base 2):

* ``nan``: a NaN/Inf loss, or fairseq stopped with ``FloatingPointError``;
* ``diverged``: the last logged train nll_loss is more than ``--diverge-bits`` (1.0) above
  the lowest logged train nll_loss;
* ``stuck``: the best valid nll_loss is not ``--stuck-bits`` (1.0) below H, i.e. the model
  predicts little more than word frequencies (the failure of deep Post-LN in the paper);
* ``trained`` otherwise.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USER_DIR = REPO / "fairseq_admin_pos"

SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
LANGS = ("en", "de")
SRC, TGT = "en", "de"

sys.path.insert(0, str(REPO))
# the schemes of `make demo --scheme` (one definition for both); importing the demo module
# imports neither torch nor fairseq
from fairseq_admin_pos.cli.demo import SCHEMES as DEMO_SCHEMES  # noqa: E402

SCHEMES = {
    **{k: v for k, v in DEMO_SCHEMES.items() if k != "admin-paper"},
    # the d=64 study's profiled Admin: eval-mode statistics, padding excluded, Adam
    "admin-profile": ["--admin-init", "profile", "--admin-profile-mode", "eval",
                      "--admin-omega", "parameter"],
    "admin-paper": DEMO_SCHEMES["admin-paper"],
}
SCHEMES = {k: SCHEMES[k] for k in ("post-ln", "pre-ln", "admin", "admin-profile",
                                    "admin-paper", "deepnorm")}

# position variants (both sides); "sinusoidal" is the default and leaves run keys unchanged
POSITIONS = {
    "sinusoidal": [],
    # fairseq's [sin | cos] table times a learnable scalar that starts at 1: at initialisation
    # the same model as "sinusoidal", so the row differs from it by the learnable scale alone
    "scaled-sinusoidal": [
        "--encoder-pos-emb", "scaled-sinusoidal", "--decoder-pos-emb", "scaled-sinusoidal",
        "--pos-emb-scaled-table", "fairseq", "--pos-emb-scale-init", "1",
    ],
    # the seed module as it is: the seed's own table, scale starting at 1/sqrt(d)
    "scaled-sinusoidal-seed": [
        "--encoder-pos-emb", "scaled-sinusoidal", "--decoder-pos-emb", "scaled-sinusoidal",
        "--pos-emb-scaled-table", "seed",
    ],
    "learned": ["--encoder-pos-emb", "learned", "--decoder-pos-emb", "learned"],
}

# recipes: the demo's (default) and the first, d=64 study's (issue 6, rows kept in the docs)
PRESETS = {
    "demo": dict(embed_dim=128, ffn_dim=512, heads=4, lr=2e-3, warmup=400, max_tokens=4096,
                 max_update=700),
    "d64": dict(embed_dim=64, ffn_dim=256, heads=4, lr=2e-3, warmup=100, max_tokens=4096,
                max_update=200),
}

# the grid of the demo-scale study, most informative runs first: a run that is not reached
# before the machine is taken away costs the least
_ALL5 = ("post-ln", "admin", "pre-ln", "deepnorm", "admin-paper")
_DEEP_ENC = "24L-3L"
PLANS = {
    "demo-scale": (
        [(s, "12L-12L", 1, "sinusoidal") for s in _ALL5]
        # the shallow reference next: half the cost of a 12L-12L run, and it answers "is
        # deep Admin better than shallow Admin" for seed 1
        + [(s, "6L-6L", 1, "sinusoidal") for s in ("admin", "pre-ln", "post-ln", "deepnorm",
                                                   "admin-paper")]
        + [("admin", "12L-3L", 1, p) for p in ("sinusoidal", "scaled-sinusoidal", "learned")]
        + [("admin", "12L-3L", 2, p) for p in ("sinusoidal", "scaled-sinusoidal", "learned")]
        + [("admin", "12L-3L", seed, "scaled-sinusoidal-seed") for seed in (1, 2)]
        # then the two claims in turn, Admin and Pre-LN first: the deep encoder, the spread
        # of the 12L-12L headline, the other schemes; a second seed of each before a third
        + [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("admin", "pre-ln")]
        + [(s, "12L-12L", 2, "sinusoidal") for s in ("post-ln", "admin", "pre-ln")]
        + [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("post-ln", "deepnorm", "admin-paper")]
        + [("deepnorm", "12L-12L", 2, "sinusoidal")]
        # the three seeds the claims rest on (Admin vs Pre-LN at 12L-12L and the deep
        # encoder) before the rows that only tighten a verdict already seen
        + [(s, _DEEP_ENC, 2, "sinusoidal") for s in ("admin", "pre-ln")]
        + [(s, "12L-12L", 3, "sinusoidal") for s in ("admin", "pre-ln")]
        + [(s, _DEEP_ENC, 3, "sinusoidal") for s in ("admin", "pre-ln")]
        + [("admin-paper", "12L-12L", 2, "sinusoidal")]
        + [(s, "12L-12L", 3, "sinusoidal") for s in ("post-ln", "deepnorm", "admin-paper")]
        + [("admin-paper", _DEEP_ENC, seed, "sinusoidal") for seed in (2, 3)]
    ),
}

CSV_FIELDS = [
    "key", "study", "scheme", "positions", "depth", "encoder_layers", "decoder_layers", "seed",
    "max_update",
    "embed_dim", "ffn_dim", "heads", "lr", "warmup", "max_tokens", "dropout",
    "status", "reason", "updates", "final_train_loss", "final_train_nll", "min_train_nll",
    "best_valid_loss", "best_valid_nll", "best_valid_ppl", "unigram_entropy_bits",
    "bleu", "bleu_signature", "distinct_hyps", "train_wall_s", "updates_per_s", "generate_wall_s",
    "threads", "cpu", "finished_utc", "study_command", "train_command",
    "generate_command", "curve_file", "final_shortcuts",
]

# --quick: the d=64 study's headline pair (7 minutes on two cores), so its rows are that grid's
QUICK = dict(schemes="post-ln,admin", depths="12L-12L", preset="d64")


# --------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[depth_study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def relative(text: str, out: Path | None = None) -> str:
    """A command as the docs show it: relative to the repository root, no machine paths
    (this interpreter -> ``python``, the output folder -> ``OUT``)."""
    text = re.sub(r"\S*/\.venv/bin/python\b", "python", text)
    text = text.replace(sys.executable, "python")
    if out is not None:
        text = text.replace(str(out), "OUT")
    text = text.replace(str(REPO) + "/", "")
    # rows recorded by other checkouts (an earlier study ran from another folder)
    text = re.sub(r"/\S*?/(fairseq_admin_pos|benchmarks)\b", r"\1", text)
    text = re.sub(r"/\S*/runs/depth_study\b", "OUT", text)
    return text


def show(cmd) -> str:
    text = " ".join(shlex.quote(str(c)) for c in cmd)
    print(f"\n$ {text}", flush=True)
    return text


def run_checked(cmd, env, log_file: Path | None = None, echo: bool = False):
    """Run ``cmd``; stream its output into ``log_file``; return (rc, output text)."""
    text = show(cmd)
    out = []
    with subprocess.Popen(
        [str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, cwd=REPO,
    ) as proc:
        fh = open(log_file, "w") if log_file else None
        try:
            for line in proc.stdout:
                out.append(line)
                if fh:
                    fh.write(line)
                    fh.flush()
                if echo:
                    sys.stdout.write(line)
        finally:
            if fh:
                fh.close()
        rc = proc.wait()
    return rc, "".join(out), text


def parse_depth(depth: str):
    m = re.fullmatch(r"(\d+)L-(\d+)L", depth)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise SystemExit(
            f"--depths: {depth!r} is not of the form <enc>L-<dec>L, e.g. 6L-6L, 12L-12L, 24L-4L"
        )
    return int(m.group(1)), int(m.group(2))


def fairseq_env(threads: int):
    env = dict(os.environ)
    # fairseq does not set torch's thread count; OMP/MKL decide it.
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- data
def raw_path(data: Path, split: str, lang: str) -> Path:
    return data / f"{SPLITS[split]}.{lang}.gz"


def check_data(data: Path) -> None:
    if not data.is_dir():
        raise SystemExit(
            f"--data {data}: not a directory. It must hold Multi30k Task 1 raw text: "
            + ", ".join(f"{SPLITS[s]}.{l}.gz" for s in SPLITS for l in LANGS)
        )
    missing = [str(raw_path(data, s, l).name) for s in SPLITS for l in LANGS
               if not raw_path(data, s, l).is_file()]
    if missing:
        raise SystemExit(
            f"--data {data}: missing {', '.join(missing)} (expected the gzip files of "
            "multi30k/dataset data/task1/raw: train, val, test_2016_flickr x .en/.de)"
        )


def read_gz(path: Path):
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh]


def prepare_data(data: Path, out: Path, vocab: int, threads: int, workers: int) -> Path:
    """Raw text -> sentencepiece -> fairseq binary, in ``out/data``; cached."""
    root = out / "data"
    bin_dir = root / "bin"
    stamp = root / "COMPLETE.json"
    settings = {"data": str(data.resolve()), "vocab": vocab, "model_type": "unigram"}
    if stamp.is_file() and json.loads(stamp.read_text()).get("settings") == settings:
        log(f"data ready in {root} (delete {stamp} to rebuild)")
        return root
    if root.exists():
        shutil.rmtree(root)
    (root / "raw").mkdir(parents=True)
    (root / "spm").mkdir()
    import sentencepiece as spm

    counts = {}
    for split in SPLITS:
        lines = {lang: read_gz(raw_path(data, split, lang)) for lang in LANGS}
        if len(lines["en"]) != len(lines["de"]):
            raise SystemExit(
                f"--data {data}: {SPLITS[split]}.en has {len(lines['en'])} lines but "
                f"{SPLITS[split]}.de has {len(lines['de'])}"
            )
        counts[split] = len(lines["en"])
        for lang in LANGS:
            (root / "raw" / f"{split}.{lang}").write_text("\n".join(lines[lang]) + "\n")
    log(f"sentences: {counts}")

    # joint unigram model on the training side only (valid/test never seen)
    prefix = root / "spm" / f"spm{vocab}"
    spm_args = dict(
        input=f"{root/'raw'/'train.en'},{root/'raw'/'train.de'}",
        model_prefix=str(prefix), vocab_size=vocab, model_type="unigram",
        character_coverage=1.0, num_threads=max(1, threads), seed_sentencepiece_size=1000000,
        # fairseq's dictionary adds its own <s> <pad> </s> <unk>; keep spm's ids out of the text
        bos_id=-1, eos_id=-1, unk_id=0,
    )
    print("\n$ sentencepiece.SentencePieceTrainer.train(" +
          ", ".join(f"{k}={v!r}" for k, v in spm_args.items()) + ")", flush=True)
    spm.SentencePieceTrainer.train(**spm_args, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    for split in SPLITS:
        for lang in LANGS:
            src = (root / "raw" / f"{split}.{lang}").read_text().splitlines()
            pieces = sp.encode(src, out_type=str)
            (root / "spm" / f"{split}.{lang}").write_text(
                "\n".join(" ".join(p) for p in pieces) + "\n"
            )
    log("encoded all splits with " + str(prefix) + ".model")

    cmd = [
        sys.executable, "-m", "fairseq_cli.preprocess",
        "--source-lang", SRC, "--target-lang", TGT,
        "--trainpref", root / "spm" / "train", "--validpref", root / "spm" / "valid",
        "--testpref", root / "spm" / "test", "--destdir", bin_dir,
        "--joined-dictionary", "--workers", str(workers),
    ]
    rc, text, _ = run_checked(cmd, fairseq_env(threads), root / "preprocess.log")
    if rc != 0:
        raise SystemExit(f"fairseq-preprocess failed (rc {rc}); see {root/'preprocess.log'}\n"
                         + text[-2000:])
    stamp.write_text(json.dumps({"settings": settings, "sentences": counts}, indent=1))
    return root


def unigram_entropy_bits(root: Path) -> float:
    """Entropy (bits/token) of the target training side's piece frequencies, one </s> per
    sentence included: the nll_loss of a model that ignores the source and the prefix."""
    counts = Counter()
    n_sent = 0
    for line in (root / "spm" / f"train.{TGT}").read_text().splitlines():
        counts.update(line.split())
        n_sent += 1
    counts["</s>"] += n_sent
    total = sum(counts.values())
    return -sum(c / total * math.log2(c / total) for c in counts.values())


# --------------------------------------------------------------------------- one run
LOG_RE = re.compile(r"\| (train_inner|train|valid) \| (\{.*\})\s*$")


def parse_curve(text: str):
    curve = {"train": [], "valid": []}
    for line in text.splitlines():
        m = LOG_RE.search(line)
        if not m:
            continue
        tag, stats = m.group(1), json.loads(m.group(2))

        def num(key):
            try:
                return float(stats[key])
            except (KeyError, ValueError, TypeError):
                return float("nan")

        if tag == "train_inner":
            curve["train"].append(
                {"update": int(num("num_updates")), "loss": num("loss"), "nll": num("nll_loss")}
            )
        elif tag == "valid":
            curve["valid"].append({
                "update": int(num("valid_num_updates")), "loss": num("valid_loss"),
                "nll": num("valid_nll_loss"), "ppl": num("valid_ppl"),
            })
    return curve


def classify(curve, crashed_nan: bool, unigram_bits: float, stuck_bits: float,
             diverge_bits: float):
    """(status, reason) of a run; see the module docstring."""
    train = [p for p in curve["train"]]
    valid = [p for p in curve["valid"]]
    values = [p["nll"] for p in train] + [p["nll"] for p in valid] + \
             [p["loss"] for p in train] + [p["loss"] for p in valid]
    if crashed_nan or any(not math.isfinite(v) for v in values):
        return "nan", "NaN/Inf loss or gradients (fairseq FloatingPointError)"
    if not train or not valid:
        return "error", "no train/valid statistics in the log"
    last, lowest = train[-1]["nll"], min(p["nll"] for p in train)
    if last > lowest + diverge_bits:
        return "diverged", (f"train nll {last:.2f} bits at update {train[-1]['update']} is "
                            f"> {diverge_bits} above its minimum {lowest:.2f}")
    best_valid = min(p["nll"] for p in valid)
    if best_valid > unigram_bits - stuck_bits:
        return "stuck", (f"best valid nll {best_valid:.2f} bits is not {stuck_bits} bits below "
                         f"the unigram entropy {unigram_bits:.2f}")
    return "trained", (f"best valid nll {best_valid:.2f} bits, "
                       f"{unigram_bits - best_valid:.2f} below the unigram entropy")


def train_command(args, bin_dir: Path, save_dir: Path, scheme: str, enc: int, dec: int,
                  seed: int, positions: str = "sinusoidal"):
    d, f, h = args.embed_dim, args.ffn_dim, args.heads
    valid_every = args.validate_every or max(10, args.max_update // 4)
    scheme_flags = SCHEMES[scheme]
    # a scheme may bring its own optimizer (admin-paper: RAdam, as Transformer-Clinic)
    optimizer = [] if "--optimizer" in scheme_flags else ["--optimizer", "adam"]
    cmd = [
        sys.executable, "-m", "fairseq_cli.train", bin_dir,
        "--user-dir", USER_DIR, "--arch", "admin_transformer", *scheme_flags,
        *POSITIONS[positions],
        "--encoder-layers", enc, "--decoder-layers", dec,
        "--encoder-embed-dim", d, "--decoder-embed-dim", d,
        "--encoder-ffn-embed-dim", f, "--decoder-ffn-embed-dim", f,
        "--encoder-attention-heads", h, "--decoder-attention-heads", h,
        "--share-all-embeddings", "--dropout", args.dropout,
        *optimizer, "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
        "--lr", args.lr, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", args.warmup,
        "--warmup-init-lr", "1e-07",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", args.max_tokens, "--max-update", args.max_update, "--seed", seed,
        "--validate-interval-updates", valid_every, "--save-interval-updates", valid_every,
        "--keep-interval-updates", 1, "--no-epoch-checkpoints",
        "--save-dir", save_dir, "--log-format", "json", "--log-interval", args.log_interval,
        "--cpu", "--num-workers", 0,
    ]
    return [str(c) for c in cmd]


def unsupported_flags(scheme: str, positions: str, env) -> list:
    """Flags (or ``--optimizer`` values) of this variant that this checkout's fairseq-train
    does not know: such runs are left for a later call instead of failing."""
    flags = SCHEMES[scheme] + POSITIONS[positions]
    # fairseq lists an optimizer's own flags only when that optimizer is chosen
    at = flags.index("--optimizer") if "--optimizer" in flags else len(flags)
    chosen = flags[at:at + 2]
    cmd = [sys.executable, "-m", "fairseq_cli.train", "--user-dir", str(USER_DIR),
           "--arch", "admin_transformer", *chosen, "--help"]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True).stdout
    missing = [f for f in flags if f.startswith("--") and f not in out]
    for i, f in enumerate(flags[:-1]):
        if f in ("--optimizer", "--encoder-pos-emb", "--pos-emb-scaled-table") and \
                not re.search(r"[{,]" + re.escape(flags[i + 1]) + r"[,}]", out):
            missing.append(f"{f} {flags[i + 1]}")
    return missing


def final_shortcuts(ckpt: Path) -> dict:
    """The trained shortcut weights and position scales in a checkpoint: per stack, mean /
    min / max of the omega vectors (or ReZero scalars), and each side's position scale."""
    import torch

    sys.path.insert(0, str(REPO))
    from fairseq_admin_pos.fairseq_fixes.checkpoint_compat import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    state = torch.load(ckpt, map_location="cpu")["model"]
    out = {}
    for side in ("encoder", "decoder"):
        omegas = [v.float().flatten() for k, v in state.items()
                  if k.startswith(side + ".") and k.endswith(".omega")]
        if omegas:
            cat = torch.cat(omegas)
            out[f"{side}_omega"] = [round(cat.mean().item(), 4), round(cat.min().item(), 4),
                                    round(cat.max().item(), 4)]
        scale = state.get(f"{side}.embed_positions.embed.scaling")
        if scale is not None:
            out[f"{side}_pos_scale"] = round(scale.float().item(), 4)
    return out


def generate(args, root: Path, save_dir: Path, run_dir: Path, env):
    """Beam-4 translations of test_2016_flickr, spm-decoded; detokenized sacreBLEU."""
    import sacrebleu

    ckpt = save_dir / "checkpoint_best.pt"
    cmd = [
        sys.executable, "-m", "fairseq_cli.generate", root / "bin",
        "--user-dir", USER_DIR, "--path", ckpt, "--gen-subset", "test",
        "--beam", 4, "--lenpen", 0.6, "--batch-size", 128,
        # bounded output length: an untrained model otherwise repeats a token 200 times
        "--max-len-a", 1.2, "--max-len-b", 10,
        "--remove-bpe", "sentencepiece", "--cpu", "--num-workers", 0,
    ]
    cmd = [str(c) for c in cmd]
    t0 = time.time()
    rc, text, cmd_text = run_checked(cmd, env, run_dir / "generate.log")
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"fairseq-generate failed (rc {rc}); see {run_dir/'generate.log'}")
    hyps = {}
    for line in text.splitlines():
        if line.startswith("D-"):
            head, _score, *hyp = line.split("\t")
            hyps[int(head[2:])] = hyp[0] if hyp else ""
    refs = (root / "raw" / f"test.{TGT}").read_text().splitlines()
    if len(hyps) != len(refs):
        raise RuntimeError(f"fairseq-generate produced {len(hyps)} of {len(refs)} translations")
    hyp_list = [hyps[i] for i in range(len(refs))]
    (run_dir / f"test.hyp.{TGT}").write_text("\n".join(hyp_list) + "\n")
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(hyp_list, [refs])
    sig = str(bleu.get_signature())
    log(f"sacreBLEU {score.score:.2f}  {score}  signature: {sig}")
    return score.score, sig, wall, cmd_text


def distinct_translations(hyp_file: Path) -> str:
    """How many different sentences the test translations are ("" without the file): a
    model that learned only the German side (a language model that ignores the source)
    passes the loss-based verdict but gives the same sentence for every input."""
    if not hyp_file.is_file():
        return ""
    return str(len(set(hyp_file.read_text().splitlines())))


def finished_training(run_dir: Path, save_dir: Path, cmd):
    """``(log text, command text, training seconds)`` of a run in ``run_dir`` that trained to
    the end with exactly ``cmd`` (recorded in ``command.txt``) and still has its checkpoints,
    else None."""
    log_file, recorded = run_dir / "train.log", run_dir / "command.txt"
    if not (log_file.is_file() and (save_dir / "checkpoint_best.pt").is_file()
            and (save_dir / "checkpoint_last.pt").is_file()):
        return None
    text = log_file.read_text()
    done = re.search(r"done training in ([0-9.]+) seconds", text)
    cmd_text = " ".join(shlex.quote(str(c)) for c in cmd)
    # runs started before command.txt existed: fairseq's logged config names the save dir
    same = (recorded.read_text() == cmd_text if recorded.is_file()
            else f"'save_dir': '{save_dir}'" in text)
    if done is None or not same:
        return None
    return text, cmd_text, float(done.group(1))


def run_key(scheme, depth, seed, args, positions: str = "sinusoidal") -> str:
    key = (f"{scheme}|{depth}|seed{seed}|{args.max_update}upd|d{args.embed_dim}"
           f"|lr{args.lr:g}|wu{args.warmup}|mt{args.max_tokens}")
    # written only when not the default, so the keys of earlier rows stay valid
    if args.dropout != 0.1:
        key += f"|do{args.dropout:g}"
    if args.vocab != 8000:
        key += f"|v{args.vocab}"
    return key if positions == "sinusoidal" else f"{key}|pos-{positions}"


def study_name(args) -> str:
    return f"d{args.embed_dim}-{args.max_update}upd"


def one_run(args, root, scheme, depth, seed, unigram_bits, study_cmd, positions="sinusoidal"):
    enc, dec = parse_depth(depth)
    key = run_key(scheme, depth, seed, args, positions)
    run_dir = args.out / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
    save_dir = run_dir / "ckpt"
    env = fairseq_env(args.threads)
    cmd = train_command(args, root / "bin", save_dir, scheme, enc, dec, seed, positions)
    finished = finished_training(run_dir, save_dir, cmd)
    if finished is not None:
        # trained to the end by an earlier call that stopped before recording the row:
        # evaluate that run instead of training it again
        rc, text, cmd_text, wall = 0, *finished
        log(f"run {key}: reusing the finished training in {run_dir}")
    else:
        if run_dir.exists():  # an interrupted earlier attempt: start it again from scratch
            shutil.rmtree(run_dir)
        save_dir.mkdir(parents=True)
        (run_dir / "command.txt").write_text(" ".join(shlex.quote(str(c)) for c in cmd))
        log(f"run {key}")
        t0 = time.time()
        rc, text, cmd_text = run_checked(cmd, env, run_dir / "train.log", echo=args.verbose)
        wall = time.time() - t0
    curve = parse_curve(text)
    (run_dir / "curve.json").write_text(json.dumps(curve))
    crashed_nan = rc != 0 and ("FloatingPointError" in text or "Nan/Inf" in text)
    if rc != 0 and not crashed_nan:
        tail = "\n".join(text.splitlines()[-15:])
        log(f"fairseq-train failed (rc {rc}) for {key}; not recorded, rerun retries it.\n{tail}")
        return None
    status, reason = classify(curve, crashed_nan, unigram_bits, args.stuck_bits,
                              args.diverge_bits)
    updates = curve["train"][-1]["update"] if curve["train"] else 0
    bleu, sig, gen_wall, gen_cmd = float("nan"), "", 0.0, ""
    if (save_dir / "checkpoint_best.pt").is_file():
        try:
            bleu, sig, gen_wall, gen_cmd = generate(args, root, save_dir, run_dir, env)
        except RuntimeError as err:
            log(str(err))
    shortcuts = {}
    if (save_dir / "checkpoint_last.pt").is_file():
        shortcuts = final_shortcuts(save_dir / "checkpoint_last.pt")
    if not args.keep_checkpoints:
        shutil.rmtree(save_dir, ignore_errors=True)
    valid = curve["valid"]
    best = min(valid, key=lambda p: p["loss"]) if valid else None
    train = curve["train"]

    def fmt(v, nd=3):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"

    row = {
        "key": key, "study": study_name(args), "scheme": scheme, "positions": positions,
        "depth": depth, "encoder_layers": enc,
        "decoder_layers": dec, "seed": seed, "max_update": args.max_update,
        "embed_dim": args.embed_dim, "ffn_dim": args.ffn_dim, "heads": args.heads,
        "lr": f"{args.lr:g}", "warmup": args.warmup, "max_tokens": args.max_tokens,
        "dropout": args.dropout, "status": status, "reason": reason, "updates": updates,
        "final_train_loss": fmt(train[-1]["loss"]) if train else "",
        "final_train_nll": fmt(train[-1]["nll"]) if train else "",
        "min_train_nll": fmt(min(p["nll"] for p in train)) if train else "",
        "best_valid_loss": fmt(best["loss"]) if best else "",
        "best_valid_nll": fmt(best["nll"]) if best else "",
        "best_valid_ppl": fmt(best["ppl"], 1) if best else "",
        "unigram_entropy_bits": fmt(unigram_bits),
        "bleu": fmt(bleu, 2), "bleu_signature": sig,
        "distinct_hyps": distinct_translations(run_dir / f"test.hyp.{TGT}") if sig else "",
        "train_wall_s": fmt(wall, 1), "updates_per_s": fmt(updates / wall if wall else 0.0),
        "generate_wall_s": fmt(gen_wall, 1), "threads": args.threads, "cpu": cpu_name(),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "study_command": study_cmd, "train_command": cmd_text, "generate_command": gen_cmd,
        "curve_file": str((run_dir / "curve.json").relative_to(args.out)),
        "final_shortcuts": json.dumps(shortcuts, sort_keys=True) if shortcuts else "",
    }
    log(f"{key}: {status} ({reason}); BLEU {row['bleu']}; {row['updates_per_s']} updates/s")
    return row


# --------------------------------------------------------------------------- outputs
def read_rows(path: Path):
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:  # rows written before a column existed
        for f in CSV_FIELDS:
            r.setdefault(f, "")
        if not r["distinct_hyps"] and r["curve_file"]:  # counted from the run if still there
            r["distinct_hyps"] = distinct_translations(
                path.parent / Path(r["curve_file"]).parent / f"test.hyp.{TGT}")
        for f in ("train_command", "generate_command", "study_command"):
            r[f] = relative(r[f], path.parent)
        r["study"] = r["study"] or f"d{r['embed_dim']}-{r['max_update']}upd"
        r["positions"] = r["positions"] or "sinusoidal"
    return rows


def append_row(path: Path, row) -> None:
    """Add ``row``; the file is rewritten (atomically) so older rows gain new columns."""
    rows = read_rows(path) + [row]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def depth_order(depth: str):
    enc, dec = parse_depth(depth)
    return (enc + dec, enc)


SCHEME_ORDER = {s: i for i, s in enumerate(SCHEMES)}
POS_ORDER = {p: i for i, p in enumerate(POSITIONS)}
STUDY_TITLES = {
    "d128-700upd": "Demo scale: d=128, 700 updates (the `make demo` recipe)",
    "d64-200upd": "The first study: d=64, 200 updates (issue 6)",
}


def _study_order(study: str):
    m = re.fullmatch(r"d(\d+)-(\d+)upd", study)
    return (-int(m.group(1)), -int(m.group(2))) if m else (0, 0)


def _row_order(r):
    return (_study_order(r["study"]), depth_order(r["depth"]),
            POS_ORDER.get(r["positions"], 99), SCHEME_ORDER.get(r["scheme"], 99),
            int(r["seed"]))


def _num(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _mean_spread(values, nd=2):
    """``mean +- sample std (min-max)`` of the finite values."""
    xs = [v for v in (_num(v) for v in values) if v is not None]
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{mean:.{nd}f}"
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return f"{mean:.{nd}f} +- {std:.{nd}f} ({min(xs):.{nd}f}-{max(xs):.{nd}f})"


def summary_lines(rows):
    """One line per (depth, positions, scheme): seeds, statuses, BLEU and valid nll as
    mean +- sample standard deviation (min-max) over the seeds."""
    groups = {}
    for r in sorted(rows, key=_row_order):
        groups.setdefault((r["depth"], r["positions"], r["scheme"]), []).append(r)
    lines = [
        "| depth | positions | scheme | seeds | status | BLEU mean +- std (min-max) | "
        "best valid nll (bits) mean +- std (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (depth, pos, scheme), rs in groups.items():
        statuses = Counter(r["status"] for r in rs)
        status = ", ".join(f"{n} {st}" for st, n in sorted(statuses.items()))
        lines.append(
            f"| {depth} | {pos} | {scheme} | {','.join(r['seed'] for r in rs)} | {status} | "
            f"{_mean_spread([r['bleu'] for r in rs])} | "
            f"{_mean_spread([r['best_valid_nll'] for r in rs], 3)} |"
        )
    return lines


def write_table(rows, path: Path, planned=()) -> None:
    """Per study: the summary over seeds, every row, and (for the running plan) the rows
    still missing; then the commands of every row."""
    rows = sorted(rows, key=_row_order)
    studies = sorted({r["study"] for r in rows}, key=_study_order)
    lines = []
    n = 0
    numbered = []
    for study in studies:
        rs = [r for r in rows if r["study"] == study]
        lines += [f"### {STUDY_TITLES.get(study, study)}", "",
                  "Summary over seeds:", ""] + summary_lines(rs)
        lines += [
            "", "Every run:", "",
            "| # | depth | positions | scheme | seed | updates | status | final train nll (bits) | "
            "best valid nll (bits) / ppl | BLEU | distinct translations | "
            "final shortcut weights / position scale | train wall (s) | updates/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rs:
            n += 1
            numbered.append(r)
            shortcuts = json.loads(r["final_shortcuts"]) if r["final_shortcuts"] else {}
            shown = "; ".join(
                f"{k} " + ("/".join(f"{x:g}" for x in v) if isinstance(v, list) else f"{v:g}")
                for k, v in sorted(shortcuts.items())) or "-"
            lines.append(
                f"| {n} | {r['depth']} | {r['positions']} | {r['scheme']} | {r['seed']} | "
                f"{r['updates']} | **{r['status']}** | {r['final_train_nll']} | "
                f"{r['best_valid_nll']} / {r['best_valid_ppl']} | {r['bleu'] or '-'} | "
                f"{r['distinct_hyps'] or '-'} | {shown} | {r['train_wall_s']} | "
                f"{r['updates_per_s']} |"
            )
        missing = [m for m in planned if m[0] == study]
        if missing:
            lines += ["", f"Still missing from the plan ({len(missing)} runs): " + ", ".join(
                f"{scheme} {depth} seed {seed}" + ("" if pos == "sinusoidal" else f" ({pos})")
                for _, scheme, depth, seed, pos in missing) + "."]
        lines.append("")
    ents = sorted({r["unigram_entropy_bits"] for r in rows})
    sigs = sorted({r["bleu_signature"] for r in rows if r["bleu_signature"]})
    lines += [f"Unigram entropy of the German training side: {', '.join(ents)} bits/token.",
              f"sacreBLEU signature: {'; '.join(sigs) or '-'}", "",
              "Omega columns: mean/min/max over every omega entry of the stack after the last "
              "update; position scale: the learned scalar of the scaled sinusoid. Distinct "
              "translations: different sentences among the test set's translations (1 means "
              "the same sentence for every source: the model ignores the source; '-' where "
              "the run's translations were lost).", "",
              "Commands per row:", ""]
    for i, r in enumerate(numbered, 1):
        lines.append(f"{i}. `{r['study_command']}`  \n   train: `{r['train_command']}`  \n"
                     f"   status reason: {r['reason']}")
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows, out: Path, path: Path, published: Path) -> None:
    """Loss curves of the newest study, one panel per depth (rows whose curve file is here)."""
    import logging

    import matplotlib

    # importing fairseq (for the --admin-init check) leaves the root logger at DEBUG
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if curve_path(out, r, published) is not None]
    if not rows:
        return
    newest = min({r["study"] for r in rows}, key=_study_order)
    groups = {}
    for r in rows:
        if r["study"] == newest:
            groups.setdefault(r["depth"], []).append(r)
    keys = sorted(groups, key=depth_order)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.5), squeeze=False)
    colors = {"post-ln": "tab:red", "pre-ln": "tab:blue", "admin": "tab:green",
              "admin-profile": "tab:purple", "admin-paper": "tab:purple",
              "deepnorm": "tab:orange"}
    pos_colors = {"sinusoidal": "tab:green", "scaled-sinusoidal": "tab:olive",
                  "scaled-sinusoidal-seed": "tab:brown", "learned": "tab:cyan"}
    for ax, k in zip(axes[0], keys):
        ent = None
        first_seed = {}
        by_pos = len({r["positions"] for r in groups[k]}) > 1
        for r in sorted(groups[k], key=_row_order):
            name = r["positions"] if by_pos else r["scheme"]
            # later seeds: same colour, lighter, so the variants stay readable
            alpha = 1.0 if first_seed.setdefault(name, r["seed"]) == r["seed"] else 0.4
            curve = json.loads(curve_path(out, r, published).read_text())
            c = (pos_colors if by_pos else colors).get(name, "black")
            label = f"{name} s{r['seed']} ({r['status']}, BLEU {r['bleu'] or '-'})"
            ax.plot([p["update"] for p in curve["train"]], [p["nll"] for p in curve["train"]],
                    color=c, lw=1.1, alpha=alpha, label=label)
            ax.plot([p["update"] for p in curve["valid"]], [p["nll"] for p in curve["valid"]],
                    color=c, ls="--", marker="o", ms=3, alpha=alpha)
            ent = float(r["unigram_entropy_bits"])
        if ent is not None:
            ax.axhline(ent, color="gray", lw=0.8, ls=":", label="unigram entropy")
        ax.set_title(f"{k}, {newest}" + (" (Admin, position variants)" if by_pos else ""))
        ax.set_xlabel("update")
        ax.set_ylabel("nll (bits/token): train solid, valid dashed")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def published_curve(dest: Path, row) -> Path:
    """Where ``--publish DEST`` keeps a row's curve, so that a study started again in a new
    output folder still draws the rows recorded before: ``DEST/depth_study_curves/<run>.json``."""
    return dest / "depth_study_curves" / f"{Path(row['curve_file']).parent.name}.json"


def curve_path(out: Path, row, published: Path) -> Path | None:
    """The row's ``curve.json`` under ``out``, else its published copy, else None."""
    for path in (out / row["curve_file"], published_curve(published, row)):
        if path.is_file():
            return path
    return None


TABLE_START = "<!-- depth_study table: start -->"
TABLE_END = "<!-- depth_study table: end -->"


def publish(out: Path, dest: Path) -> None:
    """Copy the CSV and figure into ``dest`` and refresh the table block of results.md."""
    page = dest / "results.md"
    if not page.is_file():
        raise SystemExit(f"--publish {dest}: {page} does not exist")
    text = page.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"--publish {dest}: {page} lacks the lines {TABLE_START!r} and "
                         f"{TABLE_END!r} that delimit the table")
    # the rows as read (commands relative to the repository root, no machine paths)
    rows = read_rows(out / "results.csv")
    with open(dest / "depth_study_results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    shutil.copyfile(out / "depth_study_loss.png", dest / "depth_study_loss.png")
    (dest / "depth_study_curves").mkdir(exist_ok=True)
    for r in rows:
        if (out / r["curve_file"]).is_file():
            shutil.copyfile(out / r["curve_file"], published_curve(dest, r))
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    table = (out / "results_table.md").read_text()
    page.write_text(f"{head}{TABLE_START}\n{table}{TABLE_END}{tail}")
    log(f"published to {page}, {dest/'depth_study_results.csv'}, {dest/'depth_study_loss.png'}")


# --------------------------------------------------------------------------- main
def check_imports(report_only: bool) -> None:
    """Fail early, naming what to install, instead of after the data preparation."""
    needed = ["matplotlib"] if report_only else ["fairseq", "sentencepiece", "sacrebleu",
                                                 "matplotlib"]
    missing = []
    for name in needed:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(
            f"depth_study needs {', '.join(missing)} in this Python ({sys.executable}); "
            "run `make install` and use .venv/bin/python (extras: data, plot)"
        )


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " See the module docstring / docs/results.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "multi30k",
                   help="folder with Multi30k Task 1 raw gzip text: train/val/test_2016_flickr "
                        ".en.gz/.de.gz")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "depth_study",
                   help="output folder: cached data, runs, results.csv, table, figure")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                   help="recipe: demo = the make-demo recipe (d 128, FFN 512, lr 2e-3, warmup "
                        "400, 700 updates); d64 = the first study (d 64, FFN 256, warmup 100, "
                        "200 updates). Explicit --embed-dim etc. override it")
    p.add_argument("--plan", choices=sorted(PLANS), default=None,
                   help="run a predefined grid instead of --schemes x --depths x --seeds: "
                        "demo-scale = 5 schemes x {6L-6L, 12L-12L, " + _DEEP_ENC + "} with 3 "
                        "seeds at 12L-12L and for the deep-encoder admin/admin-paper/pre-ln "
                        "rows, plus the position variants at 12L-3L (2 seeds), most "
                        "informative runs first")
    p.add_argument("--quick", action="store_true",
                   help="the headline contrast only, fast: --schemes post-ln,admin --depths "
                        "12L-12L --preset d64 (explicit flags override it)")
    p.add_argument("--schemes", default="post-ln,pre-ln,admin,admin-paper,deepnorm",
                   help=f"comma list from: {', '.join(SCHEMES)}")
    p.add_argument("--positions", default="sinusoidal",
                   help=f"comma list of position variants from: {', '.join(POSITIONS)}")
    p.add_argument("--depths", default="6L-6L,12L-12L," + _DEEP_ENC,
                   help="comma list of <enc>L-<dec>L")
    p.add_argument("--seeds", default="1", help="comma list of seeds")
    p.add_argument("--max-update", type=int, default=None,
                   help="updates per run (the budget; default: the preset's)")
    p.add_argument("--embed-dim", type=int, default=None, help="default: the preset's")
    p.add_argument("--ffn-dim", type=int, default=None, help="default: the preset's")
    p.add_argument("--heads", type=int, default=None, help="default: the preset's")
    p.add_argument("--dropout", type=float, default=0.1, help="fairseq --dropout of every run")
    p.add_argument("--lr", type=float, default=None, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=None,
                   help="inverse_sqrt warmup updates (default: the preset's; d64 uses 100 so "
                        "the lr peaks within its 200-update budget)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the preset's")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (each with --threads torch threads)")
    p.add_argument("--vocab", type=int, default=8000, help="joint sentencepiece vocabulary")
    p.add_argument("--validate-every", type=int, default=0,
                   help="validate every N updates (0: max_update / 4)")
    p.add_argument("--log-interval", type=int, default=10,
                   help="fairseq --log-interval: updates between logged training losses")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run")
    p.add_argument("--stuck-bits", type=float, default=1.0,
                   help="'stuck' if the best valid nll is not this far below the unigram "
                        "entropy of the target side")
    p.add_argument("--diverge-bits", type=float, default=1.0,
                   help="'diverged' if the last train nll exceeds its minimum by more")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep checkpoint_best.pt of each run (deleted after BLEU otherwise)")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the table and figure from results.csv")
    p.add_argument("--publish", type=Path, default=None, metavar="DIR",
                   help="also copy results.csv -> DIR/depth_study_results.csv, the figure -> "
                        "DIR/depth_study_loss.png, and put the table into DIR/results.md "
                        f"between the lines {TABLE_START!r} and {TABLE_END!r}")
    p.add_argument("--verbose", action="store_true", help="echo fairseq-train's log")
    return p


def _grid(args, schemes, depths, seeds, positions):
    if args.plan:
        return list(PLANS[args.plan])
    return [(s, d, seed, pos) for d in depths for pos in positions for s in schemes
            for seed in seeds]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for name, value in QUICK.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        parser.error(f"--schemes: unknown {', '.join(bad)}; valid choices: {', '.join(SCHEMES)}")
    positions = [s.strip() for s in args.positions.split(",") if s.strip()]
    bad = [s for s in positions if s not in POSITIONS]
    if bad:
        parser.error(f"--positions: unknown {', '.join(bad)}; valid choices: "
                     f"{', '.join(POSITIONS)}")
    depths = [d.strip() for d in args.depths.split(",") if d.strip()]
    for d in depths:
        parse_depth(d)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma list of integers")
    if args.max_update < 1 or args.threads < 1 or args.jobs < 1:
        parser.error("--max-update, --threads and --jobs must be >= 1")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "results.csv"
    grid = _grid(args, schemes, depths, seeds, positions)

    check_imports(args.report_only)
    if not args.report_only:
        check_data(args.data)
        root = prepare_data(args.data, args.out, args.vocab, args.threads, args.threads)
        unigram_bits = unigram_entropy_bits(root)
        log(f"unigram entropy of train.{TGT}: {unigram_bits:.3f} bits/token")
        study_cmd = "python benchmarks/depth_study.py " + " ".join(shlex.quote(a) for a in argv)
        run_grid(args, root, grid, unigram_bits, study_cmd, csv_path)
    rows = read_rows(csv_path)
    if not rows:
        log(f"no rows in {csv_path} yet")
        return 0
    done = {r["key"] for r in rows}
    missing = [(study_name(args), *g) for g in grid if run_key(*g[:3], args, g[3]) not in done]
    write_table(rows, args.out / "results_table.md", missing)
    write_plot(rows, args.out, args.out / "depth_study_loss.png", args.publish or REPO / "docs")
    log(f"{len(rows)} rows in {csv_path}; table {args.out/'results_table.md'}; "
        f"figure {args.out/'depth_study_loss.png'}")
    if missing:
        log(f"{len(missing)} runs of this grid are still missing (listed in the table)")
    print((args.out / "results_table.md").read_text())
    if args.publish is not None:
        publish(args.out, args.publish)
    return 0


def run_grid(args, root, grid, unigram_bits, study_cmd, csv_path) -> None:
    """Run the grid's missing runs, ``--jobs`` at a time, in grid order.

    A variant whose flags this checkout's fairseq-train does not know is passed over (and
    asked about again ten minutes later, so that code landing while a long grid runs is
    picked up); what is left is listed as missing and a later call runs it."""
    import threading

    done = {r["key"] for r in read_rows(csv_path)}
    pending = [g for g in grid if run_key(*g[:3], args, g[3]) not in done]
    log(f"grid: {len(grid)} runs, {len(grid) - len(pending)} already in {csv_path}")
    lock = threading.Lock()
    env = fairseq_env(args.threads)
    known = {}  # (scheme, positions) -> (time asked, missing flags)

    def next_item():
        with lock:
            for item in list(pending):
                variant = (item[0], item[3])
                asked, missing = known.get(variant, (None, None))
                if asked is None or (missing and time.time() - asked > 600):
                    missing = unsupported_flags(*variant, env)
                    known[variant] = (time.time(), missing)
                    if missing:
                        log(f"passing over {variant[0]} / {variant[1]}: this checkout's "
                            f"fairseq-train does not know {', '.join(missing)}")
                if not missing:
                    pending.remove(item)
                    return item
            return None

    def worker():
        while (item := next_item()) is not None:
            scheme, depth, seed, pos = item
            try:
                row = one_run(args, root, scheme, depth, seed, unigram_bits, study_cmd, pos)
            except Exception:  # one broken run must not end the grid; it stays missing
                import traceback

                log(f"run {item} failed, not recorded (a rerun retries it):\n"
                    + traceback.format_exc())
                continue
            if row is None:
                continue
            with lock:
                append_row(csv_path, row)
                rows = read_rows(csv_path)
                done_keys = {r["key"] for r in rows}
                missing = [(study_name(args), *g) for g in grid
                           if run_key(*g[:3], args, g[3]) not in done_keys]
                write_table(rows, args.out / "results_table.md", missing)
                write_plot(rows, args.out, args.out / "depth_study_loss.png",
                           args.publish or REPO / "docs")

    threads = [threading.Thread(target=worker) for _ in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
