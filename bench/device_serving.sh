#!/usr/bin/env bash
# On a GPU host: `blink serve` in a GPU mode on a random-weight model, then `blink bench` over the OpenAI
# API with the ShareGPT-shaped workload: a sweep of request rates, then all-at-once for saturation; then,
# with INTERFERE set, the same again at RATES_I under each number of interfering threads.
#   MODE=persistent MODEL=random:llama-3-8b RATES=8,16,32,64 N=300 N_SAT=1000 \
#   GATEWAY_CORES=14,15 INTERFERE=24 RATES_I=32,inf bench/device_serving.sh
# SERVE_ARGS go to `blink serve` (e.g. "--tensor-parallel-size 4"); WEIGHT_BYTES is what one step reads for the
# roofline (default: Llama-3-8B's 16.06e9; at TP=4 the leader's share).
# GATEWAY_CORES pins the gateway (standing in for the DPU's cores) and keeps the interference off them;
# BACKEND_CORES (default: every core of this shell but GATEWAY_CORES, once GATEWAY_CORES is set) pins the
# backend process tree to the host's cores, which it shares with the interference, as on a busy host:
# a busy backend thread (host mode's engine loop) cannot escape onto the gateway's cores.
# Writes the bench JSON files and serve.log under $OUT (default bench/results).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; MODE=${MODE:-host}; MODEL=${MODEL:-random:llama-3-8b}
RATES=${RATES-4,8,16,32}; N=${N:-300}; N_SAT=${N_SAT:-1000}; PY=${PYTHON:-python3}
GOODPUT=${GOODPUT-ttft:2000 tpot:50}  # the SLOs `good/s` counts against (issue 22's example); empty: none
SERVE_ARGS=${SERVE_ARGS:-}; WEIGHT_BYTES=${WEIGHT_BYTES:-16.06e9}; LABEL=${LABEL:-blink-$MODE}
GATEWAY_CORES=${GATEWAY_CORES:-}; BACKEND_CORES=${BACKEND_CORES:-}; INTERFERE=${INTERFERE:-}; RATES_I=${RATES_I:-32,inf}
export BLINK_API_KEY=${BLINK_API_KEY:-bench-key} BLINK_LOG_LEVEL=${BLINK_LOG_LEVEL:-WARNING}
mkdir -p "$OUT"
if [ -n "$GATEWAY_CORES" ] && [ -z "$BACKEND_CORES" ]; then
    BACKEND_CORES=$($PY -c 'import os, sys
gw = {c for part in sys.argv[1].split(",") for lo, _, hi in [part.partition("-")] for c in range(int(lo), int(hi or lo) + 1)}
print(",".join(map(str, sorted(os.sched_getaffinity(0) - gw))))' "$GATEWAY_CORES")
fi
$PY -m blink.cli serve --mode "$MODE" --model "$MODEL" --context-len 2048 --num-slots 1024 \
    --max-output-len 2048 --port 8000 $SERVE_ARGS > "$OUT/serve-$MODE.log" 2>&1 &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve' EXIT
for _ in $(seq 600); do
    curl -sf http://127.0.0.1:8000/health >/dev/null && break
    kill -0 $serve 2>/dev/null || { echo "serve exited"; tail -30 "$OUT/serve-$MODE.log"; exit 1; }
    sleep 0.5
done
grep -E "GPU runner|backend ready" "$OUT/serve-$MODE.log"
common=(--url http://127.0.0.1:8000/v1 --workload sharegpt --label "$LABEL" --serve-pid $serve
        --out "$OUT" --no-progress --warmup-requests 8 --weight-bytes "$WEIGHT_BYTES" --copy-gbps 4200)
[ -n "$GOODPUT" ] && common+=(--goodput $GOODPUT)
if [ -n "$GATEWAY_CORES" ]; then
    for pid in $(pgrep -P $serve -f "blink.cli gateway"); do taskset -acp "$GATEWAY_CORES" "$pid" >/dev/null; done
    common+=(--gateway-cores "$GATEWAY_CORES")
fi
if [ -n "$BACKEND_CORES" ]; then
    # the backend and anything it started (an agent); threads made later inherit the pinned mask
    tree=$(pgrep -P $serve -f "blink.cli backend"); todo=$tree
    while [ -n "$todo" ]; do todo=$(for p in $todo; do pgrep -P "$p"; done); tree="$tree $todo"; done
    [ -n "${tree// /}" ] || { echo "no backend child of $serve to pin"; exit 1; }
    for pid in $tree; do taskset -acp "$BACKEND_CORES" "$pid" >/dev/null; done
    echo "backend pinned to cores $BACKEND_CORES (pids$(printf ' %s' $tree)); gateway to ${GATEWAY_CORES:-none}"
    for pid in $tree; do taskset -cp "$pid"; done
fi
[ -n "$RATES" ] && $PY -m blink.bench "${common[@]}" --rates "$RATES" --num-requests "$N" ${EXTRA:-}
[ "$N_SAT" != 0 ] && $PY -m blink.bench "${common[@]}" --rates inf --num-requests "$N_SAT" ${EXTRA:-}
for threads in ${INTERFERE//,/ }; do
    $PY -m blink.bench "${common[@]}" --rates "$RATES_I" --num-requests "$N" --interference "$threads" ${EXTRA:-}
done
