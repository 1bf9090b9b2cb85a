r"""Admin's profiling initialisation: statistics, ratio recurrence, profile files (pure torch).

This module never imports fairseq; the fairseq glue (when to profile, which batches) lives
in :mod:`fairseq_admin_pos.models.admin_transformer`.

What is measured
----------------
Admin (Liu et al. 2020, "Understanding the Difficulty of Training Transformers", EMNLP,
Sec. 4 and Algorithm 1; reference code Transformer-Clinic ``--init-type adaptive-profiling``)
rescales the shortcut of every Post-LN sub-layer, ``x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))``,
and sets ``omega_i`` from the output variances seen in one forward pass at initialisation.

Every residual sub-layer of a stack (encoder: self-attention, FFN per layer; decoder:
self-attention, encoder-attention, FFN per layer) hands its residual module the pair
``(x, f_x)``: the sub-layer input ``x_{i-1}`` (the shortcut: the embedding output for the
first sub-layer, the previous sub-layer's LayerNorm output afterwards) and the branch output
``f_i(x_{i-1})``. A forward pre-hook on each residual module accumulates, per sub-layer and
over all *counted* elements (see padding below) of ``x`` and of ``f_x``,

    n = number of elements,  s = sum of values,  q = sum of squared values

(values converted to float64 whatever the model's dtype - exact for fp16/bf16/fp32 - and
summed in float64, so the statistics never run in half precision). These
sufficient statistics add exactly over batches and over data-parallel ranks (one
``all_reduce(SUM)``), so K batches on W ranks give the same result as one process seeing all
K*W batches. The population variance (``numpy.var``, ddof=0) of the flattened values is
``Var = q/n - (s/n)**2``.

The recurrence (per stack, encoder and decoder separately, sub-layers in execution order)::

    ratio_1   = 1
    omega_i   = ratio_i
    ratio_i+1 = sqrt( omega_i**2 * Var[x_{i-1}] + Var[f_i(x_{i-1})] )

i.e. ``omega_i**2`` is the running sum of the variance of the (rescaled) embedding output and
of the output variances of every earlier branch of that stack, each new term entering through
the variance of the shortcut actually seen (``Var[x*omega] = omega**2 Var[x]`` for a scalar
omega, which is exactly Clinic's ``np.var(residual * omega)``). Because the sub-layer inputs
after the first are LayerNorm outputs (variance 1 at initialisation),
``omega_i**2 ~= Var[embedding output] + sum_{j<i} Var[f_j]`` - the paper's
``omega_i = sqrt(sum_{j<i} Var[f_j(x_{j-1})])`` with the embedding counted as the 0-th branch.
One value per sub-layer: 2 per encoder layer, 3 per decoder layer (2 without encoder
attention); the first omega of each stack is always 1.

Differences from Transformer-Clinic (all deliberate):

* the profiling pass runs with every omega = 1 (the paper's Algorithm 1), in eval mode (no
  dropout) and without gradients, so the statistics of all sub-layers come from one pass and
  add exactly over batches and ranks; Clinic writes each omega into the model as the pass
  reaches it (later sub-layers see the earlier omegas) and profiles in training mode with
  dropout active (which inflates ``Var[f]`` by about ``1/(1-p)``);
* padding positions are excluded by default (a mask of real tokens), because the amount of
  padding depends on how the data is batched (max tokens, length buckets, number of GPUs),
  not on the data, and padded positions never reach the loss; ``include_padding=True``
  reproduces Clinic's ``np.var`` over the whole tensor;
* statistics are float64 even when the model runs in fp16/bf16 (the forward itself runs in
  the model's precision).

Profile files
-------------
:func:`save_profile` writes JSON (format ``fairseq_admin_pos.admin_profile``, version 1) with
the omegas, the measured variances and the settings they came from; :func:`load_profile`
reads that and also Transformer-Clinic's ``profile.ratio.init`` (lines ``index value``:
encoder ``1..2N`` then decoder ``1..3M``, the index restarting at 1 for the decoder).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "ResidualProfiler",
    "variances_from_moments",
    "omegas_from_variances",
    "omegas_from_moments",
    "all_reduce_moments_",
    "all_ranks_agree",
    "count_ranks",
    "measure_omegas",
    "set_omegas",
    "get_omegas",
    "omegas_set_to",
    "eval_mode",
    "save_profile",
    "load_profile",
    "parse_clinic_profile",
    "check_profile_counts",
    "ProfileFileError",
]

PROFILE_FORMAT = "fairseq_admin_pos.admin_profile"
PROFILE_VERSION = 1

# index of the moments tensor, shape (N, 2, 3): [sub-layer, {shortcut, branch}, {n, s, q}]
SHORTCUT, BRANCH = 0, 1
COUNT, SUM, SUMSQ = 0, 1, 2


class ProfileFileError(ValueError):
    """A profile file is unreadable or does not match the model (message names the file)."""


# --------------------------------------------------------------------------------------- #
# statistics
# --------------------------------------------------------------------------------------- #
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


class ResidualProfiler:
    r"""Forward pre-hooks that accumulate the shortcut/branch moments of residual modules.

    Parameters
    ----------
    stacks: ``{stack name: [residual module, ...]}`` in execution order (e.g.
        ``{"encoder": [...2N modules], "decoder": [...3M modules]}``). Each module must be
        called as ``module(x, f_x)`` (or with keywords ``x=``, ``f_x=``), ``x`` and ``f_x``
        of shape ``(*, C)``.
    include_padding: count every element of ``x``/``f_x`` (Transformer-Clinic) instead of
        only the positions selected by the stack's mask.

    Usage: set :attr:`masks` (``{stack name: bool tensor of shape x.shape[:-1], True at real
    tokens}``, or ``None`` for "all positions") before each forward, inside ``with profiler:``.
    :attr:`moments` then holds one float64 tensor of shape ``(N, 2, 3)`` per stack:
    ``[sub-layer, (shortcut x, branch f_x), (n, sum, sum of squares)]``.
    """

    def __init__(self, stacks: Mapping[str, Sequence[nn.Module]], include_padding: bool = False):
        self.stacks = {name: list(mods) for name, mods in stacks.items()}
        for name, mods in self.stacks.items():
            if not mods:
                raise ValueError(f"stack {name!r} has no residual modules to profile")
        self.include_padding = bool(include_padding)
        self.masks: Dict[str, Optional[torch.Tensor]] = {}
        self.moments: Dict[str, Optional[torch.Tensor]] = {n: None for n in self.stacks}
        self._handles: List = []

    def _hook(self, stack: str, index: int):
        def hook(module, args, kwargs):
            x = args[0] if len(args) > 0 else kwargs["x"]
            f_x = args[1] if len(args) > 1 else kwargs["f_x"]
            mask = None if self.include_padding else self.masks.get(stack)
            if mask is not None:
                if tuple(mask.shape) != tuple(x.shape[:-1]) or tuple(f_x.shape) != tuple(x.shape):
                    raise RuntimeError(
                        f"admin profiling: the {stack} mask has shape {tuple(mask.shape)} but "
                        f"sub-layer {index + 1} sees x {tuple(x.shape)} and f_x "
                        f"{tuple(f_x.shape)}; the mask must have shape x.shape[:-1]"
                    )
                mask = mask.to(device=x.device, dtype=torch.bool)
                x, f_x = x[mask], f_x[mask]
            m = torch.stack([_moments(x), _moments(f_x)])
            acc = self.moments[stack]
            if acc is None:
                acc = torch.zeros(len(self.stacks[stack]), 2, 3, dtype=torch.float64, device=m.device)
                self.moments[stack] = acc
            acc[index] += m
            return None

        return hook

    def __enter__(self) -> "ResidualProfiler":
        for name, mods in self.stacks.items():
            for i, mod in enumerate(mods):
                self._handles.append(
                    mod.register_forward_pre_hook(self._hook(name, i), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def stacked_moments(self) -> Dict[str, torch.Tensor]:
        """The moments per stack; a stack never reached raises (nothing was measured)."""
        out = {}
        for name, acc in self.moments.items():
            if acc is None:
                raise RuntimeError(
                    f"admin profiling: no {name} sub-layer was run during profiling "
                    "(the forward did not go through the residual modules)"
                )
            out[name] = acc
        return out


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


def omegas_from_variances(shortcut_vars: Sequence[float], branch_vars: Sequence[float]) -> List[float]:
    """Admin's ratio recurrence (see the module docstring): ``ratio_1 = 1``,
    ``omega_i = ratio_i``, ``ratio_{i+1} = sqrt(omega_i**2 Var[x_{i-1}] + Var[f_i])``."""
    if len(shortcut_vars) != len(branch_vars):
        raise ValueError("shortcut_vars and branch_vars must have the same length")
    ratio, omegas = 1.0, []
    for vx, vf in zip(shortcut_vars, branch_vars):
        omega = ratio
        omegas.append(omega)
        ratio = math.sqrt(omega * omega * float(vx) + float(vf))
    return omegas


def omegas_from_moments(moments: Mapping[str, torch.Tensor]) -> Dict[str, List[float]]:
    """``{stack: [omega_1, ...]}`` from ``{stack: (N, 2, 3) moments}``."""
    return {name: omegas_from_variances(*variances_from_moments(m)) for name, m in moments.items()}


def _dist_ready(group=None) -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size(group) > 1
    )


def _collective_device(group=None) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo and the others take CPU tensors
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_moments_(moments: Dict[str, torch.Tensor], group=None) -> Dict[str, torch.Tensor]:
    """Sum the moments of every stack over the ranks of ``group`` (in place; one collective).

    No-op unless ``torch.distributed`` is initialised with more than one rank. Every rank
    must call it at the same point (they all profile on their first training batch).
    """
    if not _dist_ready(group):
        return moments
    names = sorted(moments)
    flat = torch.cat([moments[n].reshape(-1) for n in names]).to(_collective_device(group))
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
    offset = 0
    for n in names:
        numel = moments[n].numel()
        moments[n].copy_(flat[offset : offset + numel].view_as(moments[n]).to(moments[n].device))
        offset += numel
    return moments


def all_ranks_agree(values: Sequence[float], group=None) -> bool:
    """True when ``values`` (same length everywhere) are bitwise equal on every rank."""
    if not _dist_ready(group):
        return True
    t = torch.tensor(list(values), dtype=torch.float64, device=_collective_device(group))
    hi, lo = t.clone(), -t
    torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX, group=group)
    torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(torch.equal(hi, -lo))


def count_ranks(flag: bool, group=None) -> Tuple[int, int]:
    """``(number of ranks where flag is true, world size)``; ``(int(flag), 1)`` without distributed."""
    if not _dist_ready(group):
        return int(bool(flag)), 1
    t = torch.tensor([float(bool(flag))], dtype=torch.float64, device=_collective_device(group))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return int(t.item()), torch.distributed.get_world_size(group)


# --------------------------------------------------------------------------------------- #
# omegas in the model
# --------------------------------------------------------------------------------------- #
def get_omegas(modules: Sequence[nn.Module]) -> List[float]:
    """First element of each module's ``omega`` (a buffer ``(1,)`` or a vector filled with one value)."""
    return [float(m.omega.detach().reshape(-1)[0].float()) for m in modules]


