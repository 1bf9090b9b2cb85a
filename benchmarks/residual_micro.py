"""Host time of one residual sub-layer's ``x * omega + f(x)``, forward plus backward, side by
side: the Python autograd function ``schemes._ShortcutSum`` that Admin used before its fused
shortcut, native ``addcmul`` (what ``Float32OmegaResidual`` runs now where the dtypes match), and the
plain ``x + f(x)`` of omega = 1 (B2T, ResiDual, Post-LN). At these sizes the arithmetic is
negligible: what is timed is the host's work per call, which is what a launch-bound GPU
step waits for.

    python benchmarks/residual_micro.py            # (32, 8, 16), one thread
"""
from __future__ import annotations

import argparse
import time

import torch

from fairseq_admin_pos.schemes import _ShortcutSum


def per_call_us(fn, x, f, n: int) -> float:
    for _ in range(n // 20):
        fn(x, f).sum().backward()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x, f).sum().backward()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="32,8,16", help="T,B,C (default 32,8,16)")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    x = torch.randn(shape, requires_grad=True)
    f = torch.randn(shape, requires_grad=True)
    vector = torch.nn.Parameter(torch.full(shape[-1:], 2.0))
    scalar = torch.full((1,), 2.0)
    base = per_call_us(lambda a, b: a + b, x, f, args.calls)
    print(f"x + f(x): {base:.1f} us per forward+backward ({args.shape}, "
          f"{args.threads} thread(s)); the others as extra time over it:")
    for name, fn in [
        ("trainable vector, Python function", lambda a, b: _ShortcutSum.apply(a, b, vector)),
        ("trainable vector, native addcmul", lambda a, b: torch.addcmul(b, a, vector)),
        ("fixed scalar, Python function", lambda a, b: _ShortcutSum.apply(a, b, scalar)),
        ("fixed scalar, native addcmul", lambda a, b: torch.addcmul(b, a, scalar)),
    ]:
        print(f"  {name:36s} +{per_call_us(fn, x, f, args.calls) - base:6.1f} us")


if __name__ == "__main__":
    main()
