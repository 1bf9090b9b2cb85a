#!/usr/bin/env bash
# WMT14 English-French: download, Moses tokenisation (-a), length/ratio cleaning, joint BPE,
# fairseq-preprocess --joined-dictionary.
#
#   examples/wmt14_en_fr/prepare.sh [DATA_DIR]            (default: ./data/wmt14_en_fr)
#
# Corpora of fairseq's examples/translation/prepare-wmt14en2fr.sh (Europarl v7, Common
# Crawl, UN, News Commentary v9, Gigaword fr-en; about 36M sentence pairs) with the same
# Moses steps (normalize-punctuation, remove-non-printing-char, tokenizer -a; here via
# sacremoses); newstest2013 is the validation set (instead of a held-out slice of training)
# and newstest2014 (full, 3003 sentences) the test set.
#
# Environment:
#   WMT14_BASE_URL  server holding wmt10/, wmt13/ and wmt14/ (default http://statmt.org)
#   BPE_TOKENS      BPE merge operations (default 40000: the papers' 40k joint BPE)
#   MAX_LEN         longest training/validation sentence kept, in BPE tokens (default 250)
#   WORKERS         processes for tokenisation / BPE / binarisation (default: nproc)
#   CHECKSUMS       optional sha256sum-format file; archives listed there must match
# Outputs: DATA_DIR/data-bin (binarized), DATA_DIR/ref (test references), DATA_DIR/bpe/code.
# Each step is skipped when its marker DATA_DIR/.done/<step> exists (written last).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common/lib.sh"
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage; exit 0; fi

DATA_DIR="$(realpath -m "${1:-${DATA_DIR:-data/wmt14_en_fr}}")"
BASE_URL="${WMT14_BASE_URL:-http://statmt.org}"
BPE_TOKENS="${BPE_TOKENS:-40000}"
MAX_LEN="${MAX_LEN:-250}"
SRC=en; TGT=fr; TEST_PAIR=fren
ARCHIVES=(wmt13/training-parallel-europarl-v7.tgz wmt13/training-parallel-commoncrawl.tgz
          wmt13/training-parallel-un.tgz wmt14/training-parallel-nc-v9.tgz
          wmt10/training-giga-fren.tar wmt14/dev.tgz wmt14/test-full.tgz)
EXPECT=(training/europarl-v7.fr-en.en commoncrawl.fr-en.en un/undoc.2000.fr-en.en
        training/news-commentary-v9.fr-en.en giga-fren.release2.fixed.en.gz dev
        test-full/newstest2014-fren-src.en.sgm)
# giga-fren stays gzip-compressed: the tokenizer reads .gz directly
CORPORA=(training/europarl-v7.fr-en commoncrawl.fr-en un/undoc.2000.fr-en
         training/news-commentary-v9.fr-en giga-fren.release2.fixed)

setup_tools
prepare_common_setup
prepare_wmt14
say "done: $BIN (next: examples/wmt14_en_fr/train.sh)"
