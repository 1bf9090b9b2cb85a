# Shared code of the recipes in examples/<task>/{prepare,train,eval}.sh (sourced, not run).
#
# Tools are located, in this order:
#   fairseq-*      $FAIRSEQ_BIN/, else the directory of `fairseq-train` on PATH, else $ROOT/.venv/bin
#   python         $PYTHON, else the python next to fairseq-train, else python3
# The repository root goes first on PYTHONPATH, so the plugin works without `pip install`.
# The pure-python helpers (examples/common/recipes.py) run as a script: importing the
# package would load torch and fairseq for every call.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
USER_DIR="$ROOT/fairseq_admin_pos"

say() { printf '%s\n' "$*"; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

# Print a command (shell-quoted, so it can be pasted) and run it. Redirections passed as
# the words "<", ">", "|" print as they are.
show() {
  local word out="+" q="'"
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=@%+,-]+$ || "$word" == "<" || "$word" == ">" || "$word" == "|" ]]; then
      out+=" $word"
    else
      out+=" '${word//$q/$q\\$q$q}'"
    fi
  done
  printf '%s\n' "$out"
}
run() { show "$@"; "$@"; }

setup_tools() {
  if [[ -n "${FAIRSEQ_BIN:-}" ]]; then
    FSBIN="$FAIRSEQ_BIN"
  elif command -v fairseq-train >/dev/null 2>&1; then
    FSBIN="$(dirname "$(command -v fairseq-train)")"
  elif [[ -x "$ROOT/.venv/bin/fairseq-train" ]]; then
    FSBIN="$ROOT/.venv/bin"
  else
    die "fairseq-train not found: put the environment's bin/ on PATH or set FAIRSEQ_BIN" \
        "(scripts/bootstrap.sh builds $ROOT/.venv)"
  fi
  [[ -x "$FSBIN/fairseq-train" ]] || die "FAIRSEQ_BIN=$FSBIN has no fairseq-train"
  if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
  elif [[ -x "$FSBIN/python" ]]; then
    PY="$FSBIN/python"
  else
    PY="$(command -v python3)" || die "no python3 found; set PYTHON"
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  RECIPES=("$PY" "$ROOT/examples/common/recipes.py")
}

# prepare.sh also needs sacremoses (Moses tokenizer) and subword-nmt (BPE)
setup_text_tools() {
  "$PY" -c "import sacremoses, subword_nmt, regex" 2>/dev/null || die "$PY lacks sacremoses," \
    "subword-nmt or regex: pip install sacremoses==0.2.0 subword-nmt==0.3.8 regex" \
    "(setup.py extras 'data')"
  # the console script next to fairseq, else the same entry point through $PY (whose
  # subword_nmt was just found; `python -m subword_nmt.subword_nmt` does not run main)
  if [[ -x "$FSBIN/subword-nmt" ]]; then SUBWORD=("$FSBIN/subword-nmt")
  else SUBWORD=("$PY" -c "import sys; from subword_nmt.subword_nmt import main; sys.exit(main())"); fi
}

# ---------------------------------------------------------------------------------------
# prepare.sh: steps with completion markers
# ---------------------------------------------------------------------------------------
# `step NAME CMD...` runs CMD unless $DATA_DIR/.done/NAME exists. The marker is written
# only after CMD succeeded, so an interrupted step is redone; once a step has run, the
# later steps run too (their inputs may have changed).
STEP_FORCE=0
step() {
  local name="$1"; shift
  local marker="$DATA_DIR/.done/$name"
  if [[ "$STEP_FORCE" == 0 && -f "$marker" ]]; then
    say "== $name: complete ($marker), skipped"
    return 0
  fi
  say "== $name"
  mkdir -p "$DATA_DIR/.done"
  rm -f "$marker"
  "$@"
  date -u +%Y-%m-%dT%H:%M:%SZ > "$marker"
  STEP_FORCE=1
}

