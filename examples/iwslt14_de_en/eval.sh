#!/usr/bin/env bash
# IWSLT14 De-En: average the last N epoch checkpoints of a run, translate the test set, score.
#
#   examples/iwslt14_de_en/eval.sh RUN_DIR
#
# Follows Transformer-Clinic's nmt-experiments/eval_iwslt_de-en.sh (the Admin paper's
# scoring): average the last AVG_LAST (default 10) checkpointN.pt with N <= 90
# (CHECKPOINT_UPPER_BOUND, default 90; "none" for no bound) with the package's
# fairseq-admin-average-checkpoints, then fairseq-generate --beam 5 --batch-size 128
# --remove-bpe (length penalty 1) on the test set. Clinic's script decodes in fp16
# (EVAL_PRECISION=fp16 on a GPU); the default here is fp32.
# Prints, in this order: tokenized BLEU on the lowercased Moses-tokenized text
# (fairseq-generate's BLEU4, the number Clinic's script reports) and detokenized,
# case-insensitive sacreBLEU against the raw reference with its signature.
#
# Environment: AVG_LAST, CHECKPOINT_UPPER_BOUND, CHECKPOINT (evaluate this file, no
# averaging), BEAM, LENPEN, GEN_BATCH_SIZE (default 128), GEN_EXTRA_ARGS (appended to
# fairseq-generate, split like shell words), DEVICE (gpu|cpu),
# EVAL_PRECISION (fp32|fp16, default fp32), DATA_DIR (default ./data/iwslt14_de_en).
# Outputs in RUN_DIR/eval/: generate-test.<checkpoint>.txt, test.<checkpoint>.detok.en,
# bleu.<checkpoint>.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
[[ $# -ge 1 ]] || { usage >&2; die "RUN_DIR missing"; }

RUN_DIR="$(realpath -m "$1")"
TASK=iwslt14_de_en; SRC=de; TGT=en
BEAM_DEFAULT=5; LENPEN_DEFAULT=1.0; UPPER_BOUND_DEFAULT=90; COMPOUND_SPLIT=0; LOWERCASE=1
SCORING="Transformer-Clinic eval_iwslt_de-en.sh (the Admin paper's): last 10 epoch checkpoints <= epoch 90 averaged, beam 5, lenpen 1, tokenized BLEU"

setup_tools
recipe_eval
