# dcpserve developer commands. `make test` works on a fresh clone with nothing installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two workers: the Triton interpreter is single-threaded Python, so the suite scales with cores.
PYTEST_ARGS ?= -n auto --dist loadgroup

.PHONY: test install bench-kernels clean

# The stamp file re-runs the install whenever pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
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
