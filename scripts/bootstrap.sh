#!/usr/bin/env bash
# Install everything `make test` / `make demo` need into a project-local venv, idempotently.
#
#   torch        only where the venv cannot import it (torch==2.13.0: the CPU build; a bare
#                `torch` or a newer pin would pull a multi-GB CUDA build)
#   fairseq      ve-fairseq==0.12.3 (binary wheel of upstream main for cp311/cp312 x86_64) with
#                --no-deps, because its metadata asks for torchaudio, which replaces torch;
#                where no wheel fits, fairseq-fixed==0.12.3.1 (sdist, ~4 min to compile)
#   the rest     fairseq's real runtime needs by name, then this package editable with every
#                extra setup.py declares (its install_requires come with it).
#
# Re-running is cheap: a stamp holding the hash of the install inputs skips the work.
# Any failing step stops the script: it prints the command that failed, its exit status and
# its output (pip's error message), and exits with that status.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

TORCH_PIN="torch==2.13.0"
FAIRSEQ_WHEEL="ve-fairseq==0.12.3"
FAIRSEQ_SDIST="fairseq-fixed==0.12.3.1"
# Versions tested together (pip freeze of the venv the test suite passed in).
RUNTIME_PINS=(
  "hydra-core==1.3.8" "omegaconf==2.3.1" "numpy==2.4.6" "regex==2026.11.19"
  "sacrebleu==2.6.0" "tqdm==4.70.1" "bitarray==3.12.3" "cffi==2.1.1" "cython==3.3.1"
  "packaging==26.4" "scikit-learn==1.9.1"
  # tensorboardX (setup.py) asks only for protobuf>=3.20: the version the suite passed with
  "protobuf==7.36.2"
  # the deploy extra (fairseq-admin-export --ctranslate2): CPU wheels for cp311/cp312 x86_64
  "ctranslate2==4.8.5"
)

# A command that fails outside run() (set -e) still names itself before the script stops
# (in the main shell only: a failing $(...) is reported by the command that uses it).
on_error() {
  if (( BASH_SUBSHELL == 0 )); then
    echo "bootstrap: error: line $2: \`$3\` failed (exit status $1)" >&2
    exit "$1"
  fi
}
trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR

LOG="$(mktemp "${TMPDIR:-/tmp}/bootstrap.XXXXXX")"
trap 'rm -f "$LOG"' EXIT

# After a step succeeded: only pip's warnings and errors, without its note that ve-fairseq's
# metadata asks for torchaudio (fairseq is installed --no-deps on purpose: torchaudio would
# replace the CPU torch).
show_output() {
  sed -n -E -e "/torchaudio|pip's dependency resolver does not currently/d" \
    -e '/^(WARNING|ERROR|DEPRECATION)/p' "$LOG"
}

# fail STATUS CMD...: print the failed command and its output, and stop with STATUS.
fail() {
  local status="$1" lines
  shift
  lines="$(wc -l < "$LOG")"
  {
    printf 'bootstrap: error: this command failed (exit status %s):\n ' "$status"
    printf ' %q' "$@"
    if (( lines > 100 )); then
      printf '\nbootstrap: its output (the last 100 of %s lines):\n' "$lines"
    else
      printf '\nbootstrap: its output:\n'
    fi
    tail -n 100 "$LOG" | sed 's/^/  | /'
  } >&2
  exit "$status"
}

# run CMD...: one set-up step, its output kept in $LOG; pip's warnings are shown after it
# succeeded; if it fails, the command and its output are printed and the script stops.
run() {
  local status=0
  "$@" >"$LOG" 2>&1 || status=$?
  if (( status != 0 )); then fail "$status" "$@"; fi
  show_output
}

stamp="$VENV/.bootstrap-stamp"
want="$(cat scripts/bootstrap.sh setup.py pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
   && "$VENV/bin/python" -c "import fairseq_admin_pos" >/dev/null 2>&1; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  version_ok=0
  "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || version_ok=$?
  if (( version_ok != 0 )); then
    echo "bootstrap: error: Python >= 3.11 is required; PYTHON=$PYTHON is not (or does not" \
      "run). Set PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
  echo "bootstrap: creating virtual environment $VENV"
  run "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() { "$VENV/bin/python" -c "$1" >/dev/null 2>&1; }

if torch_version="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
then
  echo "bootstrap: torch present ($torch_version)"
else
  echo "bootstrap: installing $TORCH_PIN"
  run "${PIP[@]}" install "$TORCH_PIN"
fi

run "${PIP[@]}" install "${RUNTIME_PINS[@]}" setuptools wheel

if quiet "import fairseq, fairseq.models.transformer"; then
  echo "bootstrap: fairseq present"
else
  echo "bootstrap: installing $FAIRSEQ_WHEEL (--no-deps)"
  wheel_status=0
  "${PIP[@]}" install --no-deps --only-binary=:all: "$FAIRSEQ_WHEEL" >"$LOG" 2>&1 \
    || wheel_status=$?
  if (( wheel_status == 0 )); then
    show_output
  else
    echo "bootstrap: $FAIRSEQ_WHEEL did not install (exit status $wheel_status: $(tail -n 1 "$LOG"))"
    echo "bootstrap: building $FAIRSEQ_SDIST instead (~4 min)"
    run "${PIP[@]}" install --no-deps --no-build-isolation "$FAIRSEQ_SDIST"
  fi
fi

# every extra setup.py declares (test, data, plot, ...): read from its extras_require
extras="$("$VENV/bin/python" - <<'PY'
import ast
import sys

tree = ast.parse(open("setup.py", encoding="utf-8").read(), "setup.py")
calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
         and getattr(n.func, "id", getattr(n.func, "attr", None)) == "setup"]
found = [kw.value for call in calls for kw in call.keywords if kw.arg == "extras_require"]
if not found:
    sys.exit(0)
if not (isinstance(found[0], ast.Dict)
        and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in found[0].keys)):
    sys.exit("setup.py: extras_require is not a dict with literal names; scripts/bootstrap.sh "
             "reads the extras' names from it")
print(",".join(k.value for k in found[0].keys))
PY
)"
target="."
[[ -z "$extras" ]] || target=".[$extras]"
echo "bootstrap: installing fairseq-admin-pos (editable${extras:+, extras $extras})"
run "${PIP[@]}" install --no-build-isolation -e "$target"
run "$VENV/bin/python" -c "import fairseq_admin_pos"
echo "$want" > "$stamp"
echo "bootstrap: done ($VENV)"
