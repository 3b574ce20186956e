# dcpserve developer commands. `make test` works on a fresh clone with nothing installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two workers: the Triton interpreter is single-threaded Python, so the suite scales with cores.
PYTEST_ARGS ?= -n auto --dist loadgroup

.PHONY: test install bench-kernels clean

# The stamp file re-runs the install when pyproject.toml changes or a top-level package appears (the editable
# install's finder lists packages by name).
$(VENV)/.installed: pyproject.toml $(wildcard */__init__.py)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

bench-kernels: $(VENV)/.installed
	$(PY) bench/kernels.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The embedded default on this machine: a local Ray head with logical GPUs, the tiny model, TP=2 x DCP=2, served at
# http://127.0.0.1:$(DCPSERVE_PORT)/v1. Ctrl-C stops what it started. Variables: see deployments/local_cluster.py.
.PHONY: serve
DCPSERVE_PORT ?= 8000
serve: $(VENV)/.installed
	DCPSERVE_PORT=$(DCPSERVE_PORT) $(PY) -m deployments.local_cluster
