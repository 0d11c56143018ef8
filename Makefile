# Branchwise: make install && make apply && make test
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SGLANG := sglang==0.5.23
TORCH := torch==2.14.1
TORCHVISION := torchvision==0.29.1
ROUTER := sglang-router==0.3.2
MODEL ?= models/tiny
HOST ?= 127.0.0.1
PORT ?= 30000
POLICY ?= taper
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.branchwise-installed
CPU_ENV := SGLANG_USE_CPU_ENGINE=1 TORCHDYNAMO_DISABLE=1
SERVE_ARGS := --model-path $(MODEL) --host $(HOST) --port $(PORT) --branch-policy $(POLICY)

.PHONY: install apply revert check-apply tiny-model serve serve-cluster demo test test-unit bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml overlay/branchwise/cpu_compat/requirements-cpu.txt
	test -x $(PY) || python3.11 -m venv $(VENV)
ifeq ($(GPU),1)
	@echo "== NVIDIA GPU found: normal sglang install (flashinfer included)"
	$(PIP) install -q -e '.[dev]'
else
	@echo "== no GPU: CPU recipe (torch, sglang --no-deps, import closure, sgl_kernel stand-in)"
	$(PIP) install -q $(TORCH)
	$(PIP) install -q --no-deps $(SGLANG) $(TORCHVISION)
	$(PIP) install -q -r overlay/branchwise/cpu_compat/requirements-cpu.txt
	$(PIP) install -q --no-deps -e .
	$(PIP) install -q pytest pytest-timeout hypothesis ruff matplotlib tqdm
	$(PIP) install -q --no-deps $(ROUTER)  # its dependencies are in the import closure above
	echo "$(CURDIR)/overlay/branchwise/cpu_compat" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/branchwise_cpu_compat.pth"
endif
	@# unchanged SGLang frontend programs get Branchwise's fork hook (lazy; BRANCHWISE_FRONTEND_HOOK=0 opts out)
	echo "import os; os.environ.get('BRANCHWISE_FRONTEND_HOOK', '1') == '0' or __import__('branchwise.frontend_hook').frontend_hook.install()" \
		> "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/branchwise_frontend.pth"
	touch $(STAMP)

apply: install
	$(PY) -m branchwise.patcher apply --patches patches/sglang-0.5.23

revert: install
	$(PY) -m branchwise.patcher revert --patches patches/sglang-0.5.23

check-apply: install
	$(PY) -m branchwise.patcher check --patches patches/sglang-0.5.23

tiny-model: $(MODEL)/config.json

$(MODEL)/config.json: overlay/branchwise/tiny_model.py
	$(PY) -m branchwise.tiny_model $(MODEL)

ifeq ($(GPU),1)
serve: apply
	$(PY) -m sglang.launch_server $(SERVE_ARGS)
else
serve: apply tiny-model
	$(CPU_ENV) $(PY) -m sglang.launch_server $(SERVE_ARGS) --device cpu --attention-backend torch_native \
		--dtype float32 --max-total-tokens 16384 --sleep-on-idle
endif

# make serve-cluster: one Branchwise server per WORKER_PORTS behind sglang-router's cache-aware
# routing on $(PORT) (README, "Scale-out"); on a GPU machine worker i uses GPU i. Ctrl-C stops them all.
WORKER_PORTS ?= 30001 30002
WORKER_ARGS ?=
ifeq ($(GPU),1)
WORKER_CMD := $(PY) -m sglang.launch_server
else
WORKER_CMD := $(CPU_ENV) OMP_NUM_THREADS=1 $(PY) -m sglang.launch_server --device cpu --attention-backend torch_native \
	--dtype float32 --max-total-tokens 16384 --sleep-on-idle
endif

serve-cluster: apply tiny-model
	@trap 'kill 0' EXIT; \
	gpu=0; for port in $(WORKER_PORTS); do \
		$(WORKER_CMD) --model-path $(MODEL) --host $(HOST) --port $$port --branch-policy $(POLICY) \
			$(if $(GPU),--base-gpu-id $$gpu) $(WORKER_ARGS) & gpu=$$((gpu + 1)); \
	done; \
	$(PY) -m sglang_router.launch_router --host $(HOST) --port $(PORT) --policy cache_aware \
		--worker-startup-check-interval 2 --worker-urls $(foreach p,$(WORKER_PORTS),http://$(HOST):$(p))

demo: apply tiny-model
	$(PY) -m bench.demo --model $(MODEL)

test: apply
	$(PY) -m pytest tests -q

test-unit:
	$(PY) -m pytest tests/unit -q

# make bench: off/eager/taper at six loads from a probe of this machine (docs/benchmarks.md):
# loads 0.1-1.0 of the fluid bound at the probed SLO, every policy at every load, one run (~20 min on
# 2 cores). BENCH_ARGS adds or overrides flags of bench.sweep, e.g. BENCH_ARGS="--seed 1".
bench: apply tiny-model
	$(PY) -m bench.sweep --launch --model $(MODEL) --policies off,eager,taper --out runs/bench --no-progress \
		$(BENCH_ARGS)

lint:
	$(VENV)/bin/ruff check overlay bench frontends tests

clean:
	rm -rf $(VENV) models runs
