#!/usr/bin/env bash
# The GPU lane on a device machine (docs/benchmarks.md, "GPU lane"): the `gpu` tests, then a
# short timing of detection and the direct scatter on CUDA (dcr_tools/bench/device.py).
# Python: $DCR_PYTHON, else .venv/bin/python, else python3 (with the repository on PYTHONPATH);
# it needs torch with CUDA, numpy, numba, zstandard and pytest. Results go to $OUT (default
# out/gpu_lane): pytest.txt, gpu_lane.json. Exit status: the tests' (0 when they all pass).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${DCR_PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="${OUT:-out/gpu_lane}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "[gpu-lane] python: $PY"
if ! "$PY" -c 'import sys, torch; print("[gpu-lane] torch", torch.__version__, "| CUDA:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"); sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "[gpu-lane] no CUDA device: the gpu tests below are skipped (reason shown) and nothing is timed"
fi
"$PY" -m pytest -m gpu -ra -p no:cacheprovider tests/integration/test_gpu_lane.py 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
"$PY" -m dcr_tools.bench.device --json "$OUT/gpu_lane.json" "$@"
exit "$rc"