# fetch URL FILE: download into $ORIG with checks (recipes.py fetch).
fetch() {
  local args=(fetch --url "$1" --dest "$ORIG/$2")
  [[ -n "${CHECKSUMS:-}" ]] && args+=(--checksums "$CHECKSUMS")
  run "${RECIPES[@]}" "${args[@]}"
}

# Joint BPE: learned on the concatenated training sides, applied to every split. Files go
# through -i/-o, not pipes: subword-nmt's --num-workers needs a seekable input.
bpe_learn() {  # bpe_learn CODES INPUT...
  local codes="$1"; shift
  show cat "$@" ">" "$codes.joint-train"
  cat "$@" > "$codes.joint-train"
  run "${SUBWORD[@]}" learn-bpe -s "$BPE_TOKENS" --num-workers "$WORKERS" \
    -i "$codes.joint-train" -o "$codes.tmp"
  rm -f "$codes.joint-train"
  mv "$codes.tmp" "$codes"
}
bpe_apply() {  # bpe_apply CODES IN OUT
  run "${SUBWORD[@]}" apply-bpe -c "$1" --num-workers "$WORKERS" -i "$2" -o "$3.tmp"
  mv "$3.tmp" "$3"
}

binarize() {  # binarize SRC TGT BPE_DIR BIN_DIR
  rm -rf "$4"  # fairseq-preprocess refuses to overwrite dictionaries of a half-done run
  run "$FSBIN/fairseq-preprocess" --source-lang "$1" --target-lang "$2" \
    --trainpref "$3/train" --validpref "$3/valid" --testpref "$3/test" \
    --destdir "$4" --joined-dictionary --workers "$WORKERS"
}

prepare_common_setup() {  # after DATA_DIR is set
  ORIG="$DATA_DIR/orig"; TMP="$DATA_DIR/tmp"; BPE="$DATA_DIR/bpe"; BIN="$DATA_DIR/data-bin"
  REF="$DATA_DIR/ref"
  setup_text_tools
  WORKERS="${WORKERS:-$(nproc 2>/dev/null || echo 1)}"
  mkdir -p "$ORIG" "$TMP" "$BPE" "$REF"
}

# WMT14 pipeline shared by wmt14_en_de and wmt14_en_fr. The task script sets SRC TGT
# BASE_URL ARCHIVES (paths under BASE_URL) EXPECT (one member per archive) CORPORA (training
# corpus prefixes under $ORIG, ".gz" appended when compressed) and TEST_PAIR (deen / fren).
prepare_wmt14() {
  local i file
  for i in "${!ARCHIVES[@]}"; do
    file="$(basename "${ARCHIVES[i]}")"
    step "fetch-$file" fetch "$BASE_URL/${ARCHIVES[i]}" "$file"
    step "extract-$file" run "${RECIPES[@]}" extract --archive "$ORIG/$file" --dest "$ORIG" \
      --expect "${EXPECT[i]}"
  done
  step tokenize-train _wmt_tokenize_train
  step tokenize-dev-test _wmt_tokenize_dev_test
  step bpe-learn bpe_learn "$BPE/code" "$TMP/train.tok.$SRC" "$TMP/train.tok.$TGT"
  step bpe-apply-clean _wmt_apply_and_clean
  step binarize binarize "$SRC" "$TGT" "$BPE" "$BIN"
}

_wmt_tokenize_train() {
  local l c inputs
  for l in "$SRC" "$TGT"; do
    inputs=()
    for c in "${CORPORA[@]}"; do
      if [[ -f "$ORIG/$c.$l" ]]; then inputs+=("$ORIG/$c.$l"); else inputs+=("$ORIG/$c.$l.gz"); fi
    done
    # normalize-punctuation.perl | remove-non-printing-char.perl | tokenizer.perl -a
    run "${RECIPES[@]}" tokenize --lang "$l" --normalize-punct --remove-non-printing --aggressive \
      --workers "$WORKERS" --output "$TMP/train.tok.$l" "${inputs[@]}"
  done
}

