# The two commands of README.md. Both install what they need into .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
MULTI30K ?= ../shared/data/multi30k
DEMO_OUT ?= demo_out
# the residual scheme the demo trains: admin, post-ln, pre-ln, admin-paper, deepnorm
SCHEME ?= admin
# where the demo trains and translates: auto (the GPU when torch sees one), cpu or cuda
DEVICE ?= auto

.PHONY: install test demo

install:
	@bash scripts/bootstrap.sh

# --dist loadfile: a test file runs on one worker, so each module fixture (a training run the
# file's tests read) runs once. (--dist loadgroup's xdist_group marks do nothing with pytest 9.2
# and xdist 3.8: xdist tags the node id through an attribute pytest 9 no longer reads.)
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile --durations=15 tests

demo: install
	$(PY) -m fairseq_admin_pos.cli.demo --data $(MULTI30K) --out $(DEMO_OUT) --scheme $(SCHEME) --device $(DEVICE)
