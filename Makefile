# Branchwise: make install && make apply && make test
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SGLANG := sglang==0.5.23
TORCH := torch==2.14.1
TORCHVISION := torchvision==0.29.1
ROUTER := smg==1.13.0
MODEL ?= models/tiny
HOST ?= 127.0.0.1
PORT ?= 30000
POLICY ?= taper
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.branchwise-installed
CPU_ENV := SGLANG_USE_CPU_ENGINE=1 TORCHDYNAMO_DISABLE=1
SERVE_ARGS := --model-path $(MODEL) --host $(HOST) --port $(PORT) --branch-policy $(POLICY)

.PHONY: install apply revert check-apply tiny-model serve serve-cluster demo test test-unit bench bench-seeds lint clean

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
	$(PIP) install -q $(ROUTER)  # the router of make serve-cluster (grpcio, pyyaml, setproctitle come with it)
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

# make serve-cluster: one Branchwise server per WORKER_PORTS behind an smg router on $(PORT) (README,
# "Scale-out"); on a GPU machine worker i uses GPU i. Ctrl-C stops them all. ROUTER_ARGS are
# branchwise.launch.ROUTER_ARGS (a unit test keeps them equal): a request with an X-SMG-Routing-Key
# header goes to its key's worker and never spills, so a phase stays on one worker.
WORKER_PORTS ?= 30001 30002
WORKER_ARGS ?=
ROUTER_METRICS_PORT ?= 29000
ROUTER_ARGS := --policy prefix_hash --prefix-hash-load-factor 1000000 --disable-worker-overload-protection \
	--disable-tokenizer-autoload --worker-startup-check-interval 1
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
			--enable-metrics $(if $(GPU),--base-gpu-id $$gpu) $(WORKER_ARGS) & gpu=$$((gpu + 1)); \
	done; \
	$(PY) -m smg launch --host $(HOST) --port $(PORT) --prometheus-host $(HOST) \
		--prometheus-port $(ROUTER_METRICS_PORT) $(ROUTER_ARGS) \
		--worker-urls $(foreach p,$(WORKER_PORTS),http://$(HOST):$(p))

demo: apply tiny-model
	$(PY) -m bench.demo --model $(MODEL)

test: apply
	$(PY) -m pytest tests -q

test-unit:
	$(PY) -m pytest tests/unit -q

# make bench: off/eager/taper at six loads from a probe of this machine (docs/benchmarks.md):
# loads 0.1-1.0 of the fluid bound at the probed SLO, every policy at every load, capacity, latency
# and the two-axis verdict (~20 min on 2 cores). make bench-seeds: the same loads over seeds 0,1,2,
# each seed's verdict and the verdict on the means (~1 h). BENCH_ARGS adds or overrides bench.sweep
# flags, e.g. BENCH_ARGS="--slo-scale 0.7 --out runs/bench-slo0.7".
bench: apply tiny-model
	$(PY) -m bench.sweep --launch --model $(MODEL) --policies off,eager,taper --out runs/bench --no-progress \
		$(BENCH_ARGS)

bench-seeds: apply tiny-model
	$(PY) -m bench.sweep --launch --model $(MODEL) --policies off,eager,taper --seeds 0,1,2 \
		--out runs/bench-seeds --no-progress $(BENCH_ARGS)

lint:
	$(VENV)/bin/ruff check overlay bench frontends tests

clean:
	rm -rf $(VENV) models runs