# newstest2013 (dev) and newstest2014 (test) from the SGML files; their raw text is kept in
# $REF for detokenized BLEU. dev.tgz is read as SGML when it has it, else as plain text.
_wmt_tokenize_dev_test() {
  local l side fmt file
  for l in "$SRC" "$TGT"; do
    if [[ "$l" == "$SRC" ]]; then side=src; else side=ref; fi
    if [[ -f "$ORIG/dev/newstest2013-$side.$l.sgm" ]]; then
      fmt=sgm; file="$ORIG/dev/newstest2013-$side.$l.sgm"
    elif [[ -f "$ORIG/dev/newstest2013.$l" ]]; then
      fmt=plain; file="$ORIG/dev/newstest2013.$l"
    else
      die "dev.tgz has neither dev/newstest2013-$side.$l.sgm nor dev/newstest2013.$l"
    fi
    run "${RECIPES[@]}" tokenize --lang "$l" --input-format "$fmt" --rsquo --aggressive \
      --output "$TMP/valid.tok.$l" --raw-output "$REF/valid.raw.$l" "$file"
    run "${RECIPES[@]}" tokenize --lang "$l" --input-format sgm --rsquo --aggressive \
      --output "$REF/test.tok.$l" --raw-output "$REF/test.raw.$l" \
      "$ORIG/test-full/newstest2014-$TEST_PAIR-$side.$l.sgm"
  done
}

_wmt_apply_and_clean() {
  local split l in
  for split in train valid test; do
    for l in "$SRC" "$TGT"; do
      in="$TMP/$split.tok.$l"
      if [[ "$split" == test ]]; then in="$REF/test.tok.$l"; fi
      bpe_apply "$BPE/code" "$in" "$TMP/bpe.$split.$l"
    done
  done
  # length/ratio cleaning after BPE (clean-corpus-n.perl -ratio 1.5 ... 1 250), as fairseq's
  # WMT preparation; the test set is kept whole
  run "${RECIPES[@]}" clean "$TMP/bpe.train" "$SRC" "$TGT" "$BPE/train" 1 "$MAX_LEN" --ratio 1.5
  run "${RECIPES[@]}" clean "$TMP/bpe.valid" "$SRC" "$TGT" "$BPE/valid" 1 "$MAX_LEN" --ratio 1.5
  for l in "$SRC" "$TGT"; do cp "$TMP/bpe.test.$l" "$BPE/test.$l"; done
}

# ---------------------------------------------------------------------------------------
# train.sh
# ---------------------------------------------------------------------------------------
# The task's train.sh sets: TASK SRC TGT ARCH EFFECTIVE_BATCH_DEFAULT MAX_TOKENS_DEFAULT LR
# WARMUP DROPOUT ATTENTION_DROPOUT ACTIVATION_DROPOUT WEIGHT_DECAY LENGTH (array, e.g.
# (--max-epoch 100)), STOP_FLAGS (array, may be empty), KEEP_LAST_DEFAULT and SCHEME DEPTH
# SEED, optionally TASK_SCHEMES (default $SCHEMES), FP16_FLAGS (array; default Clinic's loss
# scaling) and RECIPE_FLAGS (array of further fairseq-train flags), then calls recipe_train.
#
# Schemes: the names of fairseq_admin_pos/scheme_flags.py, the table that make demo and the
# depth study read too; scheme_flags asks it for the flags. admin is the recommended Admin
# (closed form, omega a trainable vector) and trains with Adam, as do post-ln and pre-ln, so
# the three differ in the residual alone; admin-paper is the paper's Admin (omegas profiled
# on the first training batch as Transformer-Clinic does) and brings RAdam with Clinic's
# first-steps behaviour (fairseq_admin_pos/optim/radam.py), as do post-ln-paper and
# pre-ln-paper, the paper's baselines as Clinic trained them. Every scheme takes the task's
# schedule, which is the paper's (Transformer-Clinic's lr and warmup for that task).
# The WMT14 tasks add kasai (TASK_SCHEMES): Kasai et al.'s published training of their deep
# encoder, shallow decoder models (stock Post-LN, their optimizer), which replaces the task's
# settings (kasai_recipe).
SCHEMES="post-ln pre-ln admin admin-paper post-ln-paper pre-ln-paper"

