"""What one training step asks of the host and the device, from ``torch.profiler``.

* ``aten_ops``: top-level aten operations (those not called by another aten op): each is a
  trip through the dispatcher, i.e. host time, and on a GPU at least one kernel launch;
* ``host_reads``: ``aten::_local_scalar_dense`` calls (``.item()``, ``bool(t)``,
  ``float(t)``): on a GPU each waits for every queued kernel;
* on CUDA also ``launches`` (runtime calls that launch a kernel: ``cudaLaunchKernel*``,
  ``cuLaunchKernel*``, ``cudaGraphLaunch``), ``kernels`` (kernels that ran on the device)
  and ``syncs`` (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``: the host waiting for the device);
* peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the measured steps
  (parameters, gradients and optimizer state included); on the CPU the highest point of
  the step's own allocations above what was allocated before it, from the profiler's
  memory records (activations, gradients, temporaries; the CPU has no allocator statistics;
  an allocation freed inside the same op is not seen).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch.profiler import ProfilerActivity, profile

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name == "cudaGraphLaunch"


def count_step(step: Callable[[], None], cuda: bool) -> Dict[str, int]:
    """Run ``step`` once under the profiler and count (module docstring)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:  # flushes the device's records on exit
        step()
    counts = {"aten_ops": 0, "host_reads": 0}
    if cuda:
        counts.update(launches=0, kernels=0, syncs=0)
    for e in prof.events():
        name = e.name
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            counts["kernels"] += 1
            continue
        if name.startswith("aten::"):
            if name == "aten::_local_scalar_dense":
                counts["host_reads"] += 1
            parent, top = e.cpu_parent, True
            while parent is not None:
                if parent.name.startswith("aten::"):
                    top = False
                    break
                parent = parent.cpu_parent
            counts["aten_ops"] += top
        elif cuda and _is_launch(name):
            counts["launches"] += 1
        elif cuda and name in _SYNC_CALLS:
            counts["syncs"] += 1
    return counts


def peak_memory(step: Callable[[], None], cuda: bool, steps: int = 2) -> int:
    """Peak bytes of ``steps`` calls of ``step`` (module docstring)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    # each op's own allocations net of its own frees (children excluded), at its start; frees
    # outside any op are the "[memory]" records
    records = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                     if e.self_cpu_memory_usage)
    level = peak = 0
    for _, delta in records:
        level += delta
        peak = max(peak, level)
    return int(peak)
