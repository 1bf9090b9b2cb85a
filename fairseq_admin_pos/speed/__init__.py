"""A faster training step for ``admin_transformer`` models, with the same numbers.

* :mod:`.foreach` (pure torch): fairseq's Adam update and gradient-norm clipping written with
  torch's multi-tensor (``torch._foreach_*``) ops: one call per operation for all parameters
  instead of one Python-level call per parameter, elementwise the same arithmetic;
* :mod:`.trainer` (fairseq glue): puts them under fairseq's ``Trainer`` for the plugin's
  models only (a stock ``transformer`` trained next to it keeps fairseq's own code), and
  hands the per-parameter gradient norms to the training monitor so they are computed once.

Why, and the measurements: ``docs/speed.md``; ``benchmarks/speed_vs_stock.py`` measures it.
"""