# kasai_recipe: Kasai, Pappas, Peng, Cross & Smith, "Deep Encoder, Shallow Decoder", ICLR 2021
# (arXiv 2006.10369), the training command of jungokasai/deep-shallow's README (its WMT16
# En-De 12-1 model): stock fairseq transformer (Post-LN), Adam with gradient clipping at 25
# (the default of the fairseq their code is built on; fairseq 0.12's is 0), lr 5e-4,
# inverse_sqrt with 4000 warmup updates from 1e-7, --min-lr 1e-9, dropout 0.2 (attention /
# activation dropout 0, fairseq's transformer defaults), no weight decay, label smoothing
# 0.1, shared embeddings, 16 GPUs x 4096 tokens (= 65536 tokens per update), --max-update
# 300000, --fp16 with fairseq's default loss scaling, max positions 10000, seed 1. Replaces
# the task's settings; the task's train.sh calls it for SCHEME=kasai.
kasai_recipe() {
  LR=5e-4; WARMUP=4000; DROPOUT=0.2; ATTENTION_DROPOUT=0.0; ACTIVATION_DROPOUT=0.0
  WEIGHT_DECAY=0.0; EFFECTIVE_BATCH_DEFAULT=65536; MAX_TOKENS_DEFAULT=4096
  LENGTH=(--max-update 300000); STOP_FLAGS=(--stop-min-lr 1e-09)
  FP16_FLAGS=(--fp16)
  RECIPE_FLAGS=(--max-source-positions 10000 --max-target-positions 10000)
}

# scheme_flags SCHEME: sets SCHEME_FLAGS (the model's flags) and OPTIMIZER_FLAGS (the
# scheme's optimizer over Adam, betas (0.9, 0.98), no clipping), read from the package's
# table; a name outside TASK_SCHEMES (default $SCHEMES) stops with one line naming the
# valid choices.
scheme_flags() {
  local valid="${TASK_SCHEMES:-$SCHEMES}" lines model optimizer
  lines="$("$PY" -m fairseq_admin_pos.scheme_flags --setting SCHEME --choices "$valid" \
           --part lines -- "$1")" || exit 2
  { IFS= read -r model; IFS= read -r optimizer; } <<< "$lines"
  # the words come shell-quoted from python's shlex.quote: the eval only undoes the quoting
  eval "SCHEME_FLAGS=($model)"
  eval "OPTIMIZER_FLAGS=($optimizer)"
}

# shell_words ARRAY VAR: split the value of the variable VAR into the array ARRAY as the
# shell splits words (quotes, backslashes; no expansion, nothing is run), so that
# EXTRA_ARGS="--adam-betas '(0.9, 0.999)'" gives two arguments. recipes.py prints the words
# shell-quoted, which makes the eval safe.
shell_words() {
  local quoted
  quoted="$("${RECIPES[@]}" split-args --name "$2" -- "${!2:-}")" || exit 2
  eval "$1=($quoted)"
}

