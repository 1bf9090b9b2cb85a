"""Let torch >= 2.6 load fairseq checkpoints with ``weights_only=True``.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True`` and refuses any global it
does not know. fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` calls ``torch.load``
without the argument, so ``fairseq-generate`` and ``fairseq-train --restore-file`` fail with
``WeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace``.

Rather than turning the safety off (``weights_only=False`` or
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``), we allow-list exactly the non-tensor types that
fairseq's own checkpoints contain, found with
``torch.serialization.get_unsafe_globals_in_checkpoint`` on checkpoints written by
``fairseq-train`` (plain, with validation, with ``--eval-bleu`` meters):

* ``argparse.Namespace``: ``state["args"]`` of legacy-argparse models and ``cfg.model``;
* numpy arrays (``ndarray``, ``dtype``, the ``_reconstruct`` function, and the concrete
  numeric ``numpy.dtypes.*DType`` classes): the ``--eval-bleu`` meters keep n-gram counts
  as numpy arrays in ``extra_state["metrics"]``;
* numpy scalars (``multiarray.scalar``): meters may hold numpy scalars the same way.

Everything else (arbitrary classes, functions, ``eval``) still fails to load.
"""
from __future__ import annotations

import argparse
from typing import List

import numpy as np
import torch

__all__ = ["fairseq_safe_globals", "allow_fairseq_checkpoints"]

_NUMERIC_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)


def _numpy_core():
    # numpy >= 2 keeps the implementation in numpy._core; numpy 1.x in numpy.core.
    core = getattr(np, "_core", None)
    return core if core is not None else np.core


def fairseq_safe_globals() -> List[object]:
    """The allow-list: globals a fairseq checkpoint may reference (see module docstring).

    Entries are objects or ``(object, "qualified.name")`` pairs; the pairs register the
    ``numpy.core`` spelling used by checkpoints written with numpy 1.x.
    """
    multiarray = _numpy_core().multiarray
    entries: List[object] = [
        argparse.Namespace,
        np.ndarray,
        np.dtype,
        multiarray._reconstruct,
        (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        multiarray.scalar,
        (multiarray.scalar, "numpy.core.multiarray.scalar"),
    ]
    entries += [type(np.dtype(name)) for name in _NUMERIC_DTYPES]
    return entries


def allow_fairseq_checkpoints() -> None:
    """Register :func:`fairseq_safe_globals` with ``torch.serialization`` (idempotent)."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4 has no weights-only allow-list, and loads fine anyway
        return
    add(fairseq_safe_globals())
