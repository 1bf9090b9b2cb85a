"""fairseq glue: importing this registers ``admin_transformer`` and its architectures."""
from fairseq_admin_pos.models import admin_transformer  # noqa: F401
