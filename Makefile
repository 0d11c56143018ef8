# Branchwise: make install && make apply && make test
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SGLANG := sglang==0.5.23
TORCH := torch==2.14.1
TORCHVISION := torchvision==0.29.1
ROUTER := smg==1.13.0
PYTHON ?= python3.11
TINY_MODEL := models/tiny
MODEL ?= $(TINY_MODEL)
HOST ?= 127.0.0.1
PORT ?= 30000
POLICY ?= stock
# GPU or CPU is decided when a recipe runs, never when make reads this file (a `docker build` sees no
# GPU). CUDA 13 (torch 2.14.1, flashinfer cu13) needs NVIDIA driver >= MIN_DRIVER.
HAS_GPU := nvidia-smi -L >/dev/null 2>&1
MIN_DRIVER := 580
STAMP := $(VENV)/.branchwise-installed
CPU_ENV := SGLANG_USE_CPU_ENGINE=1 TORCHDYNAMO_DISABLE=1
CPU_SERVE_ARGS := --device cpu --attention-backend torch_native --dtype float32 --max-total-tokens 16384 \
	--sleep-on-idle
SERVE_ARGS := --model-path $(MODEL) --host $(HOST) --port $(PORT) --branch-policy $(POLICY)
# the tiny model is built when MODEL is it; a MODEL you set is yours to provide
MODEL_PREREQ := $(if $(filter $(TINY_MODEL),$(MODEL)),tiny-model)

.PHONY: install sglang-cpu check-driver apply revert check-apply tiny-model serve serve-cluster demo test test-unit prometheus bench bench-seeds bench-albireo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml overlay/branchwise/cpu_compat/requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# $(ROUTER) is the router of make serve-cluster (grpcio, pyyaml, setproctitle come with it)
	if $(HAS_GPU); then \
		echo "== NVIDIA GPU found: normal sglang install (flashinfer included)"; \
		$(CHECK_DRIVER) && $(PIP) install -q -e '.[sglang,dev]'; \
	else \
		echo "== no GPU: CPU recipe (torch, sglang --no-deps, import closure, sgl_kernel stand-in)"; \
		$(SGLANG_CPU) && $(PIP) install -q --no-deps -e . \
		&& $(PIP) install -q pytest pytest-timeout hypothesis ruff matplotlib tqdm $(ROUTER); \
	fi
	touch $(STAMP)

# sglang 0.5.23 alone on a CPU-only machine (make install's CPU recipe; tests/integration/test_install.py
# puts Branchwise on top with pip): torch, sglang --no-deps, its import closure, the sgl_kernel stand-in
SGLANG_CPU = $(PIP) install -q $(TORCH) && $(PIP) install -q --no-deps $(SGLANG) $(TORCHVISION) \
	&& $(PIP) install -q -r overlay/branchwise/cpu_compat/requirements-cpu.txt \
	&& echo "$(CURDIR)/overlay/branchwise/cpu_compat" \
		> "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/branchwise_cpu_compat.pth"

sglang-cpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(SGLANG_CPU)

# the CUDA 13 stack installs on an older driver and fails only when a kernel launches: refuse first
CHECK_DRIVER = { v=$$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' '); \
	major=$${v%%.*}; case "$$major" in ''|*[!0-9]*) major=0;; esac; \
	if [ "$$major" -lt $(MIN_DRIVER) ]; then \
		echo "error: NVIDIA driver '$$v' (from nvidia-smi): sglang 0.5.23's CUDA 13 stack (torch 2.14.1," \
			"flashinfer cu13) needs driver >= $(MIN_DRIVER); upgrade the driver, then rerun make install" >&2; \
		false; else echo "== NVIDIA driver $$v (CUDA 13 needs >= $(MIN_DRIVER))"; fi; }

check-driver:
	@$(CHECK_DRIVER)

apply: install
	$(PY) -m branchwise.patcher apply --patches patches/sglang-0.5.23

revert: install
	$(PY) -m branchwise.patcher revert --patches patches/sglang-0.5.23

check-apply: install
	$(PY) -m branchwise.patcher check --patches patches/sglang-0.5.23

tiny-model: $(MODEL)/config.json

$(MODEL)/config.json: overlay/branchwise/tools/tiny_model.py
	$(PY) -m branchwise.tools.tiny_model $(MODEL)

