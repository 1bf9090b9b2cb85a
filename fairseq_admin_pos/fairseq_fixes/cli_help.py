"""Make ``fairseq-train --user-dir fairseq_admin_pos --arch admin_transformer --help`` show
the model's flags.

fairseq parses the command line twice: first with only the generic options, to learn
``--arch``/``--task``, then again after adding the model's and task's own options. ``--help``
fires during the first parse, so no model flag (stock or plugin) is ever listed. When, and
only when, ``-h``/``--help`` is on the command line, we run fairseq's own parsing without it
(which builds the complete parser) and print that parser's help. Any other command line goes
to fairseq untouched.
"""
from __future__ import annotations

import functools
import sys

from fairseq_admin_pos.fairseq_fixes import patches

HELP_FLAGS = ("-h", "--help")


def _full_help(parse_args_and_arch):
    @functools.wraps(parse_args_and_arch)
    def wrapper(parser, input_args=None, parse_known=False, suppress_defaults=False,
                modify_parser=None):
        argv = sys.argv[1:] if input_args is None else list(input_args)
        if not any(a in HELP_FLAGS for a in argv):
            return parse_args_and_arch(parser, input_args, parse_known, suppress_defaults,
                                       modify_parser)
        stripped = [a for a in argv if a not in HELP_FLAGS]
        try:
            # parse_known: help must not fail on a missing positional such as DATA
            parse_args_and_arch(parser, stripped, True, False, modify_parser)
        except SystemExit:
            pass  # e.g. DATA missing: the help below still lists what was registered
        parser.print_help()
        parser.exit()

    return wrapper


def install() -> None:
    """Wrap ``fairseq.options.parse_args_and_arch`` once (idempotent; listed in
    :mod:`.patches`). fairseq is imported only now, not when this module is: the package
    registers itself when fairseq's import finishes (see fairseq_admin_pos.register)."""
    patches.wrap("fairseq.options.parse_args_and_arch", _full_help)
