# Two entry points for a new machine (see README): `make demo` and `make test`.
# Both create .venv on first use; torch is installed only when missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast test-slow test-compat lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py moc/checkpoint/twolevel/memory/streamcopy.c scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# moc is installed in $(VENV), not on the PATH: the last lines say how to run it.
demo: setup
	$(PY) -m moc demo
	@echo
	@echo "Next (moc is in $(VENV)/bin, not on your PATH):"
	@echo "  $(VENV)/bin/moc inspect runs/demo/ckpt   # steps, bytes, experts each step saved"
	@echo "  $(VENV)/bin/moc verify runs/demo/ckpt    # every checksum and size"
	@echo "  source $(VENV)/bin/activate              # then plain moc: moc --help"

# Two test workers (pytest-xdist), a file each at a time: the suite's processes wait on
# each other and on imports as much as they compute (21 min against 29 on the 2-core VM).
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(XDIST)

# The unit tier, for your own feedback loop (about 2 minutes on the 2-core VM): every test but those that
# start real processes (integration) and the crash sweep (slow).
test-fast: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(XDIST) -m "not slow and not integration"

# One worker: the sweeps time faults against each other's processes.
test-slow: setup
	$(PY) -m pytest -q -m slow

# moc on the oldest torch it supports (pyproject.toml's torch>=X), in .compat/venv: a
# `moc train` with a SIGKILL and restart, and the smoke tests (scripts/test_compat.sh).
# Not part of `make test`: the first run downloads about 3.7 GB of CUDA wheels.
test-compat:
	bash scripts/test_compat.sh

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .compat build *.egg-info runs
