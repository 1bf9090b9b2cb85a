"""A bad model flag is one ``<prog>: error: <message>`` line and exit status 2, as argparse.

fairseq's command line checks what argparse can check (a value outside ``choices``, a
``type`` that does not convert) and prints ``fairseq-train: error: ...``. Everything the
plugin checks later, while fairseq builds the model (a negative ``--encoder-layers``,
``--admin-residual deepnorm`` with ``--admin-init closed-form``, ``--admin-profile-*``
without ``--admin-init profile``, a checkpoint whose omegas/positions differ from the flags
on ``--restore-file``, a hydra ``model.*`` setting of the wrong type, ...), used to end as a
``ValueError`` that Python printed under a traceback, with exit status 1, after fairseq had
already made the ``--save-dir``.

What this module changes (installed by :func:`fairseq_admin_pos.register`):

* :class:`~fairseq_admin_pos.errors.AdminFlagError`, a ``ValueError`` (code that catches
  ``ValueError`` is unaffected), is what those checks raise; its message names the flag(s)
  and the valid choices and is one line. The same holds for every
  :class:`~fairseq_admin_pos.errors.AdminUserError`, e.g. an ``--admin-profile-path`` file
  that cannot be read or does not fit the model (``ProfileFileError``);
* ``fairseq.distributed.utils.call_main`` (the function ``fairseq-train``,
  ``fairseq-interactive``, ``fairseq-validate`` and ``fairseq-eval-lm`` run their ``main``
  through) first checks an ``admin_transformer`` model's flags on a copy of the
  configuration (:func:`preflight`), before ``main`` makes the save directory, loads data
  or spawns one process per GPU. The exception goes on unchanged (in-process callers still
  get the ``ValueError``), except from a worker of ``torch.multiprocessing.spawn``, which
  hands the parent only its traceback as text (``ProcessRaisedException``): the error is
  raised again from that text;
* ``fairseq.checkpoint_utils.verify_checkpoint_directory`` records the save directory it
  creates; after a flag error found once it exists (a checkpoint's settings, known when the
  checkpoint is loaded; any flag error under ``fairseq-hydra-train``, which imports the
  plugin only inside ``main``) the directory is removed again if nothing was written to it;
* ``sys.excepthook``: when a fairseq command-line tool (``fairseq-*``, ``python -m
  fairseq_cli.*``) ends with an uncaught ``AdminUserError`` (also when fairseq wrapped
  it: ``Trainer.load_checkpoint`` re-raises any loading error as a bare ``Exception``), the
  hook prints ``<prog>: error: <message>`` and raises ``SystemExit(2)``; Python then exits
  with status 2, running ``atexit`` handlers as usual. Every other exception, and any
  exception outside fairseq's tools (a user's script, a notebook), keeps its traceback;
* hydra's ``run_and_report`` (around ``fairseq-hydra-train``'s task function) prints any
  escaping exception as a shortened traceback with exit status 1, unless its
  ``is_under_debugger()`` holds; that predicate is made to hold for a flag error of a
  fairseq tool, so that the error reaches the hook above. With several GPUs under hydra the
  plugin is imported only in the worker processes and the parent still prints hydra's
  traceback of the worker's error.

None of these errors happens inside ``Trainer.train_step``, so fairseq's crash handler
(which writes ``crash.pt``) never sees them.
"""
from __future__ import annotations

import copy
import functools
import os
import re
import sys
from typing import Callable, Dict, Optional

from fairseq_admin_pos.errors import AdminFlagError, AdminUserError, user_error_names
from fairseq_admin_pos.fairseq_fixes import patches

__all__ = ["AdminFlagError", "AdminUserError", "find_flag_error", "prog_name", "preflight",
           "install"]

#: argparse's exit status for a usage error
EXIT_STATUS = 2


def prog_name() -> Optional[str]:
    """The fairseq command-line tool this process runs (``fairseq-train`` for both the
    console script and ``python -m fairseq_cli.train``), or None outside fairseq's tools."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if not name.startswith("fairseq_cli.") and \
            os.path.basename(os.path.dirname(argv0)) == "fairseq_cli":
        # ``python -m fairseq_cli.X`` once runpy has put the original __main__ back
        name = "fairseq_cli." + os.path.splitext(os.path.basename(argv0))[0]
    if name.startswith("fairseq_cli."):
        return "fairseq-" + name.split(".", 1)[1].replace("_", "-")
    prog = os.path.basename(argv0)
    # console scripts (fairseq-train, ...) and wrappers such as the recipes' fairseq_train_bf16.py
    return prog if prog.startswith("fairseq") else None


def find_flag_error(exc: Optional[BaseException]) -> Optional[AdminUserError]:
    """The :class:`~fairseq_admin_pos.errors.AdminUserError` (a flag error, a profile-file
    error) behind ``exc``: ``exc`` itself, one it was raised from or while handling
    (fairseq's ``Trainer.load_checkpoint`` turns any loading error into a bare
    ``Exception``), or the one a ``torch.multiprocessing.spawn`` worker reported as
    traceback text; None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, AdminUserError):
            return exc
        text = _spawned_worker_traceback(exc)
        if text is not None:
            names = "|".join(re.escape(n) for n in user_error_names())
            found = re.findall(rf"^(?:{names}): (.+)$", text, re.MULTILINE)
            if found:
                return AdminFlagError(found[0])
        exc = exc.__cause__ or exc.__context__
    return None


