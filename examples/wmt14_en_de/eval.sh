#!/usr/bin/env bash
# WMT14 En-De: average the last N epoch checkpoints of a run, translate newstest2014, score.
#
#   examples/wmt14_en_de/eval.sh RUN_DIR
#
# Averages the last AVG_LAST (default 10) checkpointN.pt of RUN_DIR with the package's
# fairseq-admin-average-checkpoints (CHECKPOINT_UPPER_BOUND=N: only epochs <= N), then
# fairseq-generate on the test set with beam 4, length penalty 0.6
# (Liu et al. 2020).
# Prints tokenized BLEU on the Moses -a tokenized text with compound splitting (a-b ->
# a ##AT##-##AT## b, the papers' number), the same without compound splitting
# (fairseq-generate's number), and detokenized sacreBLEU against the raw newstest2014
# reference with its signature.
#
# Environment: AVG_LAST, CHECKPOINT_UPPER_BOUND, CHECKPOINT (evaluate this file, no
# averaging), BEAM, LENPEN, GEN_BATCH_SIZE (default 128), GEN_EXTRA_ARGS (appended to
# fairseq-generate), DEVICE (gpu|cpu),
# EVAL_PRECISION (fp32|fp16, default fp32), DATA_DIR (default ./data/wmt14_en_de).
# Outputs in RUN_DIR/eval/: generate-test.<checkpoint>.txt, test.<checkpoint>.detok.de,
# bleu.<checkpoint>.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
[[ $# -ge 1 ]] || { usage >&2; die "RUN_DIR missing"; }

RUN_DIR="$(realpath -m "$1")"
TASK=wmt14_en_de; SRC=en; TGT=de
BEAM_DEFAULT=4; LENPEN_DEFAULT=0.6; COMPOUND_SPLIT=1; LOWERCASE=0

setup_tools
recipe_eval
