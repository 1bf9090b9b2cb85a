r"""Admin's profiling statistics and ratio recurrence: the maths alone (pure torch).

A residual sub-layer's shortcut ``x_{i-1}`` and branch ``f_i(x_{i-1})`` are summarised by the
moments ``n`` (counted elements), ``s`` (sum) and ``q`` (sum of squares), in float64; stacked
per stack as a tensor of shape ``(N, 2, 3)``: ``[sub-layer, {shortcut, branch}, {n, s, q}]``.
They add exactly over batches and data-parallel ranks. The population variance is
``Var = q/n - (s/n)**2`` (``numpy.var``, ddof=0), and Admin's recurrence (Liu et al. 2020,
Algorithm 1; Transformer-Clinic's ``adaptive-profiling``) turns the variances into omegas::

    ratio_1   = 1
    omega_i   = ratio_i
    ratio_i+1 = sqrt( omega_i**2 * Var[x_{i-1}] + Var[f_i(x_{i-1})] )

Who measures the moments and when (the hooks, the two modes) is
:mod:`fairseq_admin_pos.profiling`; the files that keep the omegas are
:mod:`fairseq_admin_pos.profile_files`.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

# index of the moments tensor, shape (N, 2, 3): [sub-layer, {shortcut, branch}, {n, s, q}]
SHORTCUT, BRANCH = 0, 1
COUNT, SUM, SUMSQ = 0, 1, 2


def _moments(values: torch.Tensor) -> torch.Tensor:
    """``[n, sum, sum of squares]`` of all elements in float64 (the conversion from
    fp16/bf16/fp32 is exact; squaring in float32 would already lose ~1e-8 relative)."""
    v = values.detach().double()
    return torch.stack(
        [
            torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device),
            v.sum(dtype=torch.float64),
            (v * v).sum(dtype=torch.float64),
        ]
    )


def variances_from_moments(moments: torch.Tensor) -> Tuple[List[float], List[float]]:
    """Population variances ``(Var[x_{i-1}], Var[f_i])`` per sub-layer from ``(N, 2, 3)`` moments."""
    m = moments.detach().to("cpu", torch.float64)
    if m.dim() != 3 or m.shape[1:] != (2, 3):
        raise ValueError(f"moments must have shape (N, 2, 3); got {tuple(m.shape)}")
    n = m[:, :, COUNT]
    if bool((n <= 0).any()):
        bad = int((n <= 0).any(dim=1).nonzero()[0]) + 1
        raise ValueError(
            f"admin profiling: sub-layer {bad} saw no counted element (all positions padding?)"
        )
    mean = m[:, :, SUM] / n
    var = (m[:, :, SUMSQ] / n - mean * mean).clamp_min(0.0)
    return var[:, SHORTCUT].tolist(), var[:, BRANCH].tolist()


def next_ratio(omega: float, shortcut_var: float, branch_var: float) -> float:
    """One step of the recurrence: ``sqrt(omega**2 Var[x] + Var[f])`` (Clinic's
    ``sqrt(np.var(residual * omega) + np.var(f))`` for a scalar omega)."""
    return math.sqrt(omega * omega * float(shortcut_var) + float(branch_var))


def omegas_from_variances(shortcut_vars: Sequence[float], branch_vars: Sequence[float]) -> List[float]:
    """Admin's ratio recurrence (see the module docstring): ``ratio_1 = 1``,
    ``omega_i = ratio_i``, ``ratio_{i+1} = sqrt(omega_i**2 Var[x_{i-1}] + Var[f_i])``."""
    if len(shortcut_vars) != len(branch_vars):
        raise ValueError("shortcut_vars and branch_vars must have the same length")
    ratio, omegas = 1.0, []
    for vx, vf in zip(shortcut_vars, branch_vars):
        omega = ratio
        omegas.append(omega)
        ratio = next_ratio(omega, vx, vf)
    return omegas


def omegas_from_moments(moments: Mapping[str, torch.Tensor]) -> Dict[str, List[float]]:
    """``{stack: [omega_1, ...]}`` from ``{stack: (N, 2, 3) moments}``."""
    return {name: omegas_from_variances(*variances_from_moments(m)) for name, m in moments.items()}
