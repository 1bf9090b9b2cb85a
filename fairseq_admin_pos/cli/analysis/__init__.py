"""The parts of ``fairseq-admin-analyze`` (the command line is :mod:`..analyze`):

* :mod:`.variants`: the model families the depth study compares (:data:`~.variants.VARIANTS`);
* :mod:`.measure`: building ``admin_transformer`` models, their input batches, and the
  output change under a random weight perturbation;
* :mod:`.depth`: the depth study (every variant at every depth and seed), its summaries,
  CSVs and table;
* :mod:`.checkpoint`: a trained checkpoint next to the model it started from
  (``--checkpoint``);
* :mod:`.plot`: the depth study's figure (matplotlib).

Imports flow one way: variants and measure at the bottom, the depth study and the checkpoint
above them, the plot above the depth study; none of them imports the command line.
"""
