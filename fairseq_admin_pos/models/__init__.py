"""fairseq glue: importing this registers ``admin_transformer`` and its architectures, and
installs the training monitor (per-stack omegas and gradient norms in fairseq's logs)."""
from fairseq_admin_pos.models import admin_transformer  # noqa: F401
from fairseq_admin_pos.models import architectures  # noqa: F401
from fairseq_admin_pos.models import monitoring  # noqa: F401
from fairseq_admin_pos.models import admin_profile  # noqa: E402

# --admin-init profile runs before fairseq's first Trainer.train_step, outside its crash
# handler, and reaches the optimizer's master copy and the epoch iterator from there
admin_profile.install_trainer_hooks()
