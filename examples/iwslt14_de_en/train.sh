#!/usr/bin/env bash
# IWSLT14 De-En: train Admin, the paper's Admin, Post-LN or Pre-LN with Transformer-Clinic's
# recipe.
#
#   examples/iwslt14_de_en/train.sh SCHEME [DEPTH] [SEED]
#     SCHEME  admin | admin-paper | post-ln | pre-ln | post-ln-paper | pre-ln-paper
#             (default admin)
#     DEPTH   6l_6l (transformer_iwslt_de_en: 512/1024, 4 heads)       (default 6l_6l)
#     SEED    default 1111 (Transformer-Clinic ran 1111 2222 3333 4444 5555)
#
# Schemes (flags from fairseq_admin_pos/scheme_flags.py, the table make demo reads too):
# admin is the recommended Admin (closed form, omega a trainable vector) with Adam; post-ln
# and pre-ln with Adam too, so the three differ in the residual alone; admin-paper is the
# paper's Admin (--admin-init profile --admin-profile-mode clinic --admin-omega parameter)
# with RAdam as Clinic (--optimizer radam --radam-early-steps skip), as do post-ln-paper and
# pre-ln-paper, the paper's baselines as Clinic trained them. All take the recipe below,
# whose schedule is the paper's. How the two Admins compared in this package's CPU-scale
# depth study: README.md of this folder.
#
# Published recipe (Liu et al. 2020; Transformer-Clinic nmt-experiments/iwslt14_de-en.md):
# 1 GPU x 4096 tokens x update-freq 1, lr 7e-4, inverse_sqrt with 6000 warmup updates from
# 1e-7, betas (0.9, 0.98), no clipping, dropout 0.3, attention / activation dropout 0.1,
# weight decay 1e-4, label smoothing 0.1, shared embeddings, 100k updates,
# --fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125.
# Clinic keeps every epoch and averages the last 10 up to epoch 90 (about where 100k updates
# end); the recipe keeps the last 20 (KEEP_LAST_EPOCHS) so that eval.sh finds them.
#
# Environment (see examples/README.md): NUM_GPUS, MAX_TOKENS (update-freq is derived),
# EFFECTIVE_BATCH, PRECISION (fp16|bf16|fp32), DEVICE (gpu|cpu), ARCH, DATA_DIR / DATA_BIN,
# RUNS_DIR / RUN_DIR, KEEP_LAST_EPOCHS, LOG_INTERVAL, EXTRA_ARGS (appended last, so they
# win; split like shell words), DRY_RUN=1 (print the command only).
# The run goes to $RUNS_DIR/iwslt14_de_en/<scheme>_<depth>_<seed>; an existing run is resumed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi

SCHEME="${1:-admin}"; DEPTH="${2:-6l_6l}"; SEED="${3:-1111}"
TASK=iwslt14_de_en; SRC=de; TGT=en
LR=7e-4; WARMUP=6000; DROPOUT=0.3; ATTENTION_DROPOUT=0.1; ACTIVATION_DROPOUT=0.1
WEIGHT_DECAY=0.0001; EFFECTIVE_BATCH_DEFAULT=4096; MAX_TOKENS_DEFAULT=4096
LENGTH=(--max-update 100000); STOP_FLAGS=(); KEEP_LAST_DEFAULT=20
case "$DEPTH" in
  6l_6l) ;;
  *) die "DEPTH '$DEPTH' is not a $TASK preset; valid choices: 6l_6l" ;;
esac
ARCH="${ARCH:-admin_transformer_iwslt_de_en}"

setup_tools
recipe_train
