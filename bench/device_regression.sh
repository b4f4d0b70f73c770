#!/usr/bin/env bash
# One GPU machine, one tree: the figures issue 20 guards against regression, in one device call.
#   STEP=1 MODE=persistent bench/device_regression.sh   # bare step (gpu_host.py) + persistent serving
#   STEP=0 MODE=host bench/device_regression.sh         # host serving only
# Serving: saturation (1,000 ShareGPT-shaped requests at once), 300 at once isolated, 300 at once under 24
# interfering threads; gateway on cores 14-15 (bench/device_serving.sh). Carried wheels in .whl/.
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export BLINK_COMMIT=${BLINK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${STEP:-1}" = 1 ]; then
    python3 bench/gpu_host.py --batches 1,8,64,256 --out "$OUT" 2>&1 | tail -25
fi
[ -n "${MODE:-}" ] && MODE=$MODE RATES=inf N=300 N_SAT=1000 GATEWAY_CORES=14,15 INTERFERE=24 RATES_I=inf \
    OUT="$OUT" bench/device_serving.sh 2>&1 | grep -v "^\s*$" | tail -60
