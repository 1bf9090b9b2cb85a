"""One dtype's measurements, in one process (``speed_vs_stock.py`` starts one per dtype).

For each depth, on the same batches:

1. each variant alone (one model alive at a time): build, warm up, count one step with the
   profiler (:mod:`.probe`), measure peak memory, free it; on a GPU, which nothing else
   shares, the timed steps and generation (3.) run here too, so every model is built once;
2. on a CPU, which other jobs may share, all variants together: every batch is timed on
   each, in rotating order (so a load change hits all alike); a step is timed from an idle
   device to an idle device (CUDA events on a GPU, wall time on a CPU); the median is taken;
3. generation: fairseq's ``SequenceGenerator`` (beam 4, exactly ``--gen-steps`` steps, so
   every model does the same work) on test batches of 64 sentences, when the data has a
   test split.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Dict, List

import torch

from speedbench import flops, probe

REPO = Path(__file__).resolve().parents[2]

# fairseq flags of each dtype
DTYPE_FLAGS = {"float32": [], "bfloat16": ["--bf16"], "float16": ["--fp16"]}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ADMIN = ["--arch", "admin_transformer", "--admin-init", "closed-form", "--admin-omega", "parameter"]
ALL_VARIANTS = {
    "stock": ["--arch", "transformer"],
    # Admin's most expensive setting: a trainable omega vector per sub-layer
    "admin": ADMIN,
    "admin-buffer": ["--arch", "admin_transformer", "--admin-init", "closed-form",
                     "--admin-omega", "buffer"],
    "b2t": ["--arch", "admin_transformer", "--admin-residual", "b2t"],
    "resi-dual": ["--arch", "admin_transformer", "--admin-residual", "resi-dual"],
    # the LayerNorm placements and DyT in place of LayerNorm (Pre-LN beside it, the
    # placement DyT's paper uses, so "pre-ln-dyt / pre-ln" is DyT's own cost)
    "pre-ln": ["--arch", "admin_transformer", "--admin-init", "none",
               "--encoder-normalize-before", "--decoder-normalize-before"],
    "peri-ln": ["--arch", "admin_transformer", "--admin-residual", "peri-ln"],
    "mix-ln": ["--arch", "admin_transformer", "--admin-residual", "mix-ln"],
    "pre-ln-dyt": ["--arch", "admin_transformer", "--admin-init", "none",
                   "--encoder-normalize-before", "--decoder-normalize-before",
                   "--admin-norm", "dyt"],
    # the opt-in compiled layers (fairseq_admin_pos/speed/compile.py)
    "admin-compiled": ADMIN + ["--admin-compile", "layers"],
}


def model_flags(layers: int, dim: int, heads: int) -> List[str]:
    return [
        "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-embed-dim", str(dim), "--decoder-embed-dim", str(dim),
        "--encoder-ffn-embed-dim", str(4 * dim), "--decoder-ffn-embed-dim", str(4 * dim),
        "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
        "--share-all-embeddings", "--dropout", "0.1",
    ]


def build_trainer(args, variant: str, layers: int):
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    argv = [str(args.data), "--user-dir", str(REPO / "fairseq_admin_pos"),
            *ALL_VARIANTS[variant], *model_flags(layers, args.dim, args.heads),
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", str(args.max_tokens), "--seed", "1", "--num-workers", "0",
            *DTYPE_FLAGS[args.dtype]]
    if not args.cuda:
        argv.append("--cpu")
    ns = options.parse_args_and_arch(options.get_training_parser(), argv)
    # fairseq's command line turns --bf16 into --tpu (torch_xla); keep its bf16 model cast,
    # batch cast and FP16Optimizer on this device instead
    ns.tpu = False
    if not args.cuda and args.dtype != "float32":
        # the flattened float32 master copy is allocated on torch.cuda.current_device()
        ns.fp16_no_flatten_grads = True
    cfg = convert_namespace_to_omegaconf(ns)
    utils.set_torch_seed(1)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    model = task.build_model(cfg.model)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    return task, model, trainer


def _batches(trainer, n: int):
    itr = trainer.get_train_iterator(epoch=1, load_dataset=False).next_epoch_itr(shuffle=True)
    return [next(itr) for _ in range(n)]


def _shapes(batch):
    net = batch["net_input"]
    b, s = net["src_tokens"].shape
    return b, s, net["prev_output_tokens"].shape[1]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _timed(step, cuda: bool) -> float:
    """Seconds of one call, from an idle device to an idle device."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _alone(args, variant: str, layers: int, batches, timed: bool = False) -> Dict:
    """One variant alone: counts and peak memory; with ``timed`` (a GPU, which nothing else
    shares) also the step times of every batch after the warm-up and generation."""
    task, model, trainer = build_trainer(args, variant, layers)
    for b in batches[: args.warmup]:
        trainer.train_step([b])
    out = {}
    if timed:
        out["times"] = [_timed(lambda: trainer.train_step([b]), args.cuda)
                        for b in batches[args.warmup:]]
        out["gen"] = (_generation(args, {variant: (task, model, trainer)}, [variant])
                      .get(variant) if args.gen_batches > 0 else None)
    counts = probe.count_step(lambda: trainer.train_step([batches[args.warmup]]), args.cuda)
    peak = probe.peak_memory(
        lambda: trainer.train_step([batches[args.warmup + 1]]), args.cuda, steps=1)
    out.update(counts, peak_mib=peak / 2 ** 20)
    del task, model, trainer
    gc.collect()
    if args.cuda:
        torch.cuda.empty_cache()
    return out