recipe_train() {
  local var
  for var in ADMIN_INIT OPTIMIZER; do
    [[ -z "${!var:-}" ]] || die "$var is no longer read: SCHEME sets the initialisation and the" \
      "optimizer (the *-paper schemes: RAdam as Transformer-Clinic; the others: Adam); pass other" \
      "fairseq flags with EXTRA_ARGS. Unset $var."
  done
  scheme_flags "$SCHEME"
  local label="$SCHEME"
  declare -p STOP_FLAGS >/dev/null 2>&1 || STOP_FLAGS=()
  declare -p RECIPE_FLAGS >/dev/null 2>&1 || RECIPE_FLAGS=()
  [[ "$SEED" =~ ^[0-9]+$ ]] || die "SEED '$SEED' must be a non-negative integer"

  DEVICE="${DEVICE:-gpu}"
  local device_flags=() nnodes gpus_per_node num_gpus launcher
  case "$DEVICE" in
    gpu)
      PRECISION="${PRECISION:-fp16}"
      nnodes="${NNODES:-${SLURM_NNODES:-1}}"
      gpus_per_node="${GPUS_PER_NODE:-}"
      if [[ -z "$gpus_per_node" ]]; then
        if [[ -n "${NUM_GPUS:-}" && "$nnodes" == 1 ]]; then gpus_per_node="$NUM_GPUS"
        else gpus_per_node="$("${RECIPES[@]}" gpus)"; fi
      fi
      num_gpus="${NUM_GPUS:-$((nnodes * gpus_per_node))}"
      [[ "$num_gpus" =~ ^[0-9]+$ && "$num_gpus" -ge 1 ]] || die "no GPU visible" \
        "(nvidia-smi -L / CUDA_VISIBLE_DEVICES). Set NUM_GPUS, or DEVICE=cpu for a CPU smoke run."
      ;;
    cpu)
      PRECISION="${PRECISION:-fp32}"
      [[ "$PRECISION" != fp16 ]] || die "PRECISION=fp16 needs DEVICE=gpu; use fp32 or bf16 on CPU"
      [[ -z "${NUM_GPUS:-}" || "${NUM_GPUS}" == 1 ]] || die "DEVICE=cpu runs one process;" \
        "NUM_GPUS=$NUM_GPUS is not possible (unset it)"
      nnodes=1; gpus_per_node=1; num_gpus=1
      # one process; legacy_ddp because fairseq's c10d wrapper rejects CPU modules
      device_flags=(--cpu --distributed-world-size 1 --ddp-backend legacy_ddp)
      ;;
    *) die "DEVICE '$DEVICE' is not valid; valid choices: gpu cpu" ;;
  esac

  local precision_flags=() trainer=("$FSBIN/fairseq-train")
  case "$PRECISION" in
    fp16) if declare -p FP16_FLAGS >/dev/null 2>&1; then precision_flags=("${FP16_FLAGS[@]}")
          else precision_flags=(--fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125); fi ;;
    bf16) precision_flags=(--bf16)
          # fairseq-train's --bf16 implies --tpu; this entry point keeps it on CUDA
          trainer=("$PY" "$ROOT/examples/common/fairseq_train_bf16.py") ;;
    fp32) ;;
    *) die "PRECISION '$PRECISION' is not valid; valid choices: fp16 bf16 fp32" ;;
  esac

  # launcher: local (fairseq spawns one process per GPU), torchrun (one call per node),
  # slurm (train.sh run by every srun task)
  launcher="${LAUNCHER:-}"
  if [[ -z "$launcher" ]]; then
    if [[ -n "${SLURM_PROCID:-}" && "${SLURM_NTASKS:-1}" -gt 1 ]]; then launcher=slurm
    elif [[ "$nnodes" -gt 1 ]]; then
      die "NNODES=$nnodes: multi-node runs need LAUNCHER=torchrun or LAUNCHER=slurm (see examples/README.md)"
    else launcher=local; fi
  fi
  local launch=() dist_flags=() rank0=1
  case "$launcher" in
    local)
      [[ "$nnodes" == 1 ]] || die "LAUNCHER=local runs on one node, NNODES=$nnodes"
      if [[ "$DEVICE" == gpu ]]; then
        local visible; visible="$("${RECIPES[@]}" gpus)"
        if [[ "$visible" -gt 0 && "$num_gpus" -gt "$visible" ]]; then
          die "NUM_GPUS=$num_gpus but only $visible GPU(s) visible on this node; more GPUs" \
            "need LAUNCHER=torchrun or LAUNCHER=slurm across nodes"
        fi
        dist_flags=(--distributed-world-size "$num_gpus")
      fi
      ;;
    torchrun)
      [[ "$DEVICE" == gpu ]] || die "LAUNCHER=torchrun needs DEVICE=gpu"
      [[ "$num_gpus" == $((nnodes * gpus_per_node)) ]] || die "LAUNCHER=torchrun starts" \
        "NNODES x GPUS_PER_NODE = $((nnodes * gpus_per_node)) processes, not NUM_GPUS=$num_gpus"
      : "${MASTER_ADDR:?LAUNCHER=torchrun needs MASTER_ADDR (host name of node 0)}"
      : "${NODE_RANK:?LAUNCHER=torchrun needs NODE_RANK (0..NNODES-1)}"
      [[ "$NODE_RANK" == 0 ]] || rank0=0
      launch=(torchrun --nnodes "$nnodes" --nproc-per-node "$gpus_per_node" --node-rank "$NODE_RANK"
              --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" --no-python)
      dist_flags=(--distributed-world-size "$num_gpus")
      ;;
    slurm)
      [[ "$DEVICE" == gpu ]] || die "LAUNCHER=slurm needs DEVICE=gpu"
      [[ "${SLURM_PROCID:-0}" == 0 ]] || rank0=0
      dist_flags=(--distributed-world-size "$num_gpus" --distributed-port "${MASTER_PORT:-29500}")
      ;;
    *) die "LAUNCHER '$launcher' is not valid; valid choices: local torchrun slurm" ;;
  esac

  local effective max_tokens update_freq
  effective="${EFFECTIVE_BATCH:-$EFFECTIVE_BATCH_DEFAULT}"
  max_tokens="${MAX_TOKENS:-$MAX_TOKENS_DEFAULT}"
  update_freq="$("${RECIPES[@]}" update-freq --effective-batch "$effective" \
                  --num-gpus "$num_gpus" --max-tokens "$max_tokens")" || exit 2

  local arch="$ARCH"
  DATA_BIN="$(realpath -m "${DATA_BIN:-${DATA_DIR:-$PWD/data/$TASK}/data-bin}")"
  RUNS_DIR="$(realpath -m "${RUNS_DIR:-$PWD/runs}")"
  RUN_DIR="$(realpath -m "${RUN_DIR:-$RUNS_DIR/$TASK/${label}_${DEPTH}_${SEED}}")"
  local keep="${KEEP_LAST_EPOCHS:-${KEEP_LAST_DEFAULT:-10}}"
  local extra=()
  shell_words extra EXTRA_ARGS

  local cmd=("${launch[@]}" "${trainer[@]}" "$DATA_BIN" --user-dir "$USER_DIR"
    --task translation --source-lang "$SRC" --target-lang "$TGT"
    --arch "$arch" --share-all-embeddings "${SCHEME_FLAGS[@]}" "${OPTIMIZER_FLAGS[@]}"
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates "$WARMUP"
    --dropout "$DROPOUT" --attention-dropout "$ATTENTION_DROPOUT"
    --activation-dropout "$ACTIVATION_DROPOUT" --weight-decay "$WEIGHT_DECAY"
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 "${RECIPE_FLAGS[@]}"
    --max-tokens "$max_tokens" --update-freq "$update_freq" "${LENGTH[@]}" "${STOP_FLAGS[@]}"
    --seed "$SEED" --save-dir "$RUN_DIR" --keep-last-epochs "$keep"
    --log-format simple --log-interval "${LOG_INTERVAL:-100}"
    "${precision_flags[@]}" "${device_flags[@]}" "${dist_flags[@]}" "${extra[@]}")

  say "recipe: $TASK $SCHEME $DEPTH seed $SEED | $num_gpus GPU(s) x $max_tokens tokens x" \
      "update-freq $update_freq = $effective tokens/update | $PRECISION | launcher $launcher"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    show "${cmd[@]}"
    return 0
  fi
  [[ -f "$DATA_BIN/dict.$SRC.txt" ]] || die "no binarized data in $DATA_BIN (dict.$SRC.txt):" \
    "run examples/$TASK/prepare.sh first, or set DATA_DIR / DATA_BIN"

  # settings that define the run; GPUs / max-tokens / update-freq may change on resume
  local state
  state="$("${RECIPES[@]}" run-config --run-dir "$RUN_DIR" task="$TASK" scheme="$SCHEME" \
    scheme_flags="${SCHEME_FLAGS[*]}" optimizer_flags="${OPTIMIZER_FLAGS[*]}" \
    depth="$DEPTH" seed="$SEED" arch="$arch" \
    data_bin="$DATA_BIN" effective_batch="$effective" lr="$LR" warmup="$WARMUP" \
    dropout="$DROPOUT" attention_dropout="$ATTENTION_DROPOUT" \
    activation_dropout="$ACTIVATION_DROPOUT" weight_decay="$WEIGHT_DECAY" \
    length="${LENGTH[*]} ${STOP_FLAGS[*]}" precision="$PRECISION" \
    extra_args="${EXTRA_ARGS:-}")" || exit 2
  if [[ "$state" == resume ]]; then
    say "resuming the run in $RUN_DIR (fairseq continues from checkpoint_last.pt if present)"
  else
    say "new run in $RUN_DIR"
  fi
  if [[ "$rank0" == 1 ]]; then
    {
      printf '# %s host=%s launcher=%s NUM_GPUS=%s MAX_TOKENS=%s UPDATE_FREQ=%s\n' \
        "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(hostname)" "$launcher" "$num_gpus" \
        "$max_tokens" "$update_freq"
      show "${cmd[@]}"
    } >> "$RUN_DIR/commands.log"
    show "${cmd[@]}"
    "${cmd[@]}" 2>&1 | tee -a "$RUN_DIR/train.log"
  else
    show "${cmd[@]}"
    "${cmd[@]}"
  fi
}

