#!/usr/bin/env bash
# Tensor parallelism's bare-step measurements (issue 26) on one multi-GPU host, random weights:
#   bench/device_tp.sh small   # Llama-3-8B shapes: one GPU, then TP=2 (same machine, back to back)
#   bench/device_tp.sh large   # Llama-3-70B shapes: TP=4 (and TP=2 where a GPU holds half: H200)
# Each is bench/gpu_host.py (bare step against its floor + the all-reduces, host engine, persistent loop, CPU
# per token); BATCHES and DECODE_STEPS narrow it. JSON under $OUT (default bench/results).
set -eu
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast, ever
PY=${PYTHON:-python3}; BATCHES=${BATCHES:-1,64,256}; STEPS=${DECODE_STEPS:-32}
run() { $PY bench/gpu_host.py --batches "$BATCHES" --decode-steps "$STEPS" "$@" 2>&1 | grep -v "^capturing\|it/s\]$"; }
case "${1:-small}" in
    small) run --model random:llama-3-8b
           run --model random:llama-3-8b --tensor-parallel-size 2 ;;
    large) run --model random:llama-3-70b --tensor-parallel-size 4
           if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)" -gt 100000 ]; then
               run --model random:llama-3-70b --tensor-parallel-size 2
           fi ;;
    *) echo "usage: $0 small|large"; exit 2 ;;
esac
