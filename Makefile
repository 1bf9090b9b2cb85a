# The two commands of README.md. Both install what they need into .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
MULTI30K ?= ../shared/data/multi30k
DEMO_OUT ?= demo_out

.PHONY: install test demo

install:
	@bash scripts/bootstrap.sh

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadgroup tests

demo: install
	$(PY) -m fairseq_admin_pos.cli.demo --data $(MULTI30K) --out $(DEMO_OUT)
