"""The errors a user of the package can cause, at the bottom of the house (imports nothing).

Every layer raises them: the pure-torch blocks (a profile file that does not fit,
:mod:`fairseq_admin_pos.profiling`), the fairseq glue (a flag value or combination the
model refuses, :mod:`fairseq_admin_pos.models`) and the tools. The fairseq patch
:mod:`fairseq_admin_pos.fairseq_fixes.flag_errors` turns any of them that ends a fairseq
command-line tool into one ``<prog>: error: <message>`` line with exit status 2, as argparse
does for the flags it checks itself.

Both are ``ValueError`` subclasses, so code that catches ``ValueError`` is unaffected.
"""
from __future__ import annotations

from typing import List

__all__ = ["AdminUserError", "AdminFlagError", "ProfileFileError", "user_error_names"]


class AdminUserError(ValueError):
    """A mistake in what the user gave the package (a flag, a file a flag names).

    The message is one line that names the flag or file and, where there are any, the valid
    choices; it reads after ``<prog>: error: ``."""


class AdminFlagError(AdminUserError):
    """A flag value or combination the plugin refuses while fairseq builds the model."""


class ProfileFileError(AdminUserError):
    """An ``--admin-profile-path`` file that is unreadable or does not match the model (the
    message names the file)."""


def user_error_names() -> List[str]:
    """The qualified names (``module.Class``) of :class:`AdminUserError` and every subclass
    defined so far: how a traceback printed as text (a spawned worker's) names them."""
    names, todo = [], [AdminUserError]
    while todo:
        cls = todo.pop()
        names.append(f"{cls.__module__}.{cls.__qualname__}")
        todo.extend(cls.__subclasses__())
    return names
