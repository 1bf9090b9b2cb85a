#!/usr/bin/env bash
# IWSLT14 German-English: download, Moses tokenisation, cleaning, lowercasing, joint BPE,
# fairseq-preprocess --joined-dictionary.
#
#   examples/iwslt14_de_en/prepare.sh [DATA_DIR]          (default: ./data/iwslt14_de_en)
#
# The preparation of fairseq's examples/translation/prepare-iwslt14.sh, on which the papers'
# IWSLT numbers were measured: TED talk metadata removed, Moses tokenizer (without -a),
# training pairs of 1..175 tokens with length ratio <= 1.5, everything lowercased, every
# 23rd training pair held out for validation, test = dev2010 + tst2010-2012 + TEDX dev2012
# (6750 sentences), 10k joint BPE.
#
# Environment:
#   IWSLT14_URL  the de-en.tgz archive
#                (default http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz)
#   BPE_TOKENS   BPE merge operations (default 10000)
#   MAX_LEN      longest training sentence kept, in tokens before BPE (default 175)
#   WORKERS      processes for tokenisation / BPE / binarisation (default: nproc)
#   CHECKSUMS    optional sha256sum-format file; de-en.tgz must match it when listed
# Outputs: DATA_DIR/data-bin (binarized), DATA_DIR/ref (test references), DATA_DIR/bpe/code.
# Each step is skipped when its marker DATA_DIR/.done/<step> exists (written last).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi

DATA_DIR="$(realpath -m "${1:-${DATA_DIR:-data/iwslt14_de_en}}")"
URL="${IWSLT14_URL:-http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz}"
BPE_TOKENS="${BPE_TOKENS:-10000}"
MAX_LEN="${MAX_LEN:-175}"
SRC=de; TGT=en
TEST_SETS=(IWSLT14.TED.dev2010 IWSLT14.TEDX.dev2012 IWSLT14.TED.tst2010 IWSLT14.TED.tst2011
           IWSLT14.TED.tst2012)

setup_tools
prepare_common_setup

step fetch-de-en.tgz fetch "$URL" de-en.tgz
step extract-de-en.tgz run "${RECIPES[@]}" extract --archive "$ORIG/de-en.tgz" --dest "$ORIG" \
  --expect de-en/train.tags.de-en.de de-en/train.tags.de-en.en

tokenize_train() {
  local l
  for l in "$SRC" "$TGT"; do
    run "${RECIPES[@]}" tokenize --lang "$l" --input-format iwslt-tags --workers "$WORKERS" \
      --output "$TMP/train.tags.tok.$l" "$ORIG/de-en/train.tags.de-en.$l"
  done
  # clean-corpus-n.perl -ratio 1.5 ... 1 175, then lowercase.perl
  run "${RECIPES[@]}" clean "$TMP/train.tags.tok" "$SRC" "$TGT" "$TMP/train.tags.clean" \
    1 "$MAX_LEN" --ratio 1.5 --lowercase
  for l in "$SRC" "$TGT"; do
    show awk "NR % 23 == 0" "$TMP/train.tags.clean.$l" ">" "$TMP/valid.$l"
    awk 'NR % 23 == 0' "$TMP/train.tags.clean.$l" > "$TMP/valid.$l"
    show awk "NR % 23 != 0" "$TMP/train.tags.clean.$l" ">" "$TMP/train.$l"
    awk 'NR % 23 != 0' "$TMP/train.tags.clean.$l" > "$TMP/train.$l"
  done
}
step tokenize-train tokenize_train

tokenize_test() {
  local l t inputs
  for l in "$SRC" "$TGT"; do
    inputs=()
    for t in "${TEST_SETS[@]}"; do
      [[ -f "$ORIG/de-en/$t.de-en.$l.xml" ]] || die "de-en.tgz lacks de-en/$t.de-en.$l.xml"
      inputs+=("$ORIG/de-en/$t.de-en.$l.xml")
    done
    run "${RECIPES[@]}" tokenize --lang "$l" --input-format sgm --rsquo --lowercase \
      --output "$REF/test.tok.$l" --raw-output "$REF/test.raw.$l" "${inputs[@]}"
  done
}
step tokenize-test tokenize_test

step bpe-learn bpe_learn "$BPE/code" "$TMP/train.$SRC" "$TMP/train.$TGT"

apply_bpe_all() {
  local l split
  for l in "$SRC" "$TGT"; do
    for split in train valid; do bpe_apply "$BPE/code" "$TMP/$split.$l" "$BPE/$split.$l"; done
    bpe_apply "$BPE/code" "$REF/test.tok.$l" "$BPE/test.$l"
  done
}
step bpe-apply apply_bpe_all

step binarize binarize "$SRC" "$TGT" "$BPE" "$BIN"
say "done: $BIN (next: examples/iwslt14_de_en/train.sh)"
