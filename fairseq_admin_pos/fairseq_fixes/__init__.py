"""Narrow fixes to the fairseq we run on (installed by :func:`fairseq_admin_pos.register`).

* :mod:`.checkpoint_compat`: torch >= 2.6 loads fairseq checkpoints with ``weights_only=True``;
* :mod:`.cli_help`: ``fairseq-train --help`` lists the model's flags;
* :mod:`.batching_fix`: batching no longer drops the last sentences of a split;
* :mod:`.flag_errors`: a bad model flag is one ``<prog>: error:`` line (exit status 2), not a
  traceback, found before fairseq makes the save directory;
* :mod:`.patches`: the table of every fairseq function the package replaces (these fixes, the
  speed hooks, the training monitor, the profiling trigger), read by the fixes above.
"""
