"""The parts of ``benchmarks/depth_study.py`` (its entry point): ``plan`` (what runs), ``data``
(the corpus), ``runner`` (training and decoding), ``logs`` (reading fairseq's log), ``report``
(CSV, table, publishing) and ``plot`` (the figure)."""
