#!/usr/bin/env bash
# Two GPUs of one host, one backend on each, one gateway in front (issue 6's fan-out): all-at-once
# ShareGPT-shaped load through a gateway that knows one backend, then through one that knows both, with
# twice the requests. Aggregate throughput / one GPU's is the fan-out's scaling.
#   MODE=persistent MODEL=random:llama-3-8b N=1000 WORKERS=4 bench/device_fanout.sh
# Writes the bench JSON files and the logs under $OUT (default bench/results).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; MODE=${MODE:-persistent}; MODEL=${MODEL:-random:llama-3-8b}; N=${N:-1000}
WORKERS=${WORKERS:-4}; PY=${PYTHON:-python3}
export BLINK_API_KEY=${BLINK_API_KEY:-bench-key} BLINK_LOG_LEVEL=${BLINK_LOG_LEVEL:-WARNING}
mkdir -p "$OUT"
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT
for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu $PY -m blink.cli backend --mode "$MODE" --model "$MODEL" --context-len 2048 \
        --num-slots 1024 --max-output-len 2048 --control "127.0.0.1:5006$gpu" --ring "blink-fanout-$gpu" \
        > "$OUT/fanout-backend-$gpu.log" 2>&1 &
    pids+=($!)
done
for _ in $(seq 900); do
    [ "$(grep -l "backend ready" "$OUT"/fanout-backend-*.log 2>/dev/null | wc -l)" = 2 ] && break
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a backend exited"; tail -20 "$OUT"/fanout-backend-*.log; exit 1; }; done
    sleep 1
done
run() {  # run LABEL PORT REQUESTS BACKEND...
    local label=$1 port=$2 requests=$3; shift 3
    local args=()
    for b in "$@"; do args+=(--backend "$b"); done
    $PY -m blink.cli gateway --port "$port" --grpc-port 0 --workers "$WORKERS" "${args[@]}" > "$OUT/fanout-gateway-$label.log" 2>&1 &
    local gw=$!
    for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
    $PY -m blink.bench --url "http://127.0.0.1:$port/v1" --workload sharegpt --label "$label" --out "$OUT" \
        --no-progress --warmup-requests 8 --rates inf --num-requests "$requests"
    kill -TERM $gw; wait $gw
}
run "blink-$MODE-1gpu" 8100 "$N" 127.0.0.1:50060
run "blink-$MODE-2gpu" 8101 $((2 * N)) 127.0.0.1:50060 127.0.0.1:50061
