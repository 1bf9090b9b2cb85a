# The two commands of README.md. Both install what they need into .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
MULTI30K ?= ../shared/data/multi30k
DEMO_OUT ?= demo_out
# the residual scheme the demo trains: admin, post-ln, pre-ln, admin-paper, deepnorm
SCHEME ?= admin
# where the demo trains and translates: auto (the GPU when torch sees one), cpu or cuda
DEVICE ?= auto

# make gpu-check: the machine's own python3 (no venv, nothing installed); the report folder,
# and a binarized en-de set (default: demo_out/data-bin when make demo made it, else synthetic)
GPU_CHECK_OUT ?= gpu_check_out
GPU_CHECK_DATA ?=

.PHONY: install test demo gpu-check

install:
	@bash scripts/bootstrap.sh

# --dist loadfile: a test file runs on one worker, so each module fixture (a training run the
# file's tests read) runs once. (--dist loadgroup's xdist_group marks do nothing with pytest 9.2
# and xdist 3.8: xdist tags the node id through an attribute pytest 9 no longer reads.)
# --no-loadscope-reorder: the files go out in tests/conftest.py's order, those with a test
# marked slow first, so that no long file is left to run alone at the end (docs/tests.md).
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 tests

demo: install
	$(PY) -m fairseq_admin_pos.cli.demo --data $(MULTI30K) --out $(DEMO_OUT) --scheme $(SCHEME) --device $(DEVICE)

gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" python3 -m fairseq_admin_pos.cli.gpu_check \
		--out $(GPU_CHECK_OUT) $(if $(GPU_CHECK_DATA),--data $(GPU_CHECK_DATA))
