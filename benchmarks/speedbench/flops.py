"""Model FLOPs of a Transformer training step, counted from the shapes, and the matrix rate
of the device, measured, so that utilisation = achieved FLOP/s / measured matrix FLOP/s.

Counting (multiply-accumulates, one MAC = 2 FLOPs; training = forward + backward = 3 x the
forward, the usual 2:1 backward-to-forward ratio of dense layers), for a batch of B
sentences padded to S source and T target positions (the shapes the kernels run on, padding
included), width d, FFN width F, target vocabulary V::

    encoder layer   B*S*(4 d^2 + 2 d F)  +  2 B*S*S*d               (projections, FFN; QK^T, AV)
    decoder layer   B*T*(4 d^2 + 2 d F)  +  2 B*T*T*d               (self-attention, FFN)
                  + B*T*2 d^2 + B*S*2 d^2 + 2 B*T*S*d               (cross-attention)
    output          B*T*d*V

Embedding lookups, LayerNorms, softmax, dropout, residual sums and the optimizer are left
out (they are memory-bound and a few percent of the arithmetic at d=512). fairseq computes
the full T x T self-attention scores under the causal mask, so they are counted in full.
The figure is the same for every residual scheme (the work the architecture asks for).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dims:
    """The sizes that set a step's arithmetic."""

    encoder_layers: int
    decoder_layers: int
    dim: int
    ffn: int
    vocab: int


def forward_macs(d: Dims, batch: int, src_len: int, tgt_len: int) -> int:
    """Multiply-accumulates of one forward pass (module docstring)."""
    B, S, T, c, F = batch, src_len, tgt_len, d.dim, d.ffn
    encoder = B * S * (4 * c * c + 2 * c * F) + 2 * B * S * S * c
    decoder = (B * T * (4 * c * c + 2 * c * F) + 2 * B * T * T * c
               + B * T * 2 * c * c + B * S * 2 * c * c + 2 * B * T * S * c)
    return d.encoder_layers * encoder + d.decoder_layers * decoder + B * T * c * d.vocab


def train_flops(d: Dims, batch: int, src_len: int, tgt_len: int) -> int:
    """FLOPs of one training step on one batch: 2 FLOPs per MAC, 3 x the forward."""
    return 3 * 2 * forward_macs(d, batch, src_len, tgt_len)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """Measured FLOP/s of ``size x size`` matrix products in ``dtype`` on ``device``: the
    best of five timings of ``repeats`` products (CUDA events on a GPU, wall time on a
    CPU, with the threads torch was given)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(repeats):
                torch.mm(a, b)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            for _ in range(repeats):
                torch.mm(a, b)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * size ** 3 * repeats / best