def set_omegas(modules: Sequence[nn.Module], values: Sequence[float]) -> None:
    """Fill each module's ``omega`` (buffer or parameter) with its value, in place, keeping
    dtype and device (an optimizer holding the parameter keeps the same tensor)."""
    if len(modules) != len(values):
        raise ValueError(f"{len(values)} omegas for {len(modules)} residual modules")
    with torch.no_grad():
        for m, v in zip(modules, values):
            m.omega.fill_(float(v))


@contextmanager
def omegas_set_to(modules: Sequence[nn.Module], value: float = 1.0) -> Iterator[None]:
    """Temporarily set every omega to ``value`` (the profiling pass runs with omega = 1)."""
    saved = [m.omega.detach().clone() for m in modules]
    try:
        with torch.no_grad():
            for m in modules:
                m.omega.fill_(value)
        yield
    finally:
        with torch.no_grad():
            for m, s in zip(modules, saved):
                m.omega.copy_(s)


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module.eval()`` inside, the previous train/eval flag of every submodule restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


def measure_omegas(
    root: nn.Module,
    stacks: Mapping[str, Sequence[nn.Module]],
    batches: Iterable[Tuple[Mapping[str, Optional[torch.Tensor]], Callable[[], object]]],
    include_padding: bool = False,
    group=None,
) -> Tuple[Dict[str, List[float]], Dict[str, torch.Tensor]]:
    """Run the profiling pass and return ``(omegas per stack, moments per stack)``.

    ``batches`` yields ``(masks, run)``: ``masks`` as in :class:`ResidualProfiler`, ``run()``
    performs one forward of ``root`` on that batch. The pass runs in eval mode (no dropout),
    without gradients and with every omega temporarily 1; the model's omegas are *not*
    changed (use :func:`set_omegas`). Moments are summed over the batches and, when
    ``torch.distributed`` is initialised, over the ranks of ``group`` (so every rank returns
    the same omegas).
    """
    all_modules = [m for mods in stacks.values() for m in mods]
    profiler = ResidualProfiler(stacks, include_padding=include_padding)
    with eval_mode(root), torch.no_grad(), omegas_set_to(all_modules, 1.0), profiler:
        count = 0
        for masks, run in batches:
            profiler.masks = dict(masks)
            run()
            count += 1
        if count == 0:
            raise ValueError("admin profiling: no batch to profile")
    moments = {n: m.clone() for n, m in profiler.stacked_moments().items()}
    all_reduce_moments_(moments, group=group)
    return omegas_from_moments(moments), moments


