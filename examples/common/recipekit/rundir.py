"""Run folders: resumed with their own settings, never reused for a different run."""

from __future__ import annotations

import json
import os
from typing import Dict

from . import RecipeError, atomic_write_text

RUN_CONFIG = "recipe.json"


def check_run_config(run_dir: str, settings: Dict[str, str]) -> str:
    """Record ``settings`` in ``run_dir/recipe.json`` on the first start; on a resume,
    refuse settings that differ from the recorded ones. Returns ``"new"`` or ``"resume"``.

    The settings are the ones that define the run (task, scheme, architecture, optimiser
    settings, effective batch, data); the GPU count, max-tokens and update-freq may change
    between resumes as long as the effective batch stays the same.
    """
    path = os.path.join(run_dir, RUN_CONFIG)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            recorded = json.load(handle)
        diffs = [
            f"{key}: recorded {recorded.get(key)!r}, now {settings.get(key)!r}"
            for key in sorted(set(recorded) | set(settings))
            if recorded.get(key) != settings.get(key)
        ]
        if diffs:
            raise RecipeError(
                f"run folder {run_dir} holds a run with other settings ("
                + "; ".join(diffs)
                + "). A run folder is only resumed with its own settings: choose another "
                "RUN_DIR or SEED for a new run (or edit recipe.json if only a path moved)."
            )
        return "resume"
    os.makedirs(run_dir, exist_ok=True)
    atomic_write_text(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return "new"


