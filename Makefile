# Two entry points for a new machine (see README): `make demo` and `make test`.
# Both create .venv on first use; torch is installed only when missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast test-slow lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py moc/checkpoint/twolevel/streamcopy.c scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

demo: setup
	$(PY) -m moc demo

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The unit tier, for your own feedback loop (about a minute): every test but those that
# start real processes (integration) and the crash sweep (slow).
test-fast: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow and not integration"

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info runs
