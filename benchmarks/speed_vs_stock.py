"""Speed and memory of admin_transformer against stock fairseq ``transformer``, side by side.

All models have identical sizes. The schemes measured against stock (``--variants``, default
all three):

* ``admin``: Admin closed-form omegas as trainable vectors (``--admin-omega parameter``, the
  most expensive Admin setting: one extra parameter vector and one fused multiply-add per
  sub-layer);
* ``b2t``: B2T connection (Takase et al. 2023): one extra addition per layer;
* ``resi-dual``: ResiDual (Xie et al. 2023): one extra (float32) addition per sub-layer and
  a final LayerNorm per stack.

Speed: one subprocess per round builds every model (same seed, same batches) and times every
batch on each, rotating which goes first, so load changes on a shared machine hit all alike.
Memory: one subprocess per model (rotating order), since a peak cannot be separated within
one process on the CPU.

* training words/s: target tokens / wall time of ``Trainer.train_step`` over the timed updates
  (fairseq's own trainer, as in ``fairseq-train``), after warm-up updates;
* generation sentences/s: fairseq's ``SequenceGenerator`` (beam 4, exactly 30 decoding steps
  so both models do the same work) over the same test batches;
* peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the peak resident set size
  (``ru_maxrss``) minus the resident size after the warm-up updates, with glibc told to
  ``mmap`` every block above 64 KiB, i.e. what the timed training steps hold at their peak.

Prints the per-round figures and, per scheme, the median ratios scheme / stock (Admin's
targets: speeds >= 0.97, memory <= 1.02; B2T and ResiDual add work by design, their ratios
are measurements). ``--quick`` is a smoke run (1 round, 1 + 2 updates, 1 generation batch,
2L-2L d=64, 1024 tokens) that checks the script end to end in about a minute on a CPU.

``--dtype`` picks the training and generation precision, the same for both models:
``float32`` (default), ``bfloat16`` (fairseq's ``--bf16``: the Trainer casts the model and
the batches to bfloat16 and keeps float32 master weights; on a CPU the ``--bf16 -> --tpu``
coupling of fairseq's command line is undone, as in ``tests/test_precision.py``, so this
is the model cast and optimizer a GPU run uses), or ``float16`` (``--fp16``, CUDA only).
Admin's fixed omegas stay float32 in the low-precision model (one rounding per residual).

    python benchmarks/speed_vs_stock.py --multi30k ../shared/data/multi30k --work bench_out
    python benchmarks/speed_vs_stock.py --multi30k ../shared/data/multi30k --work bench_out \
        --dtype bfloat16
    python benchmarks/speed_vs_stock.py --data bench_out/data-bin --quick --variants b2t
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def model_flags(args):
    return [
        "--encoder-layers", str(args.encoder_layers), "--decoder-layers", str(args.decoder_layers),
        "--encoder-embed-dim", str(args.dim), "--decoder-embed-dim", str(args.dim),
        "--encoder-ffn-embed-dim", str(4 * args.dim), "--decoder-ffn-embed-dim", str(4 * args.dim),
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--share-all-embeddings", "--dropout", "0.1",
    ]


# fairseq flags of each --dtype
DTYPE_FLAGS = {"float32": [], "bfloat16": ["--bf16"], "float16": ["--fp16"]}

ALL_VARIANTS = {
    "stock": ["--arch", "transformer"],
    "admin": ["--arch", "admin_transformer", "--admin-init", "closed-form", "--admin-omega", "parameter"],
    "b2t": ["--arch", "admin_transformer", "--admin-residual", "b2t"],
    "resi-dual": ["--arch", "admin_transformer", "--admin-residual", "resi-dual"],
}
SCHEMES = [v for v in ALL_VARIANTS if v != "stock"]
#: the variants of this run: stock and the --variants chosen (set in main)
VARIANTS = dict(ALL_VARIANTS)

#: --quick: the smallest run that exercises every step
QUICK = {"rounds": 1, "warmup": 1, "updates": 2, "gen_batches": 1, "encoder_layers": 2,
         "decoder_layers": 2, "dim": 64, "max_tokens": 1024}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_trainer(args, variant):
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    parser = options.get_training_parser()
    argv = [str(args.data), "--user-dir", str(REPO / "fairseq_admin_pos"),
            *VARIANTS[variant], *model_flags(args),
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", str(args.max_tokens), "--seed", "1", "--num-workers", "0"]
    argv += DTYPE_FLAGS[args.dtype]
    if not args.cuda:
        argv.append("--cpu")
    ns = options.parse_args_and_arch(parser, argv)
    # fairseq's command line turns --bf16 into --tpu (torch_xla); keep its bf16 model cast,
    # batch cast and FP16Optimizer on this device instead
    ns.tpu = False
    cfg = convert_namespace_to_omegaconf(ns)
    utils.set_torch_seed(1)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    task.load_dataset("test")
    model = task.build_model(cfg.model)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    return task, model, trainer


def batches_of(task, trainer, n):
    itr = trainer.get_train_iterator(epoch=1, load_dataset=False).next_epoch_itr(shuffle=True)
    return [next(itr) for _ in range(n)]


def sync(args):
    import torch

    if args.cuda:
        torch.cuda.synchronize()


def speed_worker(args) -> None:
    """Both models in one process; every batch is timed on both, in alternating order, so
    load changes on a shared machine hit both equally."""
    import torch
    from fairseq import utils
    from fairseq.sequence_generator import SequenceGenerator

    torch.set_num_threads(args.threads)
    built = {v: build_trainer(args, v) for v in VARIANTS}
    task = built["stock"][0]
    batches = batches_of(task, built["stock"][2], args.warmup + args.updates)
    train_t = {v: 0.0 for v in VARIANTS}
    gen_t = {v: 0.0 for v in VARIANTS}
    tokens = 0
    for i, b in enumerate(batches):
        order = _rotated(list(VARIANTS), i)
        for v in order:
            sync(args)
            t0 = time.perf_counter()
            built[v][2].train_step([b])
            sync(args)
            if i >= args.warmup:
                train_t[v] += time.perf_counter() - t0
        if i >= args.warmup:
            tokens += b["ntokens"]

    # untrained models stop at different lengths; decoding exactly 30 steps for both makes
    # sentences/s compare the same work
    gens = {}
    for v, (_, model, _) in built.items():
        model.eval()
        gens[v] = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_a=0,
                                    max_len_b=30, min_len=30)
    test_itr = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=64,
                                       seed=1).next_epoch_itr(shuffle=False)
    n_sent = 0
    with torch.no_grad():
        for i, sample in enumerate(test_itr):
            if i >= args.gen_batches:
                break
            sample = utils.move_to_cuda(sample) if args.cuda else sample
            for v in _rotated(list(VARIANTS), i):
                sync(args)
                t0 = time.perf_counter()
                gens[v].generate([built[v][1]], sample)
                sync(args)
                gen_t[v] += time.perf_counter() - t0
            n_sent += sample["nsentences"]
    print(json.dumps({v: {"train_wps": tokens / train_t[v], "gen_sent_s": n_sent / gen_t[v]}
                      for v in VARIANTS}))


def memory_worker(args) -> None:
    """One model per process: peak memory of its training steps."""
    import torch

    torch.set_num_threads(args.threads)
    task, model, trainer = build_trainer(args, args.worker)
    batches = batches_of(task, trainer, args.warmup + args.updates)
    for b in batches[: args.warmup]:
        trainer.train_step([b])
    if args.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = rss_bytes()
    for b in batches[args.warmup:]:
        trainer.train_step([b])
    if args.cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(json.dumps({"variant": args.worker, "peak_mem": peak}))


def prepare(args) -> Path:
    if args.data is not None:
        return args.data
    from fairseq_admin_pos.cli import demo

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    raw = demo.find_raw(args.multi30k.resolve() if args.multi30k else None, work,
                        os.environ.get("MULTI30K_BASE_URL", demo.DEFAULT_BASE_URL))
    return demo.preprocess(demo.sentencepiece(raw, work, 8000), work)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, help="binarized fairseq data (joined dictionary)")
    p.add_argument("--multi30k", type=Path, default=REPO.parent / "shared/data/multi30k",
                   help="raw Multi30k folder, prepared into --work when --data is not given")
    p.add_argument("--work", type=Path, default=Path("bench_out"), help="work folder")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    p.add_argument("--warmup", type=int, default=5, help="untimed updates (default 5)")
    p.add_argument("--updates", type=int, default=30, help="timed updates (default 30)")
    p.add_argument("--gen-batches", type=int, default=4, help="test batches of 64 (default 4)")
    p.add_argument("--encoder-layers", type=int, default=6, help="encoder layers of both models (default 6)")
    p.add_argument("--decoder-layers", type=int, default=6, help="decoder layers of both models (default 6)")
    p.add_argument("--dim", type=int, default=256, help="width; FFN 4x (default 256)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per training batch (default 4096)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of every worker process (default: all cores)")
    p.add_argument("--dtype", choices=sorted(DTYPE_FLAGS), default="float32",
                   help="training and generation precision of both models: float32, "
                   "bfloat16 (fairseq's --bf16 model cast) or float16 (--fp16, CUDA only). "
                   "Default: float32")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even if CUDA is there")
    p.add_argument("--variants", default=",".join(SCHEMES),
                   help=f"comma-separated schemes measured against stock: {', '.join(SCHEMES)} "
                   "(default: all)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                  for k, v in QUICK.items()))
    p.add_argument("--worker", choices=sorted(ALL_VARIANTS) + ["speed"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in SCHEMES]
    if bad or not chosen:
        p.error(f"--variants {','.join(bad) or repr(args.variants)} is not valid; valid "
                f"choices: {', '.join(SCHEMES)}")
    VARIANTS.clear()
    VARIANTS.update({v: ALL_VARIANTS[v] for v in ["stock", *chosen]})
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.dtype == "float16" and (args.cpu or not _cuda()):
        p.error("--dtype float16 needs CUDA (fairseq's --fp16 keeps its float32 master copy on "
                "the GPU); on the CPU use --dtype bfloat16")
    if args.worker:
        args.cuda = _cuda() and not args.cpu
        return speed_worker(args) if args.worker == "speed" else memory_worker(args)

    data = prepare(args)
    passthrough = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in (
        "warmup", "updates", "gen-batches", "encoder-layers", "decoder-layers", "dim",
        "max-tokens", "threads", "dtype", "variants")] + (["--cpu"] if args.cpu else [])

    def child(mode):
        cmd = [sys.executable, __file__, "--worker", mode, "--data", str(data), *passthrough]
        env = dict(os.environ)
        if mode != "speed":
            # every block above 64 KiB gets its own mmap, so freed tensors leave the process
            # and the resident-size peak measures what the training steps hold (CPU only)
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    speed, mem = [], {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        res = child("speed")
        speed.append(res)
        for v in VARIANTS:
            print(f"round {r} {v:9s}: train {res[v]['train_wps']:8.0f} words/s | generate "
                  f"{res[v]['gen_sent_s']:6.1f} sent/s", flush=True)
        for v in _rotated(list(VARIANTS), r):
            m = child(v)["peak_mem"]
            mem[v].append(m)
            print(f"round {r} {v:9s}: peak memory {m / 2**20:8.1f} MiB", flush=True)

    where = "cuda" if (not args.cpu and _cuda()) else "cpu"
    print(f"\nscheme/stock, median of {args.rounds} round(s) ({args.encoder_layers}L-"
          f"{args.decoder_layers}L d={args.dim}, max-tokens {args.max_tokens}, {args.dtype}, "
          f"{where}):")
    print(f"  {'scheme':10s} {'training words/s':>17s} {'generation sent/s':>18s} "
          f"{'peak memory':>12s}")
    for v in VARIANTS:
        if v == "stock":
            continue
        train = statistics.median(x[v]["train_wps"] / x["stock"]["train_wps"] for x in speed)
        gen = statistics.median(x[v]["gen_sent_s"] / x["stock"]["gen_sent_s"] for x in speed)
        memory = statistics.median(a / s for a, s in zip(mem[v], mem["stock"]))
        print(f"  {v:10s} {train:17.3f} {gen:18.3f} {memory:12.3f}")
    print("  (Admin's targets: speeds >= 0.97, memory <= 1.02)")


def _rotated(items, r):
    # a different model first in each round, so a load change does not always hit the same one
    k = r % len(items)
    return items[k:] + items[:k]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
