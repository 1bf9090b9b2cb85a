r"""Admin's profiling initialisation: statistics, ratio recurrence, profile files (pure torch).

This module never imports fairseq; the fairseq glue (when to profile, which batches, the
optimizer's master copy) lives in :mod:`fairseq_admin_pos.models.admin_profile`.

What is measured
----------------
Admin (Liu et al. 2020, "Understanding the Difficulty of Training Transformers", EMNLP,
Sec. 4 and Algorithm 1; reference code Transformer-Clinic ``--init-type adaptive-profiling``,
``fairseq/modules/transformer_layer.py``) rescales the shortcut of every Post-LN sub-layer,
``x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))``, and sets ``omega_i`` from the output
variances seen in one forward pass at initialisation.

Every residual sub-layer of a stack (encoder: self-attention, FFN per layer; decoder:
self-attention, encoder-attention, FFN per layer) hands its residual module the pair
``(x, f_x)``: the sub-layer input ``x_{i-1}`` (the shortcut: the embedding output for the
first sub-layer, the previous sub-layer's LayerNorm output afterwards) and the dropped-out
branch output ``f_i(x_{i-1})``. A forward pre-hook on each residual module takes, over the
*counted* elements of ``x`` and of ``f_x`` (see padding below),

    n = number of elements,  s = sum of values,  q = sum of squared values

(values converted to float64 whatever the model's dtype - exact for fp16/bf16/fp32 - and
summed in float64). The population variance (``numpy.var``, ddof=0) of the flattened values
is ``Var = q/n - (s/n)**2``; these sufficient statistics add exactly over batches and over
data-parallel ranks (``all_reduce(SUM)``).

The recurrence (per stack, encoder and decoder separately, sub-layers in execution order)::

    ratio_1   = 1
    omega_i   = ratio_i
    ratio_i+1 = sqrt( omega_i**2 * Var[x_{i-1}] + Var[f_i(x_{i-1})] )

``omega_i**2 Var[x]`` is Clinic's ``np.var(residual * omega)`` (scalar omega). Because the
sub-layer inputs after the first are LayerNorm outputs (variance 1 at initialisation),
``omega_i**2 ~= Var[embedding output] + sum_{j<i} Var[f_j]`` - the paper's
``omega_i = sqrt(sum_{j<i} Var[f_j(x_{j-1})])`` with the embedding counted as the 0-th branch.
One value per sub-layer: 2 per encoder layer, 3 per decoder layer (2 without encoder
attention); the first omega of each stack is always 1.

Two modes (``--admin-profile-mode``)
------------------------------------
``clinic`` (the default) is Transformer-Clinic's profiling, statistic for statistic:

* the pass is a *training-mode* forward: dropout is on, so ``f`` is the dropped-out branch
  output and ``Var[f]`` carries the dropout factor ``~1/(1-p)``;
* the variance is over the whole flattened tensor, padding included (Clinic's ``np.var``);
* each omega is written into the model as the pass reaches it, so later sub-layers (and the
  decoder, through the encoder output) see the earlier omegas; the recurrence above is
  evaluated inside the pass (:class:`InPassProfiler`);
* one batch: with data parallelism the moments of each sub-layer are summed over the ranks
  inside its hook (same sub-layer order on every rank), so every rank writes the same omega
  at the same point of the pass. Several batches per rank would need several passes that
  each change the omegas, so ``K > 1`` batches is refused in this mode.

It is the default because ``--admin-init profile`` is documented as the paper's Admin, and
Clinic's code is what the paper's numbers were produced with: a Clinic ``profile.ratio.init``
and a profile measured here in this mode are the same statistic.

``eval`` is a deterministic, batching-independent variant:

* the pass runs with every omega = 1 (the paper's Algorithm 1), in eval mode (no dropout)
  and without gradients, so all sub-layers' statistics come from one pass that does not
  depend on random dropout masks, and the statistics of K batches and W ranks add exactly
  (K*W batches in one process give the same omegas);
* padding positions are excluded by default (a mask of real tokens), because the amount of
  padding depends on how the data is batched (max tokens, length buckets, number of GPUs),
  not on the data, and padded positions never reach the loss;
  ``include_padding=True`` counts them as Clinic does.

Its omegas are smaller than Clinic's, roughly by the dropout factor (no dropout) and by the
share of padding; a Clinic ``profile.ratio.init`` is therefore accepted only in clinic mode.

In both modes the statistics are float64 even when the model runs in fp16/bf16 (the
forward itself runs in the model's precision); Clinic's numpy sums float32 values in
float32, a relative difference of order 1e-7.

Profile files
-------------
:func:`save_profile` writes JSON (format ``fairseq_admin_pos.admin_profile``, version 2)
with the omegas, the measured variances and the settings they came from, the mode among
them; :func:`load_profile` reads that (version 1 files, written before the modes existed,
were measured in eval mode and are read as such) and Transformer-Clinic's
``profile.ratio.init`` (lines ``index value``: encoder ``1..2N`` then decoder ``1..3M``, the
index restarting at 1 for the decoder). :func:`compare_settings` turns a file measured with
other settings into an error that lists every difference.
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

from fairseq_admin_pos.errors import ProfileFileError

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "PROFILE_MODES",
    "ResidualProfiler",
    "InPassProfiler",
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
    "train_mode",
    "save_profile",
    "load_profile",
    "parse_clinic_profile",
    "check_profile_counts",
    "compare_settings",
    "ProfileFileError",
]

PROFILE_FORMAT = "fairseq_admin_pos.admin_profile"
PROFILE_VERSION = 2
#: the versions :func:`load_profile` reads (1: before the modes; measured in eval mode)
READABLE_VERSIONS = (1, 2)
#: ``--admin-profile-mode`` choices, the default first (see the module docstring)
PROFILE_MODES = ("clinic", "eval")

# index of the moments tensor, shape (N, 2, 3): [sub-layer, {shortcut, branch}, {n, s, q}]
SHORTCUT, BRANCH = 0, 1
COUNT, SUM, SUMSQ = 0, 1, 2


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


class InPassProfiler:
    r"""Transformer-Clinic's in-pass profiling: each omega is set as the pass reaches it.

    Parameters
    ----------
    stacks: ``{stack name: [residual module, ...]}`` in execution order, as for
        :class:`ResidualProfiler`; each module has an ``omega`` (buffer or parameter).
    group: a ``torch.distributed`` process group (or None for the default one); when
        distributed is initialised with more than one rank, the moments of each sub-layer
        are summed over the ranks inside its hook (one ``all_reduce`` of 6 numbers per
        sub-layer), so every rank computes and writes the same omega.

    The pre-hook of sub-layer ``i`` of a stack, called with ``(x, f_x)`` of shape ``(*, C)``:
    takes the moments of *every* element of ``x`` and ``f_x`` (padding included, as
    Clinic's ``np.var`` over the flattened tensor), writes ``omega_i = ratio_i`` into the
    module (the module's forward then computes ``x * omega_i + f_x`` with it), and advances
    ``ratio_{i+1} = sqrt(omega_i**2 Var[x] + Var[f_x])``. After one pass :attr:`omegas` holds
    ``{stack: [omega_1, ...]}`` and :attr:`moments` the ``(N, 2, 3)`` float64 moments (of
    ``x``, not ``x * omega``), from which :func:`omegas_from_moments` gives the same omegas.
    A sub-layer reached twice (a second pass) raises: one pass, one set of omegas.
    """

    def __init__(self, stacks: Mapping[str, Sequence[nn.Module]], group=None):
        self.stacks = {name: list(mods) for name, mods in stacks.items()}
        for name, mods in self.stacks.items():
            if not mods:
                raise ValueError(f"stack {name!r} has no residual modules to profile")
        self.group = group
        self.omegas: Dict[str, List[float]] = {n: [] for n in self.stacks}
        self.moments: Dict[str, Optional[torch.Tensor]] = {n: None for n in self.stacks}
        self._ratio = {n: 1.0 for n in self.stacks}
        self._handles: List = []

    def _hook(self, stack: str, index: int):
        def hook(module, args, kwargs):
            x = args[0] if len(args) > 0 else kwargs["x"]
            f_x = args[1] if len(args) > 1 else kwargs["f_x"]
            if index != len(self.omegas[stack]):
                raise RuntimeError(
                    f"admin profiling (clinic mode): {stack} sub-layer {index + 1} reached "
                    f"after {len(self.omegas[stack])} sub-layers; the in-pass profile needs "
                    "exactly one forward pass through the sub-layers in order"
                )
            m = torch.stack([_moments(x), _moments(f_x)])
            if _dist_ready(self.group):
                flat = m.reshape(-1).to(_collective_device(self.group))
                torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM,
                                             group=self.group)
                m = flat.view_as(m).to(m.device)
            vx, vf = variances_from_moments(m.unsqueeze(0))
            omega = self._ratio[stack]
            with torch.no_grad():
                module.omega.fill_(omega)
            self._ratio[stack] = next_ratio(omega, vx[0], vf[0])
            self.omegas[stack].append(omega)
            acc = self.moments[stack]
            if acc is None:
                acc = torch.zeros(len(self.stacks[stack]), 2, 3, dtype=torch.float64, device=m.device)
                self.moments[stack] = acc
            acc[index] = m
            return None

        return hook

    def __enter__(self) -> "InPassProfiler":
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

    def result(self) -> Tuple[Dict[str, List[float]], Dict[str, torch.Tensor]]:
        """``(omegas, moments)`` per stack; a stack not run through completely raises."""
        for name, mods in self.stacks.items():
            if len(self.omegas[name]) != len(mods):
                raise RuntimeError(
                    f"admin profiling (clinic mode): the pass reached {len(self.omegas[name])} "
                    f"of the {len(mods)} {name} sub-layers"
                )
        return {n: list(v) for n, v in self.omegas.items()}, dict(self.moments)


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


@contextmanager
def train_mode(module: nn.Module) -> Iterator[None]:
    """``module.train()`` inside (dropout on), every submodule's flag restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


def measure_omegas(
    root: nn.Module,
    stacks: Mapping[str, Sequence[nn.Module]],
    batches: Iterable[Tuple[Mapping[str, Optional[torch.Tensor]], Callable[[], object]]],
    include_padding: Optional[bool] = None,
    group=None,
    mode: str = "eval",
) -> Tuple[Dict[str, List[float]], Dict[str, torch.Tensor]]:
    """Run the profiling pass and return ``(omegas per stack, moments per stack)``.

    ``batches`` yields ``(masks, run)``: ``masks`` as in :class:`ResidualProfiler`, ``run()``
    performs one forward of ``root`` on that batch; it is consumed lazily (one batch alive at
    a time). Either way the pass runs without gradients, starts from every omega = 1, and
    leaves the model's omegas as they were (use :func:`set_omegas` to apply the result).

    ``mode="eval"``: eval mode (no dropout), omegas fixed at 1 during the pass, padding
    excluded unless ``include_padding`` (default False; ``masks`` select the counted
    positions); moments
    summed over the batches and, when ``torch.distributed`` is initialised, over the ranks
    of ``group`` (so every rank returns the same omegas).

    ``mode="clinic"``: Transformer-Clinic's pass, :class:`InPassProfiler` in training mode
    (dropout on, from the current RNG state), padding included (``masks`` are not used;
    ``include_padding=False`` is an error), exactly one batch; the ranks' moments are
    summed inside each sub-layer's hook.
    """
    if mode not in PROFILE_MODES:
        raise ValueError(f"admin profiling: mode {mode!r}; valid modes: {', '.join(PROFILE_MODES)}")
    if mode == "clinic" and include_padding is False:
        raise ValueError(
            "admin profiling: the clinic mode counts padding (Clinic's np.var over the whole "
            "tensor); excluding it is the eval mode's option"
        )
    all_modules = [m for mods in stacks.values() for m in mods]
    if mode == "clinic":
        profiler = InPassProfiler(stacks, group=group)
        with train_mode(root), torch.no_grad(), omegas_set_to(all_modules, 1.0), profiler:
            count = 0
            for _masks, run in batches:
                if count == 1:
                    raise ValueError(
                        "admin profiling (clinic mode): more than one batch; the in-pass "
                        "omegas come from exactly one forward pass (use mode 'eval' for "
                        "statistics over several batches)"
                    )
                run()
                count += 1
            if count == 0:
                raise ValueError("admin profiling: no batch to profile")
            omegas, moments = profiler.result()
        return omegas, moments
    profiler = ResidualProfiler(stacks, include_padding=bool(include_padding))
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


def _check_omega_values(path: str, omegas: object) -> Dict[str, List[float]]:
    """``{stack: [positive finite floats]}`` or a :class:`ProfileFileError` naming the entry."""
    if not isinstance(omegas, dict) or not omegas:
        raise ProfileFileError(
            f"{path}: 'omegas' must map stack names (encoder, decoder) to lists of omegas; "
            f"got {type(omegas).__name__}"
        )
    out = {}
    for stack, values in omegas.items():
        if not isinstance(values, list):
            raise ProfileFileError(f"{path}: omegas[{stack!r}] must be a list of numbers")
        for i, v in enumerate(values):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or not math.isfinite(v) or v <= 0:
                raise ProfileFileError(
                    f"{path}: {stack} omega {i + 1} is {v!r}; every omega must be a positive "
                    "finite number (a profile with NaN, infinite, zero or negative omegas "
                    "comes from a diverged or broken measurement: measure it again)"
                )
        out[stack] = [float(v) for v in values]
    return out


def load_profile(path: str) -> Tuple[Dict[str, List[float]], Dict[str, object], str]:
    """Read ``(omegas per stack, settings, kind)``; ``kind`` is ``"json"`` or ``"clinic"``.

    Every omega is checked (positive and finite). The settings of a version-1 JSON file
    (written before the profiling modes existed) are completed with what that code did:
    ``admin_profile_mode = "eval"`` and ``admin_profile_include_padding`` from its
    ``include_padding``. A Clinic file has no settings (``{}``).
    """
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
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise ProfileFileError(
                f"{path}: profile version {version!r}; this code reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        omegas = _check_omega_values(path, data.get("omegas"))
        settings = data.get("settings", {})
        if not isinstance(settings, dict):
            raise ProfileFileError(f"{path}: 'settings' must be an object")
        settings = dict(settings)
        if version == 1:  # the code of version 1 profiled in eval mode only
            settings.setdefault("admin_profile_mode", "eval")
            if "include_padding" in settings:
                settings.setdefault("admin_profile_include_padding",
                                    bool(settings.pop("include_padding")))
        return omegas, settings, "json"
    return parse_clinic_profile(text, path), {}, "clinic"


def compare_settings(
    path: str,
    file_settings: Mapping[str, object],
    model_settings: Mapping[str, object],
    keys: Sequence[str],
) -> None:
    """Raise :class:`ProfileFileError` listing every key of ``keys`` whose value in the
    profile file differs from the model's (``--flag: file X, flags Y``; keys are argument
    names, so the flag is ``--`` + the key with dashes). A key the file does not record
    (an older file) is not compared."""
    diffs = [
        f"--{k.replace('_', '-')}: file {file_settings[k]!r}, flags {model_settings.get(k)!r}"
        for k in keys
        if k in file_settings and file_settings[k] != model_settings.get(k)
    ]
    if diffs:
        raise ProfileFileError(
            f"{path}: the admin profile was measured with other settings than the flags "
            "given (" + "; ".join(diffs) + "). Use a profile measured with these settings, "
            "or another --admin-profile-path to measure a new one."
        )


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