def _generation(args, built, variants) -> Dict[str, float]:
    from fairseq import utils
    from fairseq.sequence_generator import SequenceGenerator

    task = built[variants[0]][0]
    try:
        task.load_dataset("test")
    except Exception:  # noqa: BLE001  (no test split: generation is not measured)
        return {}
    gens = {}
    for v in variants:
        model = built[v][1]
        model.eval()
        gens[v] = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_a=0,
                                    max_len_b=args.gen_steps, min_len=args.gen_steps)
    itr = task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=64,
                                  seed=1).next_epoch_itr(shuffle=False)
    seconds = {v: 0.0 for v in variants}
    sentences = 0
    with torch.no_grad():
        first = next(iter(task.get_batch_iterator(
            dataset=task.dataset("test"), max_sentences=8, seed=1).next_epoch_itr(shuffle=False)))
        first = utils.move_to_cuda(first) if args.cuda else first
        for v in variants:  # warm-up: first calls build caches and buffers
            gens[v].generate([built[v][1]], first)
        for i, sample in enumerate(itr):
            if i >= args.gen_batches:
                break
            sample = utils.move_to_cuda(sample) if args.cuda else sample
            for v in _rotated(variants, i):
                seconds[v] += _timed(lambda: gens[v].generate([built[v][1]], sample), args.cuda)
            sentences += sample["nsentences"]
    for v in variants:
        built[v][1].train()
    return {v: sentences / seconds[v] for v in variants} if sentences else {}


def measure_depth(args, layers: int) -> List[Dict]:
    """Every variant at one depth (module docstring); a row per variant."""
    variants = list(args.variants)
    probe_task, _, probe_trainer = build_trainer(args, "stock", layers)
    batches = _batches(probe_trainer, args.warmup + args.steps)
    vocab = len(probe_task.target_dictionary)
    del probe_task, probe_trainer
    gc.collect()

    rows = {v: {"variant": v, "layers": layers, "dtype": args.dtype} for v in variants}
    times, gen = {}, {}
    for v in _rotated(variants, layers):
        alone = _alone(args, v, layers, batches, timed=args.cuda)
        if args.cuda:  # a GPU is not shared: each variant is timed alone, models built once
            times[v], gen[v] = alone.pop("times"), alone.pop("gen")
        rows[v].update(alone)

    if not args.cuda:  # a CPU may be shared: every batch on each variant, in rotating order
        built = {v: build_trainer(args, v, layers) for v in variants}
        times = {v: [] for v in variants}
        for i, b in enumerate(batches):
            for v in _rotated(variants, i):
                seconds = _timed(lambda: built[v][2].train_step([b]), args.cuda)
                if i >= args.warmup:
                    times[v].append(seconds)
        gen = _generation(args, built, variants) if args.gen_batches > 0 else {}
        del built
        gc.collect()

    dims = flops.Dims(layers, layers, args.dim, 4 * args.dim, vocab)
    timed = batches[args.warmup:]
    work = [flops.train_flops(dims, *_shapes(b)) for b in timed]
    tokens = [b["ntokens"] for b in timed]
    for v in variants:
        step = statistics.median(times[v])
        # per-batch rates, then the median: the same batches for every variant
        rows[v].update(
            step_ms=1000 * step,
            words_per_s=statistics.median(t / s for t, s in zip(tokens, times[v])),
            flops_per_s=statistics.median(f / s for f, s in zip(work, times[v])),
            tflop_per_step=statistics.median(work) / 1e12,
            tokens_per_step=statistics.median(tokens),
            gen_sent_per_s=gen.get(v),
        )
    return [rows[v] for v in variants]


def run(args) -> Dict:
    """Every depth of this dtype, and the device's measured matrix rate."""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.cuda else "cpu")
    dtype = DTYPES[args.dtype]
    size, repeats = (8192, 20) if args.cuda else (1024, 10)
    rate = flops.matmul_rate(device, dtype, size, repeats)
    rows = []
    for layers in args.layers:
        rows.extend(measure_depth(args, layers))
    # measured again at the end, the better of the two kept: a rate measured while something
    # else briefly held the machine would inflate every utilisation figure
    rate = max(rate, flops.matmul_rate(device, dtype, size, repeats))
    for r in rows:
        r["mfu"] = r["flops_per_s"] / rate
    return {"dtype": args.dtype, "matmul_flops_per_s": rate, "matmul_size": size, "rows": rows}


def _rotated(items, r):
    k = r % len(items)
    return list(items[k:]) + list(items[:k])