def _spawned_worker_traceback(exc: BaseException) -> Optional[str]:
    mp = sys.modules.get("torch.multiprocessing.spawn")
    cls = getattr(mp, "ProcessRaisedException", None)
    if cls is not None and isinstance(exc, cls):
        return str(getattr(exc, "msg", exc))
    return None


def report(err: AdminUserError, prog: Optional[str] = None) -> None:
    """Print ``<prog>: error: <message>`` on stderr and exit with status 2, after removing
    the save directory fairseq made for this run if it is still empty."""
    remove_created_save_dirs()
    sys.stdout.flush()
    print(f"{prog or prog_name() or 'fairseq'}: error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_STATUS)


def _excepthook(previous, exc_type, exc, tb):
    err = find_flag_error(exc)
    prog = prog_name()
    if err is None or prog is None:
        return previous(exc_type, exc, tb)
    report(err, prog)


# -- before fairseq's main --------------------------------------------------------------


def _model_class(model_cfg):
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    name = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    if not isinstance(name, str):
        return None
    return ARCH_MODEL_REGISTRY.get(name) or MODEL_REGISTRY.get(name)


#: model class -> the function that checks its flags (what its ``build_model`` runs first),
#: given by :func:`install`: the models sit above this patch and are handed to it, not imported
_PREFLIGHT_CHECKS: Dict[type, Callable] = {}


def preflight(cfg) -> None:
    """Run the checks the model's ``build_model`` runs (those :func:`install` was given for
    its class), on a copy of the model configuration, so that a bad flag is reported before
    fairseq does anything else. Nothing happens for other models or when the tool builds no
    model from flags (``cfg.model`` is None for tools that load a checkpoint)."""
    model_cfg = getattr(cfg, "model", None)
    if model_cfg is None:
        return
    cls = _model_class(model_cfg)
    check = next((fn for base, fn in _PREFLIGHT_CHECKS.items()
                  if cls is not None and issubclass(cls, base)), None)
    if check is None:
        return
    from omegaconf import OmegaConf

    # a DictConfig (hydra) is converted into a new namespace; a Namespace is copied
    check(model_cfg if OmegaConf.is_config(model_cfg) else copy.deepcopy(model_cfg))


def _outermost_new(path: str) -> Optional[str]:
    """The outermost folder of ``path`` that does not exist yet (what ``os.makedirs(path)``
    creates), or None when ``path`` exists."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return None
    while True:
        parent = os.path.dirname(path)
        if parent == path or os.path.exists(parent):
            return path
        path = parent


#: save directories fairseq created in this process (removed again after a flag error when
#: nothing was written into them)
_CREATED_SAVE_DIRS = []


def _wrap_verify_checkpoint_directory(verify):
    @functools.wraps(verify)
    def wrapper(save_dir):
        created = _outermost_new(save_dir)
        verify(save_dir)
        if created is not None:
            _CREATED_SAVE_DIRS.append(created)

    return wrapper


def remove_created_save_dirs() -> None:
    """Remove the save directories this process created, as long as they hold no file."""
    while _CREATED_SAVE_DIRS:
        folder = _CREATED_SAVE_DIRS.pop()
        if not os.path.isdir(folder) or any(files for _, _, files in os.walk(folder)):
            continue
        for root, _, _ in os.walk(folder, topdown=False):
            os.rmdir(root)


def _wrap_call_main(call_main):
    @functools.wraps(call_main)
    def wrapper(cfg, main, **kwargs):
        try:
            preflight(cfg)
            return call_main(cfg, main, **kwargs)
        except Exception as e:
            err = find_flag_error(e)
            if err is None:
                raise
            remove_created_save_dirs()
            if err is not e and _spawned_worker_traceback(e) is not None:
                raise err from None
            raise

    return wrapper


def _wrap_hydra_predicate(is_under_debugger):
    # hydra's run_and_report prints an exception escaping the task function itself (a
    # shortened traceback, exit status 1) unless HYDRA_FULL_ERROR is set or this predicate
    # holds, in which case it re-raises it: let a flag error of a fairseq tool through to
    # sys.excepthook that way
    @functools.wraps(is_under_debugger)
    def wrapper():
        if prog_name() is not None and find_flag_error(sys.exc_info()[1]) is not None:
            return True
        return is_under_debugger()

    return wrapper


def install(preflight_checks: Optional[Dict[type, Callable]] = None) -> None:
    """Wrap ``fairseq.distributed.utils.call_main`` and
    ``fairseq.checkpoint_utils.verify_checkpoint_directory``, chain ``sys.excepthook`` and,
    when hydra is loaded, let a flag error through its ``run_and_report`` (all once; listed
    in :mod:`.patches`, which imports fairseq only now).

    ``preflight_checks`` maps a model class to the function that checks its flags on an
    args namespace (raising :class:`AdminFlagError`); :func:`preflight` runs it for that
    class and its subclasses."""
    _PREFLIGHT_CHECKS.update(preflight_checks or {})
    patches.wrap("fairseq.distributed.utils.call_main", _wrap_call_main)
    patches.wrap("fairseq.checkpoint_utils.verify_checkpoint_directory",
                 _wrap_verify_checkpoint_directory)
    patches.wrap("sys.excepthook", lambda previous: functools.partial(_excepthook, previous))
    # hydra's internals: left alone when missing (tests/test_fairseq_patches.py names them)
    if getattr(sys.modules.get("hydra._internal.utils"), "is_under_debugger", None) is not None:
        patches.wrap("hydra._internal.utils.is_under_debugger", _wrap_hydra_predicate)
