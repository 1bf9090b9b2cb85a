#!/usr/bin/env bash
# WMT14 En-Fr: train Admin, the paper's Admin, Post-LN or Pre-LN with Transformer-Clinic's
# recipe, or a deep encoder, shallow decoder as Kasai et al. did.
#
#   examples/wmt14_en_fr/train.sh SCHEME DEPTH [SEED]
#     SCHEME  admin | admin-paper | post-ln | pre-ln | post-ln-paper | pre-ln-paper | kasai
#             (default admin)
#     DEPTH   6l_6l | 60l_12l                                           (default 6l_6l)
#             shallow decoders: 6l_1l | 12l_1l | 12l_2l | 18l_1l | 18l_2l | 24l_1l
#     SEED    default 1111 (Transformer-Clinic's); 1 with kasai (Kasai et al.'s)
#
# Schemes (flags from fairseq_admin_pos/scheme_flags.py, the table make demo reads too):
# admin is the recommended Admin (closed form, omega a trainable vector) with Adam; post-ln
# and pre-ln with Adam too, so the three differ in the residual alone; admin-paper is the
# paper's Admin (--admin-init profile --admin-profile-mode clinic --admin-omega parameter)
# with RAdam as Clinic (--optimizer radam --radam-early-steps skip), as do post-ln-paper and
# pre-ln-paper, the paper's baselines as Clinic trained them. All take the recipe below,
# whose schedule is the paper's. kasai: Kasai et al.'s published training of their
# deep-shallow models, stock Post-LN (--admin-init none) with their optimizer, schedule,
# dropout, batch and length (below). How the two Admins compared in this package's CPU-scale
# depth study: README.md of this folder.
#
# Published recipe (Liu et al. 2020; Liu, Liu & Gao 2020 for 60L-12L; Transformer-Clinic
# nmt-experiments/wmt14_en-fr.md): lr 7e-4, inverse_sqrt with 8000 warmup updates from 1e-7,
# betas (0.9, 0.98), no clipping, dropout / attention / activation dropout 0.1, no weight
# decay, label smoothing 0.1, shared embeddings, 50 epochs, --min-lr 1e-09 (fairseq 0.12:
# --stop-min-lr; never reached), --fp16 --fp16-scale-window 256 --threshold-loss-scale
# 0.03125, seed 1111; batch
#   6l_6l    8 GPUs x 8000 tokens x 10 = 640000 tokens per update
#   60l_12l 16 GPUs x 5000 tokens x 16 = 1280000 tokens per update
# Shallow decoders (6l_1l ... 24l_1l) with every scheme but kasai: the 6l_6l recipe (no
# Admin run at these shapes on En-Fr is published).
#
# kasai (Kasai, Pappas, Peng, Cross & Smith, "Deep Encoder, Shallow Decoder", ICLR 2021;
# jungokasai/deep-shallow), any DEPTH: the published training command (written for WMT16
# En-De; the paper trains every pair on 16 GPUs in fairseq): Adam betas (0.9, 0.98),
# --clip-norm 25 (their fairseq's default), lr 5e-4, inverse_sqrt with 4000 warmup updates
# from 1e-7, --min-lr 1e-9, dropout 0.2 (tuned on En-De; the En-Fr value is not in that
# README: EXTRA_ARGS="--dropout 0.1" changes it), attention / activation dropout 0, no
# weight decay, label smoothing 0.1, shared embeddings, 16 GPUs x 4096 tokens = 65536 tokens
# per update, --max-update 300000, --fp16 (fairseq's default loss scaling), max source /
# target positions 10000, seed 1.
#
# Environment (see examples/README.md): NUM_GPUS, GPUS_PER_NODE, NNODES, LAUNCHER
# (local|torchrun|slurm), NODE_RANK, MASTER_ADDR, MASTER_PORT, MAX_TOKENS (update-freq is
# derived), EFFECTIVE_BATCH, PRECISION (fp16|bf16|fp32), DEVICE (gpu|cpu), ARCH,
# DATA_DIR / DATA_BIN, RUNS_DIR / RUN_DIR, KEEP_LAST_EPOCHS, LOG_INTERVAL, EXTRA_ARGS
# (appended last, so they win; split like shell words), DRY_RUN=1 (print the command only).
# The run goes to $RUNS_DIR/wmt14_en_fr/<scheme>_<depth>_<seed>; an existing run is resumed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi

SCHEME="${1:-admin}"; DEPTH="${2:-6l_6l}"
if [[ "$SCHEME" == kasai ]]; then SEED="${3:-1}"; else SEED="${3:-1111}"; fi
TASK=wmt14_en_fr; SRC=en; TGT=fr; TASK_SCHEMES="$SCHEMES kasai"
LR=7e-4; WARMUP=8000; DROPOUT=0.1; ATTENTION_DROPOUT=0.1; ACTIVATION_DROPOUT=0.1
WEIGHT_DECAY=0.0; LENGTH=(--max-epoch 50); STOP_FLAGS=(--stop-min-lr 1e-09)
case "$DEPTH" in
  6l_6l | 6l_1l | 12l_1l | 12l_2l | 18l_1l | 18l_2l | 24l_1l)
    EFFECTIVE_BATCH_DEFAULT=640000; MAX_TOKENS_DEFAULT=8000 ;;
  60l_12l) EFFECTIVE_BATCH_DEFAULT=1280000; MAX_TOKENS_DEFAULT=5000 ;;
  *) die "DEPTH '$DEPTH' is not a $TASK preset; valid choices: 6l_6l 60l_12l 6l_1l 12l_1l" \
         "12l_2l 18l_1l 18l_2l 24l_1l" ;;
esac
[[ "$SCHEME" != kasai ]] || kasai_recipe
ARCH="${ARCH:-admin_transformer_wmt_en_de_$DEPTH}"

setup_tools
recipe_train
