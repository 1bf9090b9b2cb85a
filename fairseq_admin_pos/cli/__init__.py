"""Command-line tools: ``fairseq-admin-analyze`` (:mod:`.analyze`),
``fairseq-admin-average-checkpoints`` (:mod:`.average_checkpoints`) and ``make demo``
(:mod:`.demo`)."""