serve: apply $(MODEL_PREREQ)
	if $(HAS_GPU); then \
		$(PY) -m sglang.launch_server $(SERVE_ARGS); \
	else \
		$(CPU_ENV) $(PY) -m sglang.launch_server $(SERVE_ARGS) $(CPU_SERVE_ARGS); \
	fi

# make serve-cluster: one Branchwise server per WORKER_PORTS behind an smg router on $(PORT) (README,
# "Scale-out"); on a GPU machine worker i uses GPU i. Ctrl-C stops them all. ROUTER_ARGS are
# branchwise.tools.launch.ROUTER_ARGS (a unit test keeps them equal): a request with an X-SMG-Routing-Key
# header goes to its key's worker and never spills, so a phase stays on one worker.
WORKER_PORTS ?= 30001 30002
WORKER_ARGS ?=
ROUTER_METRICS_PORT ?= 29000
ROUTER_ARGS := --policy prefix_hash --prefix-hash-load-factor 1000000 --disable-worker-overload-protection \
	--disable-tokenizer-autoload --worker-startup-check-interval 1

serve-cluster: apply $(MODEL_PREREQ)
	@trap 'kill 0' EXIT; \
	if $(HAS_GPU); then gpu=0; worker="$(PY) -m sglang.launch_server"; \
	else gpu=; worker="env $(CPU_ENV) OMP_NUM_THREADS=1 $(PY) -m sglang.launch_server $(CPU_SERVE_ARGS)"; fi; \
	for port in $(WORKER_PORTS); do \
		$$worker --model-path $(MODEL) --host $(HOST) --port $$port --branch-policy $(POLICY) \
			--enable-metrics $${gpu:+--base-gpu-id $$gpu} $(WORKER_ARGS) & gpu=$${gpu:+$$((gpu + 1))}; \
	done; \
	$(PY) -m smg launch --host $(HOST) --port $(PORT) --prometheus-host $(HOST) \
		--prometheus-port $(ROUTER_METRICS_PORT) $(ROUTER_ARGS) \
		--worker-urls $(foreach p,$(WORKER_PORTS),http://$(HOST):$(p))

demo: apply tiny-model
	$(PY) -m bench.demo --model $(MODEL)

test: apply prometheus
	$(PY) -m pytest tests -q

# Debian's prometheus, which tests/integration/test_prometheus.py runs: installed when missing and we
# are root; otherwise said here, and that test skips (fails under CI=true).
prometheus:
	@command -v prometheus >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; \
		else echo "prometheus is not installed (and this is not a root shell with apt-get):" \
			"tests/integration/test_prometheus.py will skip (fail under CI=true); sudo apt-get install prometheus"; fi; }

test-unit:
	$(PY) -m pytest tests/unit -q

# make bench: serial/eager/taper at six loads from a probe of this machine (docs/benchmarks.md):
# loads 0.1-1.0 of the fluid bound at the probed SLO, every policy at every load, capacity, latency
# and the two-axis verdict (~20 min on 2 cores). make bench-seeds: the same loads over seeds 0,1,2,
# each seed's verdict and the verdict on the means (~1 h). BENCH_ARGS adds or overrides bench.sweep
# flags, e.g. BENCH_ARGS="--slo-scale 0.7 --out runs/bench-slo0.7".
bench: apply tiny-model
	$(PY) -m bench.sweep --launch --model $(MODEL) --policies serial,eager,taper --out runs/bench --no-progress \
		$(BENCH_ARGS)

bench-seeds: apply tiny-model
	$(PY) -m bench.sweep --launch --model $(MODEL) --policies serial,eager,taper --seeds 0,1,2 \
		--out runs/bench-seeds --no-progress $(BENCH_ARGS)

# make bench-albireo: stock SGLang against stock with --async-output (Albireo) on an emulated device
# (DEVICE, a preset or JSON file, issue 36) at fixed loads of the preset's fluid bound: throughput,
# overruns and the scheduler's exposed time per step per point (docs/benchmarks.md, "Results:
# emulated device"). The CPU forward thread does not run under --emulate-device (refused at start).
DEVICE ?= a100-qwen3-32b-tp8
bench-albireo: apply tiny-model
	$(PY) -m bench.sweep --launch --model $(MODEL) --policies stock --variant async-output=stock:--async-output \
		--emulate-device $(DEVICE) --loads 0.25,0.5,0.75,1.0 --out runs/bench-albireo --no-progress $(BENCH_ARGS)

lint:
	$(VENV)/bin/ruff check overlay bench frontends tests

clean:
	rm -rf $(VENV) models runs
