"""Speed and memory of admin_transformer against stock fairseq ``transformer``, side by side.

Both models have identical sizes; admin_transformer uses Admin closed-form omegas as trainable
vectors (``--admin-omega parameter``, the most expensive setting: one extra multiply and
one extra parameter vector per sub-layer). Each measurement runs in a fresh subprocess
(same data, same batches, same seed) and the two models alternate (A B, B A, ...), so drifts
in machine load hit both. Per worker:

* training words/s: target tokens / wall time of ``Trainer.train_step`` over the timed updates
  (fairseq's own trainer, as in ``fairseq-train``), after warm-up updates;
* generation sentences/s: fairseq's ``SequenceGenerator`` (beam 4, exactly 30 decoding steps
  so both models do the same work) over the same test batches;
* peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the peak resident set size
  (``ru_maxrss``) minus the resident size before the first update, i.e. what training adds on
  top of the process, model and data.

Prints the per-round figures and the median ratios admin / stock (targets: speeds >= 0.97,
memory <= 1.02).

    python benchmarks/speed_vs_stock.py --multi30k ../shared/data/multi30k --work bench_out
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


VARIANTS = {
    "stock": ["--arch", "transformer"],
    "admin": ["--arch", "admin_transformer", "--admin-init", "closed-form", "--admin-omega", "parameter"],
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> None:
    import torch
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.sequence_generator import SequenceGenerator
    from fairseq.trainer import Trainer

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.cpu
    parser = options.get_training_parser()
    argv = [str(args.data), "--user-dir", str(REPO / "fairseq_admin_pos"),
            *VARIANTS[args.worker], *model_flags(args),
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", str(args.max_tokens), "--seed", "1", "--num-workers", "0"]
    if not cuda:
        argv.append("--cpu")
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, argv))
    utils.set_torch_seed(1)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    task.load_dataset("test")
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    itr = trainer.get_train_iterator(epoch=1, load_dataset=False).next_epoch_itr(shuffle=True)
    batches = [next(itr) for _ in range(args.warmup + args.updates)]

    for b in batches[: args.warmup]:
        trainer.train_step([b])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_rss = rss_bytes()
    tokens, t0 = 0, time.perf_counter()
    for b in batches[args.warmup:]:
        trainer.train_step([b])
        tokens += b["ntokens"]
    if cuda:
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss

    model.eval()
    # untrained models stop at different lengths; decoding exactly 30 steps for both makes
    # sentences/s compare the same work
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_a=0,
                            max_len_b=30, min_len=30)
    test_itr = task.get_batch_iterator(
        dataset=task.dataset("test"), max_sentences=64, seed=1,
    ).next_epoch_itr(shuffle=False)
    n_sent, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for i, sample in enumerate(test_itr):
            if i >= args.gen_batches:
                break
            sample = utils.move_to_cuda(sample) if cuda else sample
            gen.generate([model], sample)
            n_sent += sample["nsentences"]
    gen_s = time.perf_counter() - t0
    print(json.dumps({"variant": args.worker, "train_wps": tokens / train_s,
                      "gen_sent_s": n_sent / gen_s, "peak_mem": peak,
                      "device": "cuda" if cuda else "cpu"}))


def prepare(args) -> Path:
    if args.data is not None:
        return args.data
    from fairseq_admin_pos import demo

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
    p.add_argument("--encoder-layers", type=int, default=6)
    p.add_argument("--decoder-layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=256, help="width; FFN 4x (default 256)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even if CUDA is there")
    p.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    data = prepare(args)
    results = {v: [] for v in VARIANTS}
    passthrough = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in (
        "warmup", "updates", "gen-batches", "encoder-layers", "decoder-layers", "dim",
        "max-tokens", "threads")] + (["--cpu"] if args.cpu else [])
    for r in range(args.rounds):
        order = ["stock", "admin"] if r % 2 == 0 else ["admin", "stock"]
        for v in order:
            cmd = [sys.executable, __file__, "--worker", v, "--data", str(data), *passthrough]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            results[v].append(res)
            print(f"round {r} {v:5s}: train {res['train_wps']:8.0f} words/s | generate "
                  f"{res['gen_sent_s']:6.1f} sent/s | peak mem {res['peak_mem'] / 2**20:8.1f} MiB "
                  f"({res['device']})", flush=True)

    def ratio(key):
        return statistics.median(a[key] / s[key] for a, s in zip(results["admin"], results["stock"]))

    print(f"\nadmin/stock, median of {args.rounds} paired rounds "
          f"({args.encoder_layers}L-{args.decoder_layers}L d={args.dim}, max-tokens {args.max_tokens}):")
    print(f"  training words/s ratio      {ratio('train_wps'):.3f}   (target >= 0.97)")
    print(f"  generation sentences/s ratio {ratio('gen_sent_s'):.3f}   (target >= 0.97)")
    print(f"  peak memory ratio           {ratio('peak_mem'):.3f}   (target <= 1.02)")


if __name__ == "__main__":
    main()
