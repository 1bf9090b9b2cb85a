"""The parts of ``make gpu-check`` (the command line is :mod:`..gpu_check`):

* :mod:`.environment`: what the check needs of this Python and the checkout, the one line
  that names what is missing, and the environment the report records;
* :mod:`.processes`: the child processes (own process groups, time limits, stopped on
  Ctrl-C), their environment and the ``fairseq-*`` shims for the recipes;
* :mod:`.steps`: what runs: the data, the CUDA tests, the recipe smoke runs and the speed
  benchmark, each returning its step's record;
* :mod:`.report`: ``report.md`` and ``report.json`` from the steps' records.

Imports flow one way (environment, processes, steps, report, then the command line), and
only the standard library is imported at module level: a Python without torch or fairseq
still gets the one-line refusal.
"""
