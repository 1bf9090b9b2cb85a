"""``--optimizer radam``: ``torch.optim.RAdam`` as a fairseq optimizer.

RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and Beyond", ICLR,
Algorithm 2) is the optimizer of the Admin paper's runs: Transformer-Clinic trains every
model with ``--optimizer radam`` from its own ``radam_fairseq`` user dir. fairseq 0.12 does
not ship it. With ``m_t``, ``v_t`` Adam's moment estimates (``beta1``, ``beta2``) and

    rho_inf = 2 / (1 - beta2) - 1,    rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t),
    r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t)),

one step on a parameter ``p`` (any shape) with learning rate ``lr`` and weight decay ``wd`` is

    p <- p * (1 - lr * wd)                                          (decoupled weight decay)
    p <- p - lr * r_t * m_t / (1 - beta1^t) * sqrt(1 - beta2^t) / (sqrt(v_t) + eps)
                                                                    if rho_t > 5
    p <- p - lr * m_t / (1 - beta1^t)    (--radam-early-steps momentum, the default)
    p unchanged                          (--radam-early-steps skip)  if rho_t <= 5

The adaptive branch is ``torch.optim.RAdam(decoupled_weight_decay=True)``'s, which is also
Transformer-Clinic's ``radam_fairseq/radam.py``: same ``rho_t``, same ``r_t``, ``eps`` added
to ``sqrt(v_t)`` before the ``sqrt(1 - beta2^t)`` bias correction, weight decay
``p -= lr * wd * p`` applied before the step (not added to the gradient) in both branches.
Two differences from Clinic's code, both confined to the first updates:

* While ``rho_t <= 5`` (the variance of the adaptive rate is not defined; with
  ``beta2 >= 0.9`` exactly the first 5 updates) torch takes the bias-corrected momentum step
  of the paper's Algorithm 2; Clinic's code has that line commented out and only applies the
  weight decay. ``--radam-early-steps skip`` reproduces Clinic (the recipes in ``examples/``
  use it); the default ``momentum`` is torch's. With the recipes' warmup from 1e-7 the
  skipped steps are of size ~1e-7 * m_hat, so the choice hardly matters in practice.
* Clinic switches to the adaptive step at ``rho_t >= 5``, torch at ``rho_t > 5``; ``rho_t``
  is never exactly 5 for the betas in use.

Flags: the ones of fairseq's ``adam``: ``--adam-betas`` (default ``(0.9, 0.999)``),
``--adam-eps`` (1e-8), ``--weight-decay`` (0); and ``--radam-early-steps``.

Precision: with ``--fp16``/``--bf16`` fairseq's FP16Optimizer hands the optimizer float32
master parameters (flattened into one tensor unless ``--fp16-no-flatten-grads``; RAdam is
elementwise, so the update is the same). With ``--memory-efficient-fp16``/``-bf16`` the
parameters stay half precision; then each step runs on float32 copies of the parameter and
gradient and keeps float32 moment estimates (as fairseq's own Adam and Clinic's RAdam do),
and the result is rounded to the parameter's dtype once per step.
"""

import argparse
import ast
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

import torch
from omegaconf import II, OmegaConf

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer

from fairseq_admin_pos.errors import AdminFlagError

_HALF = (torch.float16, torch.bfloat16)
EARLY_STEPS = ("momentum", "skip")


@dataclass
class FairseqRAdamConfig(FairseqDataclass):
    """The ``--optimizer radam`` flags: fairseq's ``adam`` names (``--adam-betas``,
    ``--adam-eps``, ``--weight-decay``) plus ``--radam-early-steps``."""

    adam_betas: Any = field(
        default=(0.9, 0.999),
        metadata={"help": "betas for RAdam, a tuple as for --optimizer adam, e.g. "
                  "'(0.9, 0.98)' (Transformer-Clinic's WMT and IWSLT runs)"},
    )
    adam_eps: float = field(
        default=1e-8, metadata={"help": "epsilon for RAdam, added to sqrt(v_t)"}
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "decoupled weight decay: p -= lr * wd * p each step"}
    )
    radam_early_steps: ChoiceEnum(EARLY_STEPS) = field(
        default="momentum",
        metadata={"help": "update while RAdam's rectification is undefined (rho_t <= 5: the "
                  "first 5 updates for beta2 >= 0.9): momentum = the bias-corrected momentum "
                  "step lr * m_t / (1 - beta1^t) (RAdam paper, Algorithm 2; "
                  "torch.optim.RAdam); skip = no gradient step, only the weight decay "
                  "(Transformer-Clinic's radam_fairseq, used by the Admin paper)"},
    )
    lr: List[float] = II("optimization.lr")


def _rho(step: int, beta2: float) -> float:
    """RAdam's approximated SMA length rho_t (torch's formula)."""
    rho_inf = 2 / (1 - beta2) - 1
    return rho_inf - 2 * step * beta2**step / (1 - beta2**step)


