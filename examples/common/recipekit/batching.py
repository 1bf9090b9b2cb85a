"""Effective batch -> ``--update-freq``, and the number of visible GPUs."""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from typing import List, Mapping, Optional

from . import RecipeError

@dataclass(frozen=True)
class BatchPlan:
    """One way of reaching a recipe's effective batch (tokens per optimizer update).

    ``effective_batch == num_gpus * max_tokens * update_freq`` holds exactly. fairseq's
    ``--max-tokens`` is an upper bound on the padded tokens of one GPU's batch, so the
    papers' batch sizes (e.g. 4 GPUs x 8192 tokens for WMT14 En-De) are nominal in the same
    way; keeping the product fixed keeps the optimisation the same when the GPU count changes.
    """

    num_gpus: int
    max_tokens: int
    update_freq: int

    @property
    def effective_batch(self) -> int:
        return self.num_gpus * self.max_tokens * self.update_freq


def _positive_int(value, name: str) -> int:
    try:
        number = int(str(value).strip())
    except (TypeError, ValueError):
        raise RecipeError(f"{name} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise RecipeError(f"{name} must be a positive integer, got {number}")
    return number


def suggest_max_tokens(effective_batch: int, num_gpus: int, cap: int) -> Optional[BatchPlan]:
    """The largest ``max_tokens <= cap`` with an integer update-freq, or None when
    ``effective_batch`` is not divisible by ``num_gpus`` (no max-tokens can fix that)."""
    if effective_batch % num_gpus:
        return None
    per_gpu = effective_batch // num_gpus
    # smallest update-freq first: it gives the largest per-GPU batch that fits under the cap
    for update_freq in range(max(1, math.ceil(per_gpu / cap)), per_gpu + 1):
        if per_gpu % update_freq == 0:
            return BatchPlan(num_gpus, per_gpu // update_freq, update_freq)
    return None  # pragma: no cover  (update_freq == per_gpu always divides)


def suggest_gpu_counts(effective_batch: int, max_tokens: int, limit: int = 256) -> List[int]:
    """GPU counts (<= limit) that reach ``effective_batch`` exactly with ``max_tokens``."""
    return [g for g in range(1, limit + 1) if effective_batch % (g * max_tokens) == 0]


def plan_update_freq(effective_batch, num_gpus, max_tokens) -> BatchPlan:
    """``--update-freq`` so that ``num_gpus * max_tokens * update_freq == effective_batch``.

    Refuses (``RecipeError``) a combination that cannot reach the batch exactly: a
    non-integer update-freq, or one below 1 (more tokens per step than the recipe's batch).
    The message names ``EFFECTIVE_BATCH`` / ``NUM_GPUS`` / ``MAX_TOKENS`` (the recipe's
    settings) and suggests a ``MAX_TOKENS`` for these GPUs and GPU counts for this MAX_TOKENS.
    """
    effective_batch = _positive_int(effective_batch, "EFFECTIVE_BATCH")
    num_gpus = _positive_int(num_gpus, "NUM_GPUS")
    max_tokens = _positive_int(max_tokens, "MAX_TOKENS")
    per_step = num_gpus * max_tokens
    if effective_batch % per_step == 0:
        return BatchPlan(num_gpus, max_tokens, effective_batch // per_step)
    ratio = effective_batch / per_step
    lines = [
        f"cannot reach the recipe's effective batch of {effective_batch} tokens per update "
        f"with NUM_GPUS={num_gpus} x MAX_TOKENS={max_tokens} (= {per_step} tokens per step): "
        f"--update-freq would be {ratio:.4g}, which is not a positive integer."
    ]
    fix = suggest_max_tokens(effective_batch, num_gpus, max_tokens)
    if fix is not None:
        lines.append(
            f"  use MAX_TOKENS={fix.max_tokens} (--update-freq {fix.update_freq}) on "
            f"{num_gpus} GPU(s)"
        )
    else:
        lines.append(f"  no MAX_TOKENS works: {effective_batch} is not divisible by {num_gpus} GPUs")
    gpus = suggest_gpu_counts(effective_batch, max_tokens, limit=max(64, 2 * num_gpus))
    if gpus:
        lines.append(
            f"  or run on NUM_GPUS in {{{', '.join(map(str, gpus))}}} with MAX_TOKENS={max_tokens}"
        )
    lines.append("  (EFFECTIVE_BATCH=... changes the recipe itself; the result is then not the "
                 "published setting)")
    raise RecipeError("\n".join(lines))


def count_cuda_visible_devices(value: str) -> int:
    """Devices CUDA exposes for a ``CUDA_VISIBLE_DEVICES`` value.

    CUDA reads the comma-separated list up to the first invalid entry, so ``""`` and
    ``"-1"`` mean no GPU and ``"0,-1,1"`` means one. Entries may be indices or UUIDs
    (``GPU-...``, ``MIG-...``).
    """
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            break
        if re.fullmatch(r"-?\d+", entry):
            if int(entry) < 0:
                break
        elif not re.match(r"(GPU|MIG)-", entry):
            break
        count += 1
    return count


def count_nvidia_smi_gpus(listing: str) -> int:
    """GPUs in ``nvidia-smi -L`` output (one ``GPU i: ...`` line each; MIG lines indented)."""
    return sum(1 for line in listing.splitlines() if re.match(r"GPU \d+:", line))


def count_visible_gpus(env: Mapping[str, str], nvidia_smi_listing: Optional[str]) -> int:
    """Visible GPUs: ``CUDA_VISIBLE_DEVICES`` when set (bounded by what nvidia-smi sees,
    as CUDA skips indices that do not exist), else ``nvidia-smi -L``, else 0."""
    smi = count_nvidia_smi_gpus(nvidia_smi_listing) if nvidia_smi_listing is not None else None
    if "CUDA_VISIBLE_DEVICES" in env:
        visible = count_cuda_visible_devices(env["CUDA_VISIBLE_DEVICES"])
        return visible if smi is None else min(visible, smi)
    return smi or 0


def _nvidia_smi_listing() -> Optional[str]:
    try:
        result = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


