"""fairseq glue: optimizers. Importing this registers ``--optimizer radam``."""
from fairseq_admin_pos.optim import radam  # noqa: F401
