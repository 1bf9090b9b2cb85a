"""Every fairseq function the package replaces, in one table (:data:`PATCHES`).

A fairseq upgrade that moves or renames one of them would otherwise go unnoticed: the plugin
would wrap nothing, or wrap a function nobody calls any more. ``tests/test_fairseq_patches.py``
checks each entry against the installed fairseq (the target exists; after the plugin is
imported through ``--user-dir`` it is the plugin's replacement, wrapping fairseq's own) and
that the plugin replaces nothing that is not listed here. ``docs/fairseq-fixes.md`` lists
them for a reader.

Two kinds of entries:

* ``when="register"``: replaced once, when the plugin registers with fairseq
  (:func:`fairseq_admin_pos.register`): a module attribute, or a method of a fairseq class;
* ``when="trainer"``: replaced on one optimizer object, when fairseq's ``Trainer`` builds
  the optimizer of an ``admin_transformer`` (an instance attribute that shadows the class's
  method or property named here; other models keep fairseq's).

The fixes of this folder replace their targets through :func:`wrap`, which reads this table
and fails with one line naming the module and attribute when the installed fairseq lacks
one. This module imports nothing from fairseq until :func:`wrap` or :func:`resolve` is called.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

#: set on each replacement made by :func:`wrap`: the target it replaced (makes wrap idempotent)
MARKER = "__admin_patch__"

DOCS = "docs/fairseq-fixes.md#what-the-plugin-replaces-in-fairseq"


@dataclass(frozen=True)
class Patch:
    """One replaced fairseq function: ``attribute`` of ``module`` (``Class.method`` for a
    method), why, and the function of the package that replaces it."""

    module: str
    attribute: str
    why: str
    patched_by: str
    when: str = "register"

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


_FIXES = "fairseq_admin_pos.fairseq_fixes"

PATCHES: Tuple[Patch, ...] = (
    Patch("fairseq.options", "parse_args_and_arch",
          "--help lists the model's flags (fairseq prints help before adding them)",
          f"{_FIXES}.cli_help.install"),
    Patch("fairseq.data.data_utils", "batch_by_size",
          "batching keeps the last sentences of a split that the compiled batcher drops",
          f"{_FIXES}.batching_fix.install"),
    Patch("fairseq.distributed.utils", "call_main",
          "a bad model flag is checked before main and reported as one error line",
          f"{_FIXES}.flag_errors.install"),
    Patch("fairseq.checkpoint_utils", "verify_checkpoint_directory",
          "the save directory made for a run stopped by a flag error is removed while empty",
          f"{_FIXES}.flag_errors.install"),
    Patch("sys", "excepthook",
          "a fairseq tool ending on a flag error prints '<prog>: error: ...', exit status 2",
          f"{_FIXES}.flag_errors.install"),
    Patch("hydra._internal.utils", "is_under_debugger",
          "fairseq-hydra-train lets a flag error reach the hook above instead of a traceback",
          f"{_FIXES}.flag_errors.install"),
    Patch("fairseq.trainer", "Trainer._build_optimizer",
          "the plugin's models train with multi-tensor Adam, clipping and FP16 copies",
          "fairseq_admin_pos.speed.trainer.install"),
    Patch("fairseq.trainer", "Trainer.clip_grad_norm",
          "the training monitor's per-stack gradient norms",
          "fairseq_admin_pos.models.monitoring.install"),
    Patch("fairseq.trainer", "Trainer.set_num_updates",
          "the training monitor logs per update (omegas, norms, token cosine, collapse)",
          "fairseq_admin_pos.models.monitoring.install"),
    Patch("fairseq.trainer", "Trainer.train_step",
          "--admin-init profile profiles on the first batch, before the first step",
          "fairseq_admin_pos.models.admin_profile.install_trainer_hooks"),
    Patch("fairseq.trainer", "Trainer.get_train_iterator",
          "--admin-profile-batches K > 1 reads the next batches of the epoch iterator",
          "fairseq_admin_pos.models.admin_profile.install_trainer_hooks"),
    Patch("fairseq.checkpoint_utils", "load_model_ensemble_and_task",
          "a model loaded from a trained checkpoint does not read its profile file",
          "fairseq_admin_pos.models.admin_profile.install_trainer_hooks"),
    Patch("fairseq.optim.fairseq_optimizer", "FairseqOptimizer.optimizer",
          "the torch Adam behind it (the instance's _optimizer) becomes ForeachAdam",
          "fairseq_admin_pos.speed.trainer.accelerate", when="trainer"),
    Patch("fairseq.optim.fairseq_optimizer", "FairseqOptimizer.clip_grad_norm",
          "one multi-tensor norm over the gradients, the norms kept for the monitor",
          "fairseq_admin_pos.speed.trainer.accelerate", when="trainer"),
    Patch("fairseq.optim.fp16_optimizer", "FP16Optimizer._sync_fp16_grads_to_fp32",
          "--fp16/--bf16: multi-tensor copy of the gradients into the float32 master copy",
          "fairseq_admin_pos.speed.fp16.accelerate", when="trainer"),
    Patch("fairseq.optim.fp16_optimizer", "FP16Optimizer._sync_fp32_params_to_fp16",
          "--fp16/--bf16: multi-tensor copy of the master weights back into the model",
          "fairseq_admin_pos.speed.fp16.accelerate", when="trainer"),
)

BY_TARGET: Dict[str, Patch] = {p.target: p for p in PATCHES}


class PatchTargetMissing(AttributeError):
    """The installed fairseq (or hydra) lacks a function the plugin replaces."""


def _installed_versions() -> str:
    found = []
    for name in ("fairseq", "hydra"):
        try:
            found.append(f"{name} {importlib.import_module(name).__version__}")
        except (ImportError, AttributeError):
            found.append(f"no {name} version found")
    return ", ".join(found)


def missing_message(patch: Patch, reason: str) -> str:
    """The one line that says which target is gone, why the plugin needs it, and where."""
    return (f"fairseq_admin_pos replaces {patch.target} ({patch.why}; in {patch.patched_by}), "
            f"but {reason} ({_installed_versions()}); see {DOCS}")


def resolve(patch: Patch) -> Tuple[object, str]:
    """``(owner, name)``: the module or class holding the target, and the attribute name.
    Raises :class:`PatchTargetMissing` (:func:`missing_message`) when it does not exist."""
    try:
        owner = importlib.import_module(patch.module)
    except ImportError as e:
        raise PatchTargetMissing(missing_message(
            patch, f"module {patch.module} cannot be imported ({e})")) from None
    *path, name = patch.attribute.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise PatchTargetMissing(missing_message(
                patch, f"module {patch.module} has no {part}"))
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        where = patch.module if not path else f"{patch.module}.{'.'.join(path)}"
        raise PatchTargetMissing(missing_message(patch, f"{where} has no attribute {name}"))
    return owner, name


def wrap(target: str, make_replacement: Callable[[Callable], Callable]) -> None:
    """Replace the :data:`PATCHES` entry ``target`` by ``make_replacement(current)``, once:
    a target already replaced (it carries :data:`MARKER`) is left alone."""
    owner, name = resolve(BY_TARGET[target])
    current = getattr(owner, name)
    if getattr(current, MARKER, None) == target:
        return
    replacement = make_replacement(current)
    setattr(replacement, MARKER, target)
    setattr(owner, name, replacement)
