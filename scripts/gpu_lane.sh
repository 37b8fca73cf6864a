#!/usr/bin/env bash
# The GPU lane: one unattended run on a lent single-GPU machine (PyTorch with CUDA, no network),
# sized to finish within 10 minutes (docs/benchmarks.md, "GPU lane"). Steps, each under its own
# time limit, all inside one budget (DCR_LANE_BUDGET_S, default 540 s: a step gets what is left):
#   env     python --version, torch, CUDA device, memory (printed; in summary.json)
#   wheels  installs what the machine lacks, offline, from the wheelhouse (scripts/gpu_wheels.py;
#           only modules that are missing, into a --target folder put first on PYTHONPATH); a
#           Python version the wheelhouse has no wheel for fails here, naming the wheel
#   owner   the real DCRHook on a megatron-core GPT model on CUDA, torch.distributed on NCCL at
#           world size 1, two optimizer steps, checked bit for bit (dcr_tools/bench/gpu_owner.py)
#   tests   pytest tests/integration/test_gpu_lane.py: detection, the direct scatter and the
#           intercepted apply into CUDA parameters (its cpu cases too, as a control)
#   detect  DeviceScan against the device's copy bandwidths, the host path, the scatter
#           (dcr_tools/bench/device.py, a BF16 tensor of up to 2^30 elements; extra arguments
#           of this script go to it)
#   codec   `dcr bench codec` (dcr_tools/bench/codec.py, its default sizes: about 10 s on a
#           2-core CPU machine) on the device machine's CPU
# Without CUDA it says so and runs the CPU modes instead (owner --device cpu, detect on a small
# host tensor, the tests' cpu cases, the codec): a check of the code paths, no GPU figure; with
# DCR_REQUIRE_CUDA=1 a machine without CUDA fails the lane instead.
#
# Before a device run, here (with network): `make gpu-wheelhouse` (out/gpu_wheelhouse, about
# 40 MiB for Python 3.12 and 3.11), then run `bash scripts/gpu_lane.sh` there with
# out/gpu_wheelhouse carried (docs/benchmarks.md, "Running it").
#
# Environment: DCR_PYTHON (default .venv/bin/python, else python3), OUT (default out/gpu_lane),
# DCR_WHEELHOUSE (default out/gpu_wheelhouse), DCR_GPU_SITE (the install folder, default
# /tmp/dcr-gpu-lane-site-<python>), DCR_LANE_BUDGET_S, DCR_REQUIRE_CUDA.
# Writes to $OUT (six files): summary.json, lane.log, owner.json, pytest.txt, device.json,
# codec.json. Exit status: 0 when every step passed and every program's checks held (without
# CUDA: in the CPU modes, unless DCR_REQUIRE_CUDA=1), else 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY="${DCR_PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="${OUT:-out/gpu_lane}"
WHEELHOUSE="${DCR_WHEELHOUSE:-out/gpu_wheelhouse}"
BUDGET="${DCR_LANE_BUDGET_S:-540}"
mkdir -p "$OUT"
# a step that fails before writing its file must not leave an earlier run's file to be read
rm -f "$OUT"/{summary.json,owner.json,pytest.txt,device.json,codec.json}
: >"$OUT/lane.log"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

log() { echo "[gpu-lane] $*" | tee -a "$OUT/lane.log"; }

# step NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, what is left of the budget), its output
# to the console and lane.log; records name, status, exit code and seconds for the summary
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START) - 5))
  if [ "$left" -lt 15 ]; then
    log "== $name: SKIPPED, no time left in the ${BUDGET} s budget"
    echo "$name no-time -1 0" >>"$SCRATCH/steps"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "== $name (limit ${limit} s): $*"
  local t0 t1 rc status
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/lane.log" ${STEP_TEE:+"$STEP_TEE"}
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  log "== $name: $status (exit $rc, $secs s)"
  echo "$name $status $rc $secs" >>"$SCRATCH/steps"
}

log "python: $PY ($("$PY" --version 2>&1)); budget ${BUDGET} s; results in $OUT"
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
SITE="${DCR_GPU_SITE:-/tmp/dcr-gpu-lane-site-$PYVER}"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

step env 60 "$PY" - "$SCRATCH/env.json" <<'EOF'
import json, os, platform, sys
env = {"python": sys.version.split()[0], "executable": sys.executable,
       "platform": platform.platform(), "cpus": os.cpu_count()}
try:
    import torch
    env["torch"] = torch.__version__
    env["cuda"] = torch.cuda.is_available()
    if env["cuda"]:
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, capability=f"{p.major}.{p.minor}",
                   device_memory_gib=round(p.total_memory / 2**30, 1),
                   cuda_runtime=torch.version.cuda,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
except Exception as e:  # reported, and every later step says what it lacks
    env["torch_error"] = f"{type(e).__name__}: {e}"
    env["cuda"] = False
for k, v in env.items():
    print(f"[gpu-lane] {k}: {v}")
json.dump(env, open(sys.argv[1], "w"))
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/[gpu-lane] nvidia-smi: /' | tee -a "$OUT/lane.log"
fi
summary() {
  "$PY" scripts/gpu_lane_summary.py --steps "$SCRATCH/steps" --env "$SCRATCH/env.json" \
    --junit "$SCRATCH/junit.xml" --out "$OUT" --cuda "$CUDA" --seconds "$(($(date +%s) - START))" \
    2>&1 | tee -a "$OUT/lane.log"
  exit "${PIPESTATUS[0]}"
}
CUDA=0
if ! "$PY" -c 'import torch' 2>/dev/null; then
  log "$PY cannot import torch: every step needs PyTorch (set DCR_PYTHON to the one that has it)"
  echo "torch failed 1 0" >>"$SCRATCH/steps"
  summary
fi
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && CUDA=1
if [ "$CUDA" = 0 ] && [ "${DCR_REQUIRE_CUDA:-0}" = 1 ]; then
  log "no CUDA device (torch.cuda.is_available() is False) and DCR_REQUIRE_CUDA=1: the lane fails"
  echo "cuda failed 1 0" >>"$SCRATCH/steps"
  summary
fi
if [ "$CUDA" = 0 ]; then
  log "no CUDA device (torch.cuda.is_available() is False): CPU modes only, no GPU figure"
fi

step wheels 90 "$PY" scripts/gpu_wheels.py install --wheelhouse "$WHEELHOUSE" --target "$SITE"

if [ "$CUDA" = 1 ]; then
  step owner 150 "$PY" -m dcr_tools.bench.gpu_owner --device cuda --json "$OUT/owner.json"
else
  step owner 150 "$PY" -m dcr_tools.bench.gpu_owner --device cpu --json "$OUT/owner.json"
fi

: >"$OUT/pytest.txt"
STEP_TEE="$OUT/pytest.txt" step tests 120 "$PY" -m pytest -p no:cacheprovider -ra -q \
  -o timeout=100 --junit-xml="$SCRATCH/junit.xml" tests/integration/test_gpu_lane.py

if [ "$CUDA" = 1 ]; then
  step detect 180 "$PY" -m dcr_tools.bench.device --device cuda --elements auto \
    --json "$OUT/device.json" "$@"
else
  step detect 180 "$PY" -m dcr_tools.bench.device --device cpu --elements $((1 << 22)) \
    --scan-chunks 65536,1048576 --json "$OUT/device.json" "$@"
fi

step codec 90 "$PY" -m dcr_tools.cli bench codec --json "$OUT/codec.json"

summary