# ---------------------------------------------------------------------------------------
# eval.sh
# ---------------------------------------------------------------------------------------
# The task's eval.sh sets TASK SRC TGT BEAM_DEFAULT LENPEN_DEFAULT UPPER_BOUND_DEFAULT (the
# last epoch the averaging may take, as Transformer-Clinic's eval_*.sh) SCORING (one line
# naming the published scoring the defaults follow) COMPOUND_SPLIT (0/1) LOWERCASE (0/1) and
# RUN_DIR, then calls recipe_eval.
recipe_eval() {
  [[ -d "$RUN_DIR" ]] || die "run folder $RUN_DIR does not exist"
  # a run of `train.sh kasai`: trained by updates (300k, past the tasks' epoch bounds), decoded
  # by Kasai et al. with beam 5, lenpen 1; they averaged the 5 epoch checkpoints of best dev
  # BLEU, which this script does not select (it averages the last AVG_LAST)
  if [[ -f "$RUN_DIR/recipe.json" ]] && grep -q '"scheme": "kasai"' "$RUN_DIR/recipe.json"; then
    UPPER_BOUND_DEFAULT=none; BEAM_DEFAULT=5; LENPEN_DEFAULT=1.0
    SCORING="a train.sh kasai run: last 10 epoch checkpoints averaged (no epoch bound), beam 5, lenpen 1, tokenized BLEU (Kasai et al. averaged the 5 epoch checkpoints of best dev BLEU)"
  fi
  DATA_DIR="$(realpath -m "${DATA_DIR:-$PWD/data/$TASK}")"
  DATA_BIN="$(realpath -m "${DATA_BIN:-$DATA_DIR/data-bin}")"
  local ref_dir="$DATA_DIR/ref"
  [[ -f "$ref_dir/test.tok.$TGT" && -f "$ref_dir/test.raw.$TGT" ]] || die "no test references" \
    "in $ref_dir (test.tok.$TGT, test.raw.$TGT): run examples/$TASK/prepare.sh, or set DATA_DIR"
  local avg_last="${AVG_LAST:-10}" eval_dir="$RUN_DIR/eval" checkpoint
  local bound="${CHECKPOINT_UPPER_BOUND:-$UPPER_BOUND_DEFAULT}"
  [[ "$avg_last" =~ ^[1-9][0-9]*$ ]] || die "AVG_LAST '$avg_last' must be a positive integer"
  [[ "$bound" == none || "$bound" =~ ^[1-9][0-9]*$ ]] || die "CHECKPOINT_UPPER_BOUND" \
    "'$bound' must be a positive epoch number, or none (no bound)"
  local beam="${BEAM:-$BEAM_DEFAULT}" lenpen="${LENPEN:-$LENPEN_DEFAULT}"
  if [[ "$avg_last" == 10 && "$bound" == "$UPPER_BOUND_DEFAULT" && "$beam" == "$BEAM_DEFAULT" &&
        "$lenpen" == "$LENPEN_DEFAULT" && -z "${CHECKPOINT:-}" ]]; then
    say "scoring as $SCORING"
  else
    say "scoring with other settings than $SCORING: AVG_LAST=$avg_last" \
        "CHECKPOINT_UPPER_BOUND=$bound BEAM=$beam LENPEN=$lenpen${CHECKPOINT:+ CHECKPOINT=$CHECKPOINT}"
  fi
  mkdir -p "$eval_dir"
  if [[ -n "${CHECKPOINT:-}" ]]; then
    checkpoint="$CHECKPOINT"
    say "== evaluating $checkpoint (CHECKPOINT given: no averaging)"
  else
    local avg=("$PY" -m fairseq_admin_pos.cli.average_checkpoints --inputs "$RUN_DIR"
               --num-epoch-checkpoints "$avg_last")
    if [[ "$bound" == none ]]; then
      checkpoint="$RUN_DIR/averaged_last${avg_last}.pt"
      say "== averaging the last $avg_last epoch checkpoints"
    else
      checkpoint="$RUN_DIR/averaged_last${avg_last}_upto${bound}.pt"
      say "== averaging the last $avg_last epoch checkpoints up to epoch $bound"
      avg+=(--checkpoint-upper-bound "$bound")
    fi
    run "${avg[@]}" --output "$checkpoint"
  fi
  local gen_flags=()
  case "${DEVICE:-gpu}" in
    cpu) gen_flags=(--cpu) ;;
    gpu) [[ "${EVAL_PRECISION:-fp32}" == fp16 ]] && gen_flags=(--fp16) ;;
    *) die "DEVICE '$DEVICE' is not valid; valid choices: gpu cpu" ;;
  esac
  local name; name="$(basename "$checkpoint" .pt)"
  local gen_out="$eval_dir/generate-test.$name.txt"
  say "== translating the test set (beam $beam, lenpen $lenpen)"
  local gen=("$FSBIN/fairseq-generate" "$DATA_BIN" --user-dir "$USER_DIR"
    --task translation --source-lang "$SRC" --target-lang "$TGT" --gen-subset test
    --path "$checkpoint" --beam "$beam" --lenpen "$lenpen"
    --remove-bpe --batch-size "${GEN_BATCH_SIZE:-128}" "${gen_flags[@]}"
    --required-batch-size-multiple 1)
  # ^ fairseq's batch_by_size drops a final batch whose size is not a multiple of
  #   --required-batch-size-multiple (default 8; fairseq#5036 on GitHub): up to 7 test
  #   sentences would go untranslated. The plugin's batching_fix repairs that too; with a
  #   multiple of 1 nothing depends on it, and `score` refuses an incomplete output.
  local gen_extra=()
  shell_words gen_extra GEN_EXTRA_ARGS
  gen+=("${gen_extra[@]}")
  show "${gen[@]}" ">" "$gen_out"
  "${gen[@]}" > "$gen_out.tmp"
  mv "$gen_out.tmp" "$gen_out"
  say "== BLEU"
  local score=("${RECIPES[@]}" score --generate-output "$gen_out" --tok-ref "$ref_dir/test.tok.$TGT"
    --raw-ref "$ref_dir/test.raw.$TGT" --lang "$TGT" --detok-output "$eval_dir/test.$name.detok.$TGT"
    --json "$eval_dir/bleu.$name.json")
  [[ "$COMPOUND_SPLIT" == 1 ]] && score+=(--compound-split)
  [[ "$LOWERCASE" == 1 ]] && score+=(--lowercase)
  run "${score[@]}"
}
