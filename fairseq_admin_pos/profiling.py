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

Profile files (:mod:`fairseq_admin_pos.profile_files`, names re-exported here)
-------------------------------------------------------------------------------
:func:`save_profile` writes JSON (format ``fairseq_admin_pos.admin_profile``, version 2)
with the omegas, the measured variances and the settings they came from, the mode among
them; :func:`load_profile` reads that (version 1 files, written before the modes existed,
were measured in eval mode and are read as such) and Transformer-Clinic's
``profile.ratio.init`` (lines ``index value``: encoder ``1..2N`` then decoder ``1..3M``, the
index restarting at 1 for the decoder). :func:`compare_settings` turns a file measured with
other settings into an error that lists every difference.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from fairseq_admin_pos.errors import ProfileFileError  # noqa: F401  (re-exported)
# the statistics and the recurrence, and the profile files, are modules of their own; their
# names stay importable from here, where they always were
from fairseq_admin_pos.profile_stats import (BRANCH, COUNT, SHORTCUT, SUM,  # noqa: F401
                                             SUMSQ, _moments, next_ratio,
                                             omegas_from_moments, omegas_from_variances,
                                             variances_from_moments)
from fairseq_admin_pos.profile_files import (PROFILE_FORMAT, PROFILE_VERSION,  # noqa: F401
                                             READABLE_VERSIONS, check_profile_counts,
                                             compare_settings, load_profile,
                                             parse_clinic_profile, save_profile)

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

#: ``--admin-profile-mode`` choices, the default first (see the module docstring)
PROFILE_MODES = ("clinic", "eval")

# --------------------------------------------------------------------------------------- #
# statistics
# --------------------------------------------------------------------------------------- #
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
