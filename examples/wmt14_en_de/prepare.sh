#!/usr/bin/env bash
# WMT14 English-German: download, Moses tokenisation (-a), length/ratio cleaning, joint BPE,
# fairseq-preprocess --joined-dictionary.
#
#   examples/wmt14_en_de/prepare.sh [DATA_DIR]            (default: ./data/wmt14_en_de)
#
# Corpora of fairseq's examples/translation/prepare-wmt14en2de.sh --icml17 (the WMT14
# training data: Europarl v7, Common Crawl, News Commentary v9) with the same Moses steps
# (normalize-punctuation, remove-non-printing-char, tokenizer -a; here via sacremoses);
# newstest2013 is the validation set (the papers' dev set, instead of 1% held out from
# training) and newstest2014 (full, 3003 sentences) the test set.
#
# Environment:
#   WMT14_BASE_URL  server holding wmt13/... and wmt14/... (default http://statmt.org)
#   BPE_TOKENS      BPE merge operations (default 32000: the papers' 32k joint BPE)
#   MAX_LEN         longest training/validation sentence kept, in BPE tokens (default 250)
#   WORKERS         processes for tokenisation / BPE / binarisation (default: nproc)
#   CHECKSUMS       optional sha256sum-format file; archives listed there must match
# Outputs: DATA_DIR/data-bin (binarized), DATA_DIR/ref (test references), DATA_DIR/bpe/code.
# Each step is skipped when its marker DATA_DIR/.done/<step> exists (written last).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi

DATA_DIR="$(realpath -m "${1:-${DATA_DIR:-data/wmt14_en_de}}")"
BASE_URL="${WMT14_BASE_URL:-http://statmt.org}"
BPE_TOKENS="${BPE_TOKENS:-32000}"
MAX_LEN="${MAX_LEN:-250}"
SRC=en; TGT=de; TEST_PAIR=deen
ARCHIVES=(wmt13/training-parallel-europarl-v7.tgz wmt13/training-parallel-commoncrawl.tgz
          wmt14/training-parallel-nc-v9.tgz wmt14/dev.tgz wmt14/test-full.tgz)
EXPECT=(training/europarl-v7.de-en.en commoncrawl.de-en.en training/news-commentary-v9.de-en.en
        dev test-full/newstest2014-deen-src.en.sgm)
CORPORA=(training/europarl-v7.de-en commoncrawl.de-en training/news-commentary-v9.de-en)

setup_tools
prepare_common_setup
prepare_wmt14
say "done: $BIN (next: examples/wmt14_en_de/train.sh)"
