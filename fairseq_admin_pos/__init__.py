"""fairseq-admin-pos: a fairseq ``--user-dir`` plugin for very deep Transformers.

Importing the package registers everything with fairseq:

* the ``admin_transformer`` model and its architectures (``fairseq_admin_pos.models``);
* the allow-list that lets torch >= 2.6 load fairseq checkpoints with
  ``weights_only=True`` (``fairseq_admin_pos.checkpoint_compat``);
* two narrow fixes to the fairseq we run on: ``--help`` lists the model's flags
  (``cli_help``), and batching no longer drops the last < 8 sentences of a split, which made
  ``fairseq-generate`` score only part of a test set (``batching_fix``).

The pure-torch building blocks import neither fairseq nor this package's glue:
``fairseq_admin_pos.admin`` (Admin residual, seed API of admin-torch) and
``fairseq_admin_pos.positional`` (absolute position modules).
"""
from fairseq_admin_pos.checkpoint_compat import allow_fairseq_checkpoints

allow_fairseq_checkpoints()

__version__ = "0.1.0"

from fairseq_admin_pos import batching_fix, cli_help, models  # noqa: E402,F401  (registers the model)

cli_help.install()
batching_fix.install()
