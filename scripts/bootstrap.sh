#!/usr/bin/env bash
# Install everything `make test` / `make demo` need into a project-local venv, idempotently.
#
#   torch        only where the venv cannot import it (torch==2.13.0: the CPU build; a bare
#                `torch` or a newer pin would pull a multi-GB CUDA build)
#   fairseq      ve-fairseq==0.12.3 (binary wheel of upstream main for cp311/cp312 x86_64) with
#                --no-deps, because its metadata asks for torchaudio, which replaces torch;
#                where no wheel fits, fairseq-fixed==0.12.3.1 (sdist, ~4 min to compile)
#   the rest     fairseq's real runtime needs by name, then this package editable with extras.
#
# Re-running is cheap: a stamp holding the hash of the install inputs skips the work.
set -euo pipefail

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
)

stamp="$VENV/.bootstrap-stamp"
want="$(cat scripts/bootstrap.sh setup.py pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
   && "$VENV/bin/python" -c "import fairseq_admin_pos" >/dev/null 2>&1; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" - <<'PY' || { echo "bootstrap: Python >= 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
  echo "bootstrap: creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet() { "$VENV/bin/python" -c "$1" >/dev/null 2>&1; }

if quiet "import torch"; then
  echo "bootstrap: torch present ($("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
else
  echo "bootstrap: installing $TORCH_PIN"
  "${PIP[@]}" install -q "$TORCH_PIN"
fi

"${PIP[@]}" install -q "${RUNTIME_PINS[@]}" setuptools wheel

if quiet "import fairseq, fairseq.models.transformer"; then
  echo "bootstrap: fairseq present"
else
  echo "bootstrap: installing $FAIRSEQ_WHEEL (--no-deps)"
  if ! "${PIP[@]}" install -q --no-deps --only-binary=:all: "$FAIRSEQ_WHEEL"; then
    echo "bootstrap: no $FAIRSEQ_WHEEL wheel fits this platform; building $FAIRSEQ_SDIST (~4 min)"
    "${PIP[@]}" install -q --no-deps --no-build-isolation "$FAIRSEQ_SDIST"
  fi
fi

echo "bootstrap: installing fairseq-admin-pos (editable, extras test,data,plot)"
"${PIP[@]}" install -q --no-build-isolation -e ".[test,data,plot]" 2>&1 | grep -v "torchaudio" || true
"$VENV/bin/python" -c "import fairseq_admin_pos" >/dev/null
echo "$want" > "$stamp"
echo "bootstrap: done ($VENV)"
