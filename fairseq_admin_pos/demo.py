"""``python -m fairseq_admin_pos.demo``: the demo under the short name the docs use.

The tool itself is :mod:`fairseq_admin_pos.cli.demo` (``make demo``); see its ``--help``.
"""
from .cli.demo import main

if __name__ == "__main__":
    main()
