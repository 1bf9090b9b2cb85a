"""What ``make gpu-check`` needs and finds: the repository checkout it runs from, the modules
this Python must import, :func:`probe_environment` (versions, import errors, CUDA devices),
:func:`environment_error` (the one line that names everything missing) and
:func:`environment_summary` (what the report records). Standard library only at import."""
from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

#: the repository checkout this package runs from (fairseq_admin_pos/cli/gpucheck/ -> root)
REPO = Path(__file__).resolve().parents[3]
PROG = "gpu-check"

#: what the repository checkout must hold
REPO_FILES = ("tests/conftest.py", "examples/wmt14_en_de/train.sh",
              "benchmarks/speed_vs_stock.py")
REQUIRED_MODULES = ("fairseq", "sacrebleu", "pytest")


def probe_environment() -> dict:
    """What this Python has: module versions or import errors, torch's CUDA build and
    devices, the repository files, bash."""
    info: Dict[str, object] = {
        "python": sys.executable, "python_version": platform.python_version(),
        "modules": {}, "import_errors": {}, "bash": shutil.which("bash"),
        "repo": str(REPO), "repo_missing": [f for f in REPO_FILES if not (REPO / f).exists()],
    }
    for name in ("torch",) + REQUIRED_MODULES:
        try:
            module = importlib.import_module(name)
            info["modules"][name] = str(getattr(module, "__version__", "?"))
        except Exception as e:  # noqa: BLE001  (any import failure means: not usable)
            info["modules"][name] = None
            info["import_errors"][name] = f"{type(e).__name__}: {e}"
    if info["modules"]["torch"] is not None:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = bool(torch.version.cuda) and torch.cuda.is_available()
        info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        if info["device_count"]:
            info["cudnn"] = torch.backends.cudnn.version()
            info["gpus"] = [_gpu(torch, i) for i in range(info["device_count"])]
    return info


def _gpu(torch, index: int) -> dict:
    p = torch.cuda.get_device_properties(index)
    return {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}"}


def environment_error(info: dict) -> Optional[str]:
    """The one line naming everything that stops the check, or None."""
    problems: List[str] = []
    modules, errors = info["modules"], info["import_errors"]
    torch_version = modules.get("torch")
    if torch_version is None:
        problems.append(f"torch is missing ({errors.get('torch')})")
    elif not info.get("torch_cuda"):
        problems.append(f"torch {torch_version} is a CPU-only build, so there is no GPU to "
                        "check (a CUDA build of torch is needed)")
    for name in REQUIRED_MODULES:
        if modules.get(name) is None:
            problems.append(f"{name} is missing ({errors.get(name)})")
    if not info.get("bash"):
        problems.append("bash is not on PATH (the recipes are bash scripts)")
    if info["repo_missing"]:
        problems.append(f"{', '.join(info['repo_missing'])} missing under {info['repo']} (run "
                        "gpu-check from a checkout of the repository)")
    if torch_version is not None and info.get("torch_cuda") and not info.get("device_count"):
        visible = info.get("cuda_visible_devices")
        problems.append(
            f"torch {torch_version} (CUDA {info['torch_cuda']}) sees no CUDA GPU "
            f"(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES="
            f"{'unset' if visible is None else repr(visible)})")
    if not problems:
        return None
    return (f"{PROG}: error: {info['python']}: " + "; ".join(problems) + ". gpu-check installs "
            "nothing: run it with a Python that has a CUDA build of torch, fairseq, sacrebleu "
            "and pytest, on a machine with a GPU")


def environment_summary(info: dict) -> dict:
    """The report's environment: Python, torch/CUDA/cuDNN, the GPUs, the module versions,
    this package's version and commit, the host's CPUs."""
    summary = {k: info.get(k) for k in ("python", "python_version", "torch_cuda", "cudnn",
                                          "gpus", "cuda_visible_devices")}
    summary.update({name: info["modules"].get(name) for name in ("torch",) + REQUIRED_MODULES})
    from fairseq_admin_pos import __version__

    summary["package"] = __version__
    try:
        summary["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        summary["commit"] = None
    summary["host_cpus"] = os.cpu_count()
    return summary
