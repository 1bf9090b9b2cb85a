"""Export a trained ``admin_transformer`` to a stock fairseq ``transformer`` (and CTranslate2).

* :mod:`~fairseq_admin_pos.export.fold` (pure torch): the derivation and the state-dict
  folding;
* :mod:`~fairseq_admin_pos.export.checkpoint` (fairseq glue): reading the checkpoint,
  the stock configuration, the weights-only-loadable file, the self-check, CTranslate2;
* the command ``fairseq-admin-export`` is :mod:`fairseq_admin_pos.cli.export`.

Importing this package imports neither fairseq nor CTranslate2.
"""
