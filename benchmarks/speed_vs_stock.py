"""Training speed of admin_transformer against stock fairseq ``transformer``, side by side.

Every variant has the same sizes and trains on the same batches through fairseq's own
``Trainer`` (as ``fairseq-train`` does; the training monitor on):

* ``stock``: fairseq's ``transformer``, fairseq's own code;
* ``admin``: Admin closed-form omegas as trainable vectors (``--admin-omega parameter``,
  Admin's most expensive setting); ``admin-buffer``: fixed scalar omegas (``--admin-omega buffer``);
* ``b2t``: B2T connection (Takase et al. 2023); ``resi-dual``: ResiDual (Xie et al. 2023);
* ``pre-ln``, ``peri-ln``, ``mix-ln``: the LayerNorm placements (Pre-LN, Peri-LN, Mix-LN),
  ``pre-ln-dyt``: Pre-LN with DyT in place of every LayerNorm (not in the default
  ``--variants``, name them);
* ``admin-compiled``: ``admin`` with ``--admin-compile layers`` (opt-in compiled layers).

One process per dtype (``speedbench/worker.py`` says what it does). Per variant and depth it
prints and writes to ``--json``:

* median step time (CUDA events on a GPU, wall time on a CPU), target words/s, and the
  ratio to stock;
* model FLOPs utilisation: FLOPs counted from the batch shapes (``speedbench/flops.py``)
  per second, over the device's matrix rate measured in the same process;
* per step, from ``torch.profiler``: top-level aten ops and host reads (``.item()`` and
  friends), and on a GPU kernel launches, kernels and host-device synchronisations;
* peak memory with one model alive at a time (CUDA: ``max_memory_allocated``; CPU: the
  step's allocations above what it started with, from the profiler);
* generation sentences/s (beam 4, exactly 30 steps) when the data has a test split.

Defaults by device. GPU: float16 and bfloat16, 6L-6L and 18L-18L, d=512, FFN 2048, 4 heads,
8192 tokens, 3 warm-up + 10 timed steps, each variant alone (estimated at about three
minutes on an H200; not yet run there). CPU: float32,
6L-6L, d=256, 4096 tokens, all cores. ``--preset tiny`` is the CPU proxy for a
launch-bound GPU step: 6L-6L, d=16, 4 heads, 256 tokens, one thread, where arithmetic is
negligible and the host's work per step is what is timed. ``--quick`` is a smoke run.

    python benchmarks/speed_vs_stock.py --multi30k ../shared/data/multi30k --work bench_out
    python benchmarks/speed_vs_stock.py --data bench_out/data-bin --preset tiny
    python benchmarks/speed_vs_stock.py --data DATA --json speed.json      # on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speedbench import report  # noqa: E402
from speedbench.worker import ALL_VARIANTS, DTYPE_FLAGS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ("admin", "admin-buffer", "b2t", "resi-dual")
PRESETS = {
    "gpu": dict(dtypes="float16,bfloat16", layers="6,18", dim=512, heads=4, max_tokens=8192,
                warmup=3, steps=10, gen_batches=1, gen_steps=30),
    "cpu": dict(dtypes="float32", layers="6", dim=256, heads=4, max_tokens=4096, warmup=3,
                steps=12, gen_batches=2, gen_steps=30),
    "tiny": dict(dtypes="float32", layers="6", dim=16, heads=4, max_tokens=256, warmup=5,
                 steps=60, gen_batches=0, gen_steps=30, threads=1),
    "quick": dict(dtypes="float32", layers="2", dim=32, heads=4, max_tokens=512, warmup=1,
                  steps=2, gen_batches=1, gen_steps=5),
}


def _parser():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, help="binarized fairseq data (joined dictionary)")
    p.add_argument("--multi30k", type=Path, default=REPO.parent / "shared/data/multi30k",
                   help="raw Multi30k folder, prepared into --work when --data is not given")
    p.add_argument("--work", type=Path, default=Path("bench_out"), help="work folder")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu (default auto)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="sizes and steps: gpu (the default on CUDA), cpu (the default on a "
                   "CPU), tiny (the launch-bound proxy), quick (smoke run)")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset",
                   help="the same as --preset quick")
    p.add_argument("--dtypes", help="comma-separated: float32, bfloat16, float16 (CUDA only)")
    p.add_argument("--layers", help="comma-separated depths N for NL-NL models")
    p.add_argument("--dim", type=int, help="width; FFN 4x")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--max-tokens", type=int, help="tokens per training batch")
    p.add_argument("--warmup", type=int, help="untimed steps per variant")
    p.add_argument("--steps", type=int, help="timed steps per variant")
    p.add_argument("--gen-batches", type=int, help="test batches of 64 decoded (0: none)")
    p.add_argument("--gen-steps", type=int, help="beam steps per sentence (30)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated variants measured with stock: "
                   f"{', '.join(v for v in ALL_VARIANTS if v != 'stock')} "
                   f"(default {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return p


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve(p, args):
    args.cuda = {"auto": None, "cpu": False, "cuda": True}[args.device]
    if args.cuda is None:
        args.cuda = _cuda_available()
    elif args.cuda and not _cuda_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device cpu or auto")
    preset = PRESETS[args.preset or ("gpu" if args.cuda else "cpu")]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    args.dtypes = [d.strip() for d in str(args.dtypes).split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPE_FLAGS]
    if bad or not args.dtypes:
        p.error(f"--dtypes {','.join(bad) or repr(args.dtypes)} is not valid; valid choices: "
                f"{', '.join(DTYPE_FLAGS)}")
    if "float16" in args.dtypes and not args.cuda:
        p.error("--dtypes float16 needs CUDA (fairseq's --fp16 keeps its float32 master copy on "
                "the GPU); on the CPU use bfloat16")
    try:
        args.layers = [int(x) for x in str(args.layers).split(",") if x.strip()]
    except ValueError:
        p.error(f"--layers must be comma-separated positive integers; got {args.layers!r}")
    if not args.layers or min(args.layers) < 1:
        p.error(f"--layers must be comma-separated positive integers; got {args.layers!r}")
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in ALL_VARIANTS or v == "stock"]
    if bad or not chosen:
        p.error(f"--variants {','.join(bad) or repr(args.variants)} is not valid; valid "
                f"choices: {', '.join(v for v in ALL_VARIANTS if v != 'stock')}")
    args.variants = ["stock", *dict.fromkeys(chosen)]


def _prepare(args) -> Path:
    if args.data is not None:
        return args.data.resolve()
    from fairseq_admin_pos.cli import demo

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    raw = demo.find_raw(args.multi30k.resolve() if args.multi30k else None, work,
                        os.environ.get("MULTI30K_BASE_URL", demo.DEFAULT_BASE_URL))
    return demo.preprocess(demo.sentencepiece(raw, work, 8000), work)


def hardware(cuda: bool) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}
    if cuda:
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return info


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    _resolve(p, args)
    if args.worker_out is not None:
        from speedbench import worker

        args.dtype = args.dtypes[0]
        args.worker_out.write_text(json.dumps(worker.run(args)))
        return
    args.data = _prepare(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="speed_vs_stock_") as tmp:
        for dtype in args.dtypes:
            out = Path(tmp) / f"{dtype}.json"
            cmd = [sys.executable, __file__, "--worker-out", str(out), "--data", str(args.data),
                   "--device", "cuda" if args.cuda else "cpu", "--dtypes", dtype,
                   "--layers", ",".join(map(str, args.layers)), "--variants",
                   ",".join(args.variants[1:])]
            for key in ("dim", "heads", "max_tokens", "warmup", "steps", "gen_batches",
                        "gen_steps", "threads"):
                cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            print(f"[{dtype}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd)
            if proc.returncode != 0:
                sys.exit(f"speed_vs_stock: the {dtype} worker failed (exit status "
                         f"{proc.returncode}); its output is above")
            results.append(json.loads(out.read_text()))
    summary = {"hardware": hardware(args.cuda), "device": "cuda" if args.cuda else "cpu",
               "settings": {k: getattr(args, k) for k in (
                   "dim", "heads", "max_tokens", "warmup", "steps", "threads", "variants",
                   "layers", "dtypes", "gen_batches", "gen_steps")},
               "results": results}
    print(report.markdown(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
