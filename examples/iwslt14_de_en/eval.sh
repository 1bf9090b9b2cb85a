#!/usr/bin/env bash
# IWSLT14 De-En: average the last N epoch checkpoints of a run, translate the test set, score.
#
#   examples/iwslt14_de_en/eval.sh RUN_DIR
#
# Averages the last AVG_LAST (default 10) checkpointN.pt of RUN_DIR with the package's
# fairseq-admin-average-checkpoints (CHECKPOINT_UPPER_BOUND=N: only epochs <= N), then
# fairseq-generate on the test set with beam 5, length penalty 1
# (Transformer-Clinic eval_iwslt_de-en.sh).
# Prints tokenized BLEU on the lowercased Moses-tokenized text (the papers' number, as
# fairseq-generate computes it) and detokenized, case-insensitive sacreBLEU against the raw
# reference with its signature.
#
# Environment: AVG_LAST, CHECKPOINT_UPPER_BOUND, CHECKPOINT (evaluate this file, no
# averaging), BEAM, LENPEN, GEN_BATCH_SIZE (default 128), GEN_EXTRA_ARGS (appended to
# fairseq-generate), DEVICE (gpu|cpu),
# EVAL_PRECISION (fp32|fp16, default fp32), DATA_DIR (default ./data/iwslt14_de_en).
# Outputs in RUN_DIR/eval/: generate-test.<checkpoint>.txt, test.<checkpoint>.detok.en,
# bleu.<checkpoint>.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
[[ $# -ge 1 ]] || { usage >&2; die "RUN_DIR missing"; }

RUN_DIR="$(realpath -m "$1")"
TASK=iwslt14_de_en; SRC=de; TGT=en
BEAM_DEFAULT=5; LENPEN_DEFAULT=1.0; COMPOUND_SPLIT=0; LOWERCASE=1

setup_tools
recipe_eval
