"""fairseq-admin-pos: a fairseq ``--user-dir`` plugin for very deep Transformers.

Layout:

* at the bottom, importing nothing: :mod:`~fairseq_admin_pos.errors` (the errors a user
  can cause, printed by fairseq's tools as one ``<prog>: error:`` line);
* pure torch, no fairseq: :mod:`~fairseq_admin_pos.admin` (Admin residual, admin-torch's
  API), :mod:`~fairseq_admin_pos.positional` (absolute position modules, the seed's API),
  :mod:`~fairseq_admin_pos.profiling` (Admin's profiling; its statistics and recurrence in
  :mod:`~fairseq_admin_pos.profile_stats`, its files in :mod:`~fairseq_admin_pos.profile_files`),
  :mod:`~fairseq_admin_pos.schemes` (DeepNorm, ReZero), :mod:`~fairseq_admin_pos.norms`
  (DyT) and :mod:`~fairseq_admin_pos.placements` (Post-/Pre-/Peri-/Mix-LN);
* fairseq glue: :mod:`~fairseq_admin_pos.models` (the ``admin_transformer`` model, its
  layers, positions and profiling trigger) and :mod:`~fairseq_admin_pos.optim` (``radam``);
* :mod:`~fairseq_admin_pos.fairseq_fixes`: narrow fixes to the fairseq we run on
  (torch >= 2.6 checkpoint loading, ``--help`` with the model's flags, batching that no
  longer drops the last sentences of a split, a bad model flag as one ``error:`` line); they
  sit below the models, which :func:`register` hands them. Every fairseq function the
  package replaces is listed in :mod:`~fairseq_admin_pos.fairseq_fixes.patches`;
* :mod:`~fairseq_admin_pos.speed`: the training step's multi-tensor Adam and clipping for
  the plugin's models (same numbers, fewer operations; ``docs/speed.md``);
* :mod:`~fairseq_admin_pos.cli`: ``fairseq-admin-analyze``,
  ``fairseq-admin-average-checkpoints`` and ``make demo``.

Importing this package does not import fairseq, so the pure blocks work where fairseq is
not installed and import in milliseconds. The fairseq side is registered by
:func:`register`: at once when fairseq is already imported (``--user-dir
fairseq_admin_pos``, hub loading with ``user_dir``, or ``import fairseq`` first), otherwise
the moment fairseq's own import finishes. Either way ``import fairseq_admin_pos`` is all a
Python user needs before using fairseq's registries.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"
__all__ = ["register", "__version__"]

_registered = False


def register() -> None:
    """Register the model, architectures and optimizer with fairseq and install the fixes
    (idempotent). Imports fairseq."""
    global _registered
    if _registered:
        return
    from fairseq_admin_pos.fairseq_fixes import (batching_fix, checkpoint_compat,
                                                 cli_help, flag_errors)

    checkpoint_compat.allow_fairseq_checkpoints()
    from fairseq_admin_pos import models, optim  # noqa: F401  (their imports register)
    from fairseq_admin_pos.models.admin_transformer import AdminTransformerModel, prepare_args
    from fairseq_admin_pos.speed import trainer as speed_trainer

    # the fixes and the speed hooks sit below the models: they are handed the model class
    # (and its flag checks) here instead of importing it
    speed_trainer.install(model_types=(AdminTransformerModel,))
    cli_help.install()
    batching_fix.install()
    flag_errors.install(preflight_checks={AdminTransformerModel: prepare_args})
    # only now: a registration that failed half way is retried by the next call
    _registered = True


class _RegisterAfterFairseq(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after the top-level ``fairseq`` package has executed.

    It only wraps the loader of that one module (found by the other finders) and then takes
    itself off ``sys.meta_path``; every other import is untouched."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "fairseq":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                register()
            except Exception as e:  # noqa: BLE001  (fairseq itself imported fine)
                # a failure here must not make `import fairseq` fail (Python would drop the
                # half-registered fairseq from sys.modules); register() raises it again
                warnings.warn(
                    f"fairseq_admin_pos: registering with fairseq failed ({type(e).__name__}: "
                    f"{e}); fairseq_admin_pos.register() retries and raises the error",
                    RuntimeWarning, stacklevel=2,
                )

        spec.loader.exec_module = exec_then_register
        return spec


if "fairseq" in sys.modules:
    register()
elif not any(isinstance(f, _RegisterAfterFairseq) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterFairseq())