class RAdam(torch.optim.RAdam):
    """``torch.optim.RAdam`` with two additions for fairseq (see the module docstring):

    * half-precision parameters (``--memory-efficient-fp16``/``-bf16``) are updated in
      float32: float32 copies of parameter and gradient go through torch's step, moments
      are kept in float32, and the parameter is rounded once;
    * ``early_steps="skip"``: while ``rho_t <= 5`` only the decoupled weight decay is
      applied (Transformer-Clinic), instead of torch's momentum step. The moments and the
      step count advance either way.
    """

    def __init__(self, params, early_steps: str = "momentum", **kwargs):
        if early_steps not in EARLY_STEPS:
            raise AdminFlagError(
                f"--radam-early-steps {early_steps!r} is not valid; valid choices: "
                f"{', '.join(EARLY_STEPS)}"
            )
        super().__init__(params, **kwargs)
        self.defaults["early_steps"] = early_steps
        for group in self.param_groups:
            group.setdefault("early_steps", early_steps)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # torch casts a loaded state to its parameter's dtype: put back the saved float32
        # moments of half parameters (fairseq's MemoryEfficientFP16Optimizer does the same
        # for the optimizers it wraps; this keeps RAdam right when used on its own)
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, saved_ids):
            if p.dtype in _HALF and i in state_dict["state"]:
                for key, value in state_dict["state"][i].items():
                    if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32,
                                                      copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            # evaluated here, before the float32 swap, so that its backward fills the
            # parameters' own gradients
            with torch.enable_grad():
                loss = closure()
        swapped, held = [], []
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.dtype in _HALF:
                        half_data, half_grad = p.data, p.grad
                        p.data = half_data.float()
                        p.grad = half_grad.float()
                        swapped.append((p, half_data, half_grad))
                    # .get: a checkpoint written before the setting existed lacks the key
                    if group.get("early_steps", self.defaults["early_steps"]) == "skip":
                        state = self.state[p]
                        step = int(state["step"]) + 1 if "step" in state else 1
                        if _rho(step, group["betas"][1]) <= 5:
                            held.append((p, p.detach().clone(), group))
            super().step()
            for p, before, group in held:
                # torch applied p * (1 - lr * wd) and then the momentum step: keep the first
                # (the same operation, so the same bits) and drop the second
                if group["weight_decay"] != 0:
                    before.mul_(1 - group["lr"] * group["weight_decay"])
                p.copy_(before)
        finally:
            for p, half_data, half_grad in swapped:
                half_data.copy_(p.data)
                p.data = half_data
                p.grad = half_grad
        return loss


def _read_betas(value) -> tuple:
    given = value
    try:
        if isinstance(value, str):
            value = ast.literal_eval(value)
        elif OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        betas = tuple(float(b) for b in value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        betas = None
    if betas is None or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(
            f"must be two numbers in [0, 1), written as a tuple such as '(0.9, 0.98)'; "
            f"got {given!r}"
        )
    return betas


def parse_betas(value) -> tuple:
    """``--adam-betas`` as a pair of floats in [0, 1); a string is read as a Python literal
    (fairseq's convention, ``'(0.9, 0.98)'``), without ``eval``. Raises ``ValueError``
    naming the flag otherwise."""
    try:
        return _read_betas(value)
    except ValueError as error:
        raise AdminFlagError(f"--adam-betas {error}") from None


def _betas_argument(value: str) -> str:
    """argparse ``type`` of ``--adam-betas``: refuses a bad value while the command line is
    parsed (argparse prefixes the flag), keeps the string that fairseq's config expects."""
    try:
        _read_betas(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


@register_optimizer("radam", dataclass=FairseqRAdamConfig)
class FairseqRAdam(FairseqOptimizer):
    """fairseq wrapper of :class:`RAdam` (formulas and differences to Transformer-Clinic's
    RAdam in the module docstring)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # a bad --adam-betas is then an argparse error before any data or model is loaded
        for action in parser._actions:
            if "--adam-betas" in action.option_strings:
                action.type = _betas_argument

    def __init__(self, cfg: FairseqRAdamConfig, params):
        super().__init__(cfg)
        self._optimizer = RAdam(params, decoupled_weight_decay=True, **self.optimizer_config)

    @property
    def optimizer_config(self):
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr
        eps = float(self.cfg.adam_eps)
        if not (math.isfinite(eps) and eps >= 0):
            raise AdminFlagError(f"--adam-eps must be a finite number >= 0; got {self.cfg.adam_eps!r}")
        wd = float(self.cfg.weight_decay)
        if not (math.isfinite(wd) and wd >= 0):
            raise AdminFlagError(
                f"--weight-decay must be a finite number >= 0; got {self.cfg.weight_decay!r}"
            )
        return {
            "lr": lr,
            "betas": parse_betas(self.cfg.adam_betas),
            "eps": eps,
            "weight_decay": wd,
            "early_steps": str(self.cfg.radam_early_steps),
        }

    @property
    def supports_memory_efficient_fp16(self):
        return True

    @property
    def supports_flat_params(self):
        return True
