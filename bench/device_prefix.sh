#!/usr/bin/env bash
# Prefix caching's measurements (issue 23), random-weight model, in two calls:
#   MODE=persistent RATE=16 N=1000 bench/device_prefix.sh one   # one GPU: caching on, then off (OFF_FLAGS)
#   MODE=persistent bench/device_prefix.sh two                  # two GPUs: prefix_cache routing vs one backend
# `one`: shared-prefix (N requests, a 2,000-token system prompt, 50-token questions, 100-token answers) at RATE,
# and multi-turn (CONV conversations x TURNS turns), with `blink serve` as is and again with OFF_FLAGS
# (default --no-prefix-caching); prints bench/prefix_compare.py's on/off figures.
# `two`: one backend per GPU behind one gateway (one worker, so one prefix index) routing `prefix_cache`, the
# multi-turn workload, /health sampled for the per-backend load; then the same conversations through a gateway
# that knows one backend: the hit rates side by side. JSON files and logs under $OUT (default bench/results).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; MODE=${MODE:-persistent}; MODEL=${MODEL:-random:llama-3-8b}; PY=${PYTHON:-python3}
RATE=${RATE:-16}; N=${N:-1000}; CONV=${CONV:-64}; TURNS=${TURNS:-8}; CONC=${CONC:-64}
SYSTEM_LEN=${SYSTEM_LEN:-2000}; QUESTION_LEN=${QUESTION_LEN:-50}; ANSWER_LEN=${ANSWER_LEN:-100}
OFF_FLAGS=${OFF_FLAGS---no-prefix-caching}; PORT=${PORT:-8000}  # PORT: `one`'s server (two runs side by side)
TAGS=${TAGS:-on off}  # `one`'s runs: TAGS=on measures caching on only (e.g. host mode beside persistent's pair)
read -ra SERVE_FLAGS <<< "${SERVE_FLAGS:---context-len 4096 --num-slots 1024 --max-output-len 2048}"
export BLINK_API_KEY=${BLINK_API_KEY:-bench-key} BLINK_LOG_LEVEL=${BLINK_LOG_LEVEL:-WARNING}
mkdir -p "$OUT"
source bench/lib.sh

shared=(--workload shared-prefix --num-requests "$N" --system-len "$SYSTEM_LEN" --question-len "$QUESTION_LEN"
        --answer-len "$ANSWER_LEN" --rates "$RATE")
turns=(--workload multi-turn --conversations "$CONV" --turns "$TURNS" --user-len 64 --answer-len 128
       --rates inf --max-concurrency "$CONC")

one() {
    local tag flags
    for tag in $TAGS; do
        flags=(); [ "$tag" = off ] && flags=($OFF_FLAGS)
        start_serve "$PORT" "$OUT/prefix-serve-$tag.log" --grpc-port 0 --mode "$MODE" --model "$MODEL" "${SERVE_FLAGS[@]}" "${flags[@]}"
        eval "shared_$tag=\$(bench \"$OUT/prefix-shared-$tag\" http://127.0.0.1:$PORT/v1 blink-$MODE-cache-$tag \"\${shared[@]}\")"
        eval "turns_$tag=\$(bench \"$OUT/prefix-turns-$tag\" http://127.0.0.1:$PORT/v1 blink-$MODE-cache-$tag \"\${turns[@]}\")"
        stop_serve $serve
    done
    if [ "$TAGS" != "on off" ]; then  # one side only: its own figures
        for f in ${shared_on:-} ${turns_on:-} ${shared_off:-} ${turns_off:-}; do $PY bench/prefix_compare.py --on "$f"; done
        return
    fi
    $PY bench/prefix_compare.py --on "$shared_on" --off "$shared_off"
    $PY bench/prefix_compare.py --on "$turns_on" --off "$turns_off"
}

two() {
    local gpu
    for gpu in 0 1; do
        CUDA_VISIBLE_DEVICES=$gpu $PY -m blink.cli backend --mode "$MODE" --model "$MODEL" "${SERVE_FLAGS[@]}" \
            --control "127.0.0.1:5007$gpu" --ring "blink-prefix-$gpu" > "$OUT/prefix-backend-$gpu.log" 2>&1 &
        pids+=($!)
    done
    for _ in $(seq 900); do
        [ "$(grep -l "backend ready" "$OUT"/prefix-backend-*.log 2>/dev/null | wc -l)" = 2 ] && break
        sleep 1
    done
    $PY -m blink.cli gateway --port 8201 --grpc-port 0 --workers 1 --routing prefix_cache \
        --backend 127.0.0.1:50070 --backend 127.0.0.1:50071 > "$OUT/prefix-gateway-2.log" 2>&1 &
    local gw=$!; pids+=($gw)
    wait_http 8201 $gw "$OUT/prefix-gateway-2.log"
    (while :; do curl -s http://127.0.0.1:8201/health; echo; sleep 0.2; done) > "$OUT/prefix-loads-2.jsonl" &
    local sampler=$!
    local two_file; two_file=$(bench "$OUT/prefix-turns-2gpu" http://127.0.0.1:8201/v1 "blink-$MODE-2gpu" "${turns[@]}")
    kill $sampler; kill -TERM $gw; wait $gw
    # one backend, the other idle: a fresh ring of conversations on gpu 1 (its cache saw none of them)
    $PY -m blink.cli gateway --port 8202 --grpc-port 0 --workers 1 --backend 127.0.0.1:50071 \
        > "$OUT/prefix-gateway-1.log" 2>&1 &
    gw=$!; pids+=($gw)
    wait_http 8202 $gw "$OUT/prefix-gateway-1.log"
    local one_file; one_file=$(bench "$OUT/prefix-turns-1gpu" http://127.0.0.1:8202/v1 "blink-$MODE-1gpu" "${turns[@]}" --seed 1)
    kill -TERM $gw; wait $gw
    $PY bench/prefix_compare.py --on "$two_file" --loads "$OUT/prefix-loads-2.jsonl"
    $PY bench/prefix_compare.py --on "$one_file"
}

case "${1:-}" in
    one) one ;;
    two) two ;;
    *) echo "usage: $0 one|two"; exit 2 ;;
esac
