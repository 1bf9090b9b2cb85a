#!/usr/bin/env bash
# WMT14 En-De: average the last N epoch checkpoints of a run, translate newstest2014, score.
#
#   examples/wmt14_en_de/eval.sh RUN_DIR
#
# Follows Transformer-Clinic's nmt-experiments/eval_wmt_en-de.sh (the Admin paper's
# scoring): average the last AVG_LAST (default 10) checkpointN.pt with N <= 100
# (CHECKPOINT_UPPER_BOUND, default 100; "none" for no bound) with the package's
# fairseq-admin-average-checkpoints, then fairseq-generate --beam 5 --batch-size 128
# --remove-bpe (length penalty 1, fairseq's default) on the test set. An earlier version of
# that script, the paper text and admin-torch's eval_wmt_en-de.sh decode with beam 4 and
# length penalty 0.6: BEAM=4 LENPEN=0.6.
# Prints, in this order: tokenized BLEU on the Moses -a tokenized text (fairseq-generate's
# BLEU4, the number Clinic's script reports), detokenized sacreBLEU against the raw
# newstest2014 reference with its signature, and the tokenized BLEU after compound
# splitting (a-b -> a ##AT##-##AT## b, tensor2tensor's get_ende_bleu.sh convention used by
# e.g. Vaswani et al. 2017; not the Admin paper's scoring).
#
# Environment: AVG_LAST, CHECKPOINT_UPPER_BOUND, CHECKPOINT (evaluate this file, no
# averaging), BEAM, LENPEN, GEN_BATCH_SIZE (default 128), GEN_EXTRA_ARGS (appended to
# fairseq-generate, split like shell words), DEVICE (gpu|cpu),
# EVAL_PRECISION (fp32|fp16, default fp32), DATA_DIR (default ./data/wmt14_en_de).
# Outputs in RUN_DIR/eval/: generate-test.<checkpoint>.txt, test.<checkpoint>.detok.de,
# bleu.<checkpoint>.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi
[[ $# -ge 1 ]] || { usage >&2; die "RUN_DIR missing"; }

RUN_DIR="$(realpath -m "$1")"
TASK=wmt14_en_de; SRC=en; TGT=de
BEAM_DEFAULT=5; LENPEN_DEFAULT=1.0; UPPER_BOUND_DEFAULT=100; COMPOUND_SPLIT=1; LOWERCASE=0
SCORING="Transformer-Clinic eval_wmt_en-de.sh (the Admin paper's): last 10 epoch checkpoints <= epoch 100 averaged, beam 5, lenpen 1, tokenized BLEU"

setup_tools
recipe_eval
