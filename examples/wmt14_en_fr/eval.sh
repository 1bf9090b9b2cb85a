#!/usr/bin/env bash
# WMT14 En-Fr: average the last N epoch checkpoints of a run, translate newstest2014, score.
#
#   examples/wmt14_en_fr/eval.sh RUN_DIR
#
# Follows Transformer-Clinic's nmt-experiments/eval_wmt_en-fr.sh (the Admin paper's
# scoring): average the last AVG_LAST (default 10) checkpointN.pt with N <= 50
# (CHECKPOINT_UPPER_BOUND, default 50; "none" for no bound) with the package's
# fairseq-admin-average-checkpoints, then fairseq-generate --beam 5 --lenpen 0.8
# --batch-size 128 --remove-bpe on the test set.
# Prints, in this order: tokenized BLEU on the Moses -a tokenized text (fairseq-generate's
# BLEU4, the number Clinic's script reports) and detokenized sacreBLEU against the raw
# newstest2014 reference with its signature.
#
# Environment: AVG_LAST, CHECKPOINT_UPPER_BOUND, CHECKPOINT (evaluate this file, no
# averaging), BEAM, LENPEN, GEN_BATCH_SIZE (default 128), GEN_EXTRA_ARGS (appended to
# fairseq-generate, split like shell words), DEVICE (gpu|cpu),
# EVAL_PRECISION (fp32|fp16, default fp32), DATA_DIR (default ./data/wmt14_en_fr).
# Outputs in RUN_DIR/eval/: generate-test.<checkpoint>.txt, test.<checkpoint>.detok.fr,
# bleu.<checkpoint>.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
[[ $# -ge 1 ]] || { usage >&2; die "RUN_DIR missing"; }

RUN_DIR="$(realpath -m "$1")"
TASK=wmt14_en_fr; SRC=en; TGT=fr
BEAM_DEFAULT=5; LENPEN_DEFAULT=0.8; UPPER_BOUND_DEFAULT=50; COMPOUND_SPLIT=0; LOWERCASE=0
SCORING="Transformer-Clinic eval_wmt_en-fr.sh (the Admin paper's): last 10 epoch checkpoints <= epoch 50 averaged, beam 5, lenpen 0.8, tokenized BLEU"

setup_tools
recipe_eval