# --------------------------------------------------------------------------------------- #
# profile files
# --------------------------------------------------------------------------------------- #
def save_profile(
    path: str,
    omegas: Mapping[str, Sequence[float]],
    settings: Mapping[str, object],
    moments: Optional[Mapping[str, torch.Tensor]] = None,
) -> None:
    """Write a JSON profile atomically (temporary file in the same folder, then rename), so a
    reader never sees half a file and concurrent writers leave one complete file."""
    data = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "omegas": {k: [float(v) for v in vals] for k, vals in omegas.items()},
        "settings": dict(settings),
    }
    if moments is not None:
        stats = {}
        for name, m in moments.items():
            vx, vf = variances_from_moments(m)
            stats[name] = {
                "shortcut_variance": vx,
                "branch_variance": vf,
                "counted_elements": [float(c) for c in m[:, SHORTCUT, COUNT].tolist()],
            }
        data["variances"] = stats
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def parse_clinic_profile(text: str, path: str = "<text>") -> Dict[str, List[float]]:
    """Transformer-Clinic's ``profile.ratio.init``: lines ``index value``, encoder indices
    ``1..2N`` then decoder indices ``1..3M`` (the index restarts at 1 for the decoder)."""
    segments: List[List[float]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            index_f, value = float(parts[0]), float(parts[1])
        except ValueError:
            raise ProfileFileError(
                f"{path}: line {lineno} is {line.strip()!r}; a Transformer-Clinic profile has "
                "lines 'index value' and a fairseq_admin_pos profile is JSON"
            ) from None
        index = int(index_f)
        if index != index_f or index < 1:
            raise ProfileFileError(f"{path}: line {lineno}: index {parts[0]!r} is not a positive integer")
        if not math.isfinite(value) or value <= 0:
            raise ProfileFileError(f"{path}: line {lineno}: omega {parts[1]!r} is not a positive finite number")
        if index == 1:
            segments.append([])
        elif not segments or index != len(segments[-1]) + 1:
            expected = len(segments[-1]) + 1 if segments else 1
            raise ProfileFileError(
                f"{path}: line {lineno}: index {index} where {expected} was expected (encoder "
                "indices 1..2N then decoder indices 1..3M)"
            )
        segments[-1].append(value)
    if len(segments) != 2:
        raise ProfileFileError(
            f"{path}: found {len(segments)} index run(s) starting at 1; a Transformer-Clinic "
            "profile has two (encoder 1..2N, then decoder 1..3M)"
        )
    return {"encoder": segments[0], "decoder": segments[1]}


def load_profile(path: str) -> Tuple[Dict[str, List[float]], Dict[str, object], str]:
    """Read ``(omegas per stack, settings, kind)``; ``kind`` is ``"json"`` or ``"clinic"``."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileFileError(f"{path}: cannot read the admin profile ({e})") from None
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileFileError(f"{path}: invalid JSON ({e})") from None
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileFileError(
                f"{path}: JSON with format {data.get('format')!r}; expected {PROFILE_FORMAT!r}"
            )
        if data.get("version") != PROFILE_VERSION:
            raise ProfileFileError(
                f"{path}: profile version {data.get('version')!r}; this code reads version {PROFILE_VERSION}"
            )
        omegas = data.get("omegas")
        if not isinstance(omegas, dict) or not all(
            isinstance(v, list) and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in v)
            for v in omegas.values()
        ):
            raise ProfileFileError(f"{path}: 'omegas' must map stack names to lists of positive numbers")
        return {k: [float(x) for x in v] for k, v in omegas.items()}, dict(data.get("settings", {})), "json"
    return parse_clinic_profile(text, path), {}, "clinic"


def check_profile_counts(
    path: str,
    omegas: Mapping[str, Sequence[float]],
    expected: Mapping[str, int],
    layers: Optional[Mapping[str, int]] = None,
) -> None:
    """Raise :class:`ProfileFileError` naming the file and both sets of counts when the
    profile's number of omegas per stack differs from the model's residual sub-layers."""
    got = {k: len(omegas.get(k, [])) for k in expected}
    extra = sorted(set(omegas) - set(expected))
    if got == dict(expected) and not extra:
        return
    have = " and ".join(f"{n} {k}" for k, n in got.items())
    want = " and ".join(
        f"{n} {k}" + (f" ({layers[k]} layers)" if layers and k in layers else "")
        for k, n in expected.items()
    )
    msg = (
        f"{path}: the admin profile has {have} omegas but the model has {want} residual "
        "sub-layers (one omega per sub-layer: 2 per encoder layer, 3 per decoder layer)"
    )
    if extra:
        msg += f"; unknown stacks in the file: {', '.join(extra)}"
    raise ProfileFileError(
        msg + ". Use a profile measured for this architecture, or another "
        "--admin-profile-path to measure a new one."
    )
