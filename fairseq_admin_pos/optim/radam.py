"""``--optimizer radam``: ``torch.optim.RAdam`` as a fairseq optimizer.

RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and Beyond", ICLR) is
the optimizer of the Admin paper's runs (Transformer-Clinic trains with ``--optimizer radam``
from its own ``radam_fairseq`` user dir); fairseq 0.12 does not ship it. The update is
torch's: ``rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)``; while ``rho_t <= 5`` the step is
the bias-corrected momentum ``lr * m_t / (1 - beta1^t)`` (the original code's "degenerate to
SGD"), afterwards ``lr * r_t * m_t / (1 - beta1^t) * sqrt(1 - beta2^t) / (sqrt(v_t) + eps)``
with the rectification ``r_t``. Weight decay is decoupled (``p -= lr * wd * p``), as in the
original RAdam code and in fairseq's ``adam`` (which is AdamW in this respect).

Flags: the ones of fairseq's ``adam``: ``--adam-betas`` (default ``(0.9, 0.999)``),
``--adam-eps`` (1e-8), ``--weight-decay`` (0).

Precision: with ``--fp16``/``--bf16`` fairseq's FP16Optimizer hands the optimizer float32
master parameters. With ``--memory-efficient-fp16``/``-bf16`` the parameters stay half
precision; then each step runs on float32 copies of the parameter and gradient and keeps
float32 moment estimates (as fairseq's own Adam does), and the result is rounded once.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

import torch
from omegaconf import II, OmegaConf

from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer

_HALF = (torch.float16, torch.bfloat16)


@dataclass
class FairseqRAdamConfig(FairseqDataclass):
    adam_betas: Any = field(
        default=(0.9, 0.999), metadata={"help": "betas for RAdam, as for --optimizer adam"}
    )
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for RAdam"})
    weight_decay: float = field(
        default=0.0, metadata={"help": "decoupled weight decay (p -= lr * wd * p)"}
    )
    lr: List[float] = II("optimization.lr")


class RAdam(torch.optim.RAdam):
    """``torch.optim.RAdam`` whose half-precision parameters are updated in float32 (moments
    kept in float32, one rounding per step), for fairseq's memory-efficient fp16/bf16."""

    def step(self, closure=None):
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dtype in _HALF:
                    half_data, half_grad = p.data, p.grad
                    p.data = half_data.float()
                    p.grad = half_grad.float()
                    swapped.append((p, half_data, half_grad))
        try:
            return super().step(closure)
        finally:
            for p, half_data, half_grad in swapped:
                half_data.copy_(p.data)
                p.data = half_data
                p.grad = half_grad


def _betas(value):
    if isinstance(value, str):
        value = eval(value)  # fairseq's own convention for --adam-betas '(0.9, 0.98)'
    else:
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    betas = tuple(float(b) for b in value)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"--adam-betas must be two numbers in [0, 1); got {value!r}")
    return betas


@register_optimizer("radam", dataclass=FairseqRAdamConfig)
class FairseqRAdam(FairseqOptimizer):
    """fairseq wrapper of :class:`RAdam` (see the module docstring)."""

    def __init__(self, cfg: FairseqRAdamConfig, params):
        super().__init__(cfg)
        self._optimizer = RAdam(params, decoupled_weight_decay=True, **self.optimizer_config)

    @property
    def optimizer_config(self):
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr
        return {
            "lr": lr,
            "betas": _betas(self.cfg.adam_betas),
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }

    @property
    def supports_memory_efficient_fp16(self):
        return True

    @property
    def supports_flat_params(self):
        return True
