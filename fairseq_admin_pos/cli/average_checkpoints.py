"""Average the weights of several fairseq checkpoints (``fairseq-admin-average-checkpoints``).

The papers evaluate the average of the last 10 epoch checkpoints (Liu et al. 2020;
Transformer-Clinic's ``eval_*.sh``). fairseq's ``scripts/average_checkpoints.py`` is not part
of the installed wheel, so this package brings its own command::

    fairseq-admin-average-checkpoints --inputs runs/wmt14_en_de/admin_6l_6l_1 \\
        --num-epoch-checkpoints 10 --output runs/wmt14_en_de/admin_6l_6l_1/averaged_last10.pt

(or ``python -m fairseq_admin_pos.cli.average_checkpoints``). Semantics:

* every floating-point tensor of ``state["model"]`` becomes
  ``sum_k(w_k.double()) / K`` cast back to the dtype it has in the newest checkpoint
  (float64 accumulation, so averaging fp16/fp32 weights loses nothing to summation order);
* entries that are not floating-point tensors (integer buffers, the ``admin_transformer``
  model's ``_extra_state`` dict holding its omega/position settings) are taken from the
  newest checkpoint; non-tensor entries must be equal in all checkpoints (different
  values mean different models, which are refused);
* all checkpoints must have the same keys and shapes, otherwise the command stops with an
  error naming the file and the offending keys;
* the other top-level entries (``cfg``, ``extra_state``, ``optimizer_history``) come from
  the newest checkpoint; ``last_optimizer_state`` is dropped (Adam moments of one
  checkpoint do not belong to averaged weights, and they would triple the file size), and
  ``averaged_checkpoints`` lists the inputs;
* tensors that share storage in the newest checkpoint (tied embeddings with
  ``--share-all-embeddings``) share it in the output too;
* the output is written to a temporary file in the same folder and renamed, so a reader
  never sees a half-written file and a failed run leaves an older output untouched.

"Newest" is the highest epoch/update number when checkpoints are selected from a folder,
and the last file given when ``--inputs`` lists files.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

import torch

from fairseq_admin_pos.fairseq_fixes.checkpoint_compat import allow_fairseq_checkpoints

_EPOCH = re.compile(r"^checkpoint(\d+)\.pt$")
_UPDATE = re.compile(r"^checkpoint_\d+_(\d+)\.pt$")


class AverageError(Exception):
    """Inputs that cannot be averaged; the message names the file, key or flag."""


def select_checkpoints(
    inputs: Sequence[str],
    num_epoch_checkpoints: Optional[int] = None,
    num_update_checkpoints: Optional[int] = None,
    upper_bound: Optional[int] = None,
) -> List[str]:
    """The checkpoint files to average, oldest first.

    With ``num_epoch_checkpoints`` (``checkpointN.pt``) or ``num_update_checkpoints``
    (``checkpoint_E_U.pt``), ``inputs`` is one folder and the last N by number (at most
    ``upper_bound``) are taken; otherwise ``inputs`` are the files themselves.
    """
    if num_epoch_checkpoints is not None and num_update_checkpoints is not None:
        raise AverageError("give --num-epoch-checkpoints or --num-update-checkpoints, not both")
    count = num_epoch_checkpoints if num_epoch_checkpoints is not None else num_update_checkpoints
    if count is None:
        if upper_bound is not None:
            raise AverageError(
                "--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints"
            )
        if not inputs:
            raise AverageError("--inputs: no checkpoint given")
        for path in inputs:
            if os.path.isdir(path):
                raise AverageError(
                    f"--inputs {path} is a folder: add --num-epoch-checkpoints N or "
                    "--num-update-checkpoints N to choose checkpoints from it"
                )
            if not os.path.isfile(path):
                raise AverageError(f"--inputs: {path} does not exist")
        return list(inputs)
    flag = "--num-epoch-checkpoints" if num_epoch_checkpoints is not None else "--num-update-checkpoints"
    if count < 1:
        raise AverageError(f"{flag} must be >= 1, got {count}")
    if len(inputs) != 1 or not os.path.isdir(inputs[0]):
        raise AverageError(f"{flag} needs --inputs to be exactly one folder, got {list(inputs)}")
    folder = inputs[0]
    pattern = _EPOCH if num_epoch_checkpoints is not None else _UPDATE
    numbered = []
    for name in os.listdir(folder):
        match = pattern.match(name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            numbered.append((int(match.group(1)), os.path.join(folder, name)))
    numbered.sort()
    if len(numbered) < count:
        bound = f" with number <= {upper_bound}" if upper_bound is not None else ""
        raise AverageError(
            f"{flag} {count}: {folder} holds only {len(numbered)} matching checkpoint(s)"
            f"{bound} ({', '.join(os.path.basename(p) for _, p in numbered) or 'none'})"
        )
    return [path for _, path in numbered[-count:]]


def _load(path: str) -> dict:
    allow_fairseq_checkpoints()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for corrupt / unsafe files
        raise AverageError(f"cannot load {path}: {error}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise AverageError(f"{path} is not a fairseq checkpoint (no 'model' state dict)")
    return state


def _is_float(value) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


def _storage_key(tensor: torch.Tensor):
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def average_checkpoints(paths: Sequence[str]) -> dict:
    """Average ``paths`` (oldest first, newest last) as described in the module docstring;
    returns the checkpoint dict to save."""
    if not paths:
        raise AverageError("no checkpoint to average")
    newest_path = paths[-1]
    newest = _load(newest_path)
    reference = newest["model"]
    sums: Dict[str, torch.Tensor] = {
        key: value.to(torch.float64, copy=True) for key, value in reference.items() if _is_float(value)
    }
    for path in paths[:-1]:
        model = _load(path)["model"]
        missing = sorted(set(reference) - set(model))
        extra = sorted(set(model) - set(reference))
        if missing or extra:
            raise AverageError(
                f"{path} and {newest_path} have different keys (missing in {path}: "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; only in {path}: "
                f"{extra[:5]}{' ...' if len(extra) > 5 else ''}): checkpoints of different models"
            )
        for key, ref_value in reference.items():
            value = model[key]
            if torch.is_tensor(ref_value) != torch.is_tensor(value):
                raise AverageError(f"{key}: a tensor in one checkpoint, not in the other ({path})")
            if torch.is_tensor(ref_value):
                if value.shape != ref_value.shape:
                    raise AverageError(
                        f"{key}: shape {tuple(value.shape)} in {path} but "
                        f"{tuple(ref_value.shape)} in {newest_path}"
                    )
                if key in sums:
                    if not value.is_floating_point():
                        raise AverageError(f"{key}: floating point in {newest_path}, not in {path}")
                    sums[key] += value.to(torch.float64)
            elif value != ref_value:
                raise AverageError(
                    f"{key} differs between {path} ({value!r}) and {newest_path} "
                    f"({ref_value!r}): checkpoints of different model settings"
                )
        del model
    count = float(len(paths))
    averaged: Dict[str, object] = {}
    shared: Dict[tuple, torch.Tensor] = {}
    for key, ref_value in reference.items():
        if key not in sums:
            averaged[key] = ref_value
            continue
        storage = _storage_key(ref_value)
        if storage in shared:
            averaged[key] = shared[storage]
            continue
        value = (sums[key] / count).to(ref_value.dtype)
        shared[storage] = value
        averaged[key] = value
    state = {k: v for k, v in newest.items() if k not in ("model", "last_optimizer_state")}
    state["model"] = type(reference)(averaged)
    state["averaged_checkpoints"] = [os.path.basename(p) for p in paths]
    return state


def save_atomic(state: dict, output: str) -> None:
    """``torch.save`` to a temporary file next to ``output``, fsync, then rename."""
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(output)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairseq-admin-average-checkpoints",
        description="Average the weights of fairseq checkpoints (float64 accumulation, "
        "atomic write). See the module docstring of fairseq_admin_pos.cli.average_checkpoints.",
    )
    parser.add_argument("--inputs", nargs="+", required=True,
                        help="checkpoint files (oldest first), or one folder with "
                        "--num-epoch-checkpoints / --num-update-checkpoints")
    parser.add_argument("--output", required=True, help="file to write the averaged checkpoint to")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int,
                       help="average the last N checkpointE.pt files of the folder")
    group.add_argument("--num-update-checkpoints", type=int,
                       help="average the last N checkpoint_E_U.pt files of the folder")
    parser.add_argument("--checkpoint-upper-bound", type=int,
                        help="only consider checkpoints whose epoch (or update) number is <= this")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        paths = select_checkpoints(args.inputs, args.num_epoch_checkpoints,
                                   args.num_update_checkpoints, args.checkpoint_upper_bound)
        state = average_checkpoints(paths)
        save_atomic(state, args.output)
    except AverageError as error:
        print(f"fairseq-admin-average-checkpoints: error: {error}", file=sys.stderr)
        return 2
    print(f"averaged {len(paths)} checkpoint(s): "
          f"{', '.join(os.path.basename(p) for p in paths)} -> {args.output}")
    return 0


def cli_main() -> None:
    """Console entry point ``fairseq-admin-average-checkpoints``."""
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
