"""The pure-python parts of ``examples/common/recipes.py``: batch arithmetic and visible GPUs
(:mod:`.batching`), run folders (:mod:`.rundir`), downloads (:mod:`.downloads`), text
preparation (:mod:`.text`) and scoring (:mod:`.scoring`).

Like ``recipes.py`` they import neither torch, fairseq nor the plugin; the text tools
(sacremoses, sacrebleu) are imported inside the functions that need them.
"""

from __future__ import annotations

import os


class RecipeError(Exception):
    """An input the recipe cannot work with; the message names the setting and the fix.

    ``main`` prints the message (no traceback) and exits with ``code``.
    """

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code



def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)

