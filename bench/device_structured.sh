#!/usr/bin/env bash
# What structured outputs cost (issue 24) on one GPU host: `blink serve` on a random-weight model, the gateway
# computing the token masks (llguidance) on its own cores and sending them through the ring; then per mode:
#   MODE=persistent C=1,16,64 OUT_LEN=128 bench/device_structured.sh      # MODE="persistent host": both
# 1. a check: CHECK_N requests (0: none) under a bounded schema (every string and array bounded, so noise ends;
#    CHECK_SCHEMA names another) must all give valid JSON where they end; then schema compile time, cold vs cached
#    (COMPILE_REPEATS one-token request pairs); with CORPUS=1 (default) every constraint of the test corpus (200+
#    JSON schemas, regexes, choices: bench/structured_check.py --corpus), each ended answer valid under its own;
# 2. for each concurrency in C: N requests (default 4 x C, at least 8; ShareGPT-shaped prompts cut to PROMPT_LEN
#    words, answers capped at OUT_LEN tokens) plain, with ignore_eos, then every request under a small object
#    schema with one free-text field of at least NOTES_MIN_LENGTH characters (default 16 x OUT_LEN: no answer can
#    close it, so every answer runs to its length cap like the plain ones, the same batch churn, and the mask is on
#    every token; NOTES_MIN_LENGTH=0 lets answers close it and end early, as 19% did before);
# 3. bench/structured_compare.py's table: TPOT mean/P50/P99, output tok/s, the gateway's and the backend's CPU
#    per token, constrained over plain; in persistent mode also the GPU loop's own step time, tokens per step and
#    speculation per run (BLINK_LOOP_STATS_S=1: the backend logs the loop's counters every second).
# A random model's default tokenizer (WordLevel `w<id>` words) cannot spell JSON: it gets bench/structured_vocab.py's
# byte-level one, under its own BLINK_CACHE (STRUCT_CACHE; compiled kernels shared with the default cache).
# GATEWAY_CORES (default auto: the last 4 cores where there are 8 or more) pins the gateway, standing in for the
# DPU's cores, and the backend and the benchmark client (CLIENT_CORES) to the other cores. JSON files (bench results, structured-MODE.json, the check)
# and logs under $OUT (default bench/results). Exit 1 when a check or a request failed (after every run).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; MODE=${MODE:-persistent}; MODEL=${MODEL:-random:llama-3-8b}; PY=${PYTHON:-python3}
PORT=${PORT:-8000}; C=${C:-1,16,64}; N=${N:-}; PROMPT_LEN=${PROMPT_LEN:-128}; OUT_LEN=${OUT_LEN:-128}
CHECK_N=${CHECK_N:-16}; CHECK_LEN=${CHECK_LEN:-1024}; COMPILE_REPEATS=${COMPILE_REPEATS:-5}; CORPUS=${CORPUS:-1}
CHECK_SCHEMA=${CHECK_SCHEMA:-$OUT/structured-check-schema.json}; NOTES_MIN_LENGTH=${NOTES_MIN_LENGTH:-$((16 * OUT_LEN))}
GATEWAY_CORES=${GATEWAY_CORES-auto}; STRUCT_CACHE=${STRUCT_CACHE:-/tmp/blink-structured-cache}
# no prefix caching: the constrained run resends the plain run's prompts, and hits would shorten its prefills
read -ra SERVE_FLAGS <<< "${SERVE_FLAGS:---context-len 2048 --num-slots 256 --max-output-len 1024 --no-prefix-caching}"
# the persistent loop's counters every second in the serve log (INFO): the GPU's step time per run
export BLINK_API_KEY=${BLINK_API_KEY:-bench-key} BLINK_LOG_LEVEL=${BLINK_LOG_LEVEL:-INFO}
export BLINK_LOOP_STATS_S=${BLINK_LOOP_STATS_S:-1}
# and each gateway worker's mask steps every second (queued, computed, over 2 / 5 ms): where a late mask waited
export BLINK_MASK_STATS_S=${BLINK_MASK_STATS_S:-1}
mkdir -p "$OUT"
source bench/lib.sh
use_carried_wheels

cat > "$OUT/structured-schema.json" <<'EOF'
{"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "email": {"type": "string", "maxLength": 60}, "active": {"type": "boolean"},
  "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
  "notes": {"type": "string"}},
 "required": ["name", "age", "email", "active", "tags", "notes"], "additionalProperties": false}
EOF
# the same with the free text bounded: noise under it ends, so the check sees whole answers
sed 's/"notes": {"type": "string"}/"notes": {"type": "string", "maxLength": 80}/' "$OUT/structured-schema.json" \
    > "$OUT/structured-check-schema.json"
if [ "$NOTES_MIN_LENGTH" != 0 ]; then  # the timed runs' schema: the free text longer than any answer
    sed -i "s/\"notes\": {\"type\": \"string\"}/\"notes\": {\"type\": \"string\", \"minLength\": $NOTES_MIN_LENGTH}/" \
        "$OUT/structured-schema.json"
fi

if [ "$GATEWAY_CORES" = auto ]; then
    cores=$(nproc); GATEWAY_CORES=""; [ "$cores" -ge 8 ] && GATEWAY_CORES="$((cores - 4))-$((cores - 1))"
fi
if [[ "$MODEL" == random:* ]]; then
    default_cache=${BLINK_CACHE:-$HOME/.cache/blink}; mkdir -p "$default_cache/kernels" "$STRUCT_CACHE"
    [ -e "$STRUCT_CACHE/kernels" ] || ln -s "$(cd "$default_cache/kernels" && pwd)" "$STRUCT_CACHE/kernels"
    $PY bench/structured_vocab.py --preset "${MODEL#random:}" --cache "$STRUCT_CACHE" || exit 1
    export BLINK_CACHE=$STRUCT_CACHE
fi

one_mode() {  # one_mode MODE: serve, check, plain and constrained at each concurrency; the comparison
    local mode=$1 url=http://127.0.0.1:$PORT/v1 conc num plain constrained pairs=() start middle
    local windows=$OUT/structured-windows-$mode.tsv
    : > "$windows"  # each run's start and end, for the loop's counters in the serve log (structured_compare.py)
    echo "[${SECONDS}s] $mode: starting blink serve ($MODEL)"
    start_serve "$PORT" "$OUT/structured-serve-$mode.log" --mode "$mode" --model "$MODEL" --grpc-port 0 \
        "${SERVE_FLAGS[@]}"
    echo "[${SECONDS}s] $mode: serving"
    if [ -n "$GATEWAY_CORES" ]; then  # the gateway's cores its own, as a DPU's would be
        pin_gateway $serve "$GATEWAY_CORES" && pin_backend $serve "$(other_cores "$GATEWAY_CORES")" &&
            echo "gateway pinned to cores $GATEWAY_CORES, backend and the benchmark client to the others"
        # the client (64 SSE streams: about a core) off the gateway's cores, where it took turns with the mask work
        CLIENT_CORES=${CLIENT_CORES:-$(other_cores "$GATEWAY_CORES")}
    fi
    if [ "$CHECK_N" != 0 ]; then
        $PY bench/structured_check.py --url $url --schema "$CHECK_SCHEMA" \
            --num-requests "$CHECK_N" --max-tokens "$CHECK_LEN" --compile-repeats "$COMPILE_REPEATS" \
            --out "$OUT/structured-check-$mode.json" ||
            { echo "CHECK FAILED ($mode): see above"; failed=1; }
    fi
    if [ "$CORPUS" != 0 ]; then  # issue 24's gate: every ended answer valid under each corpus constraint
        $PY bench/structured_check.py --url $url --corpus --max-tokens "$CHECK_LEN" \
            --out "$OUT/structured-corpus-$mode.json" || { echo "CORPUS CHECK FAILED ($mode): see above"; failed=1; }
    fi
    for conc in ${C//,/ }; do
        echo "[${SECONDS}s] $mode: concurrency $conc, plain then constrained"
        num=${N:-$((conc * 4 > 8 ? conc * 4 : 8))}
        common=(--endpoint chat --workload sharegpt --num-requests "$num" --max-input "$PROMPT_LEN"
                --max-output "$OUT_LEN" --rates inf --max-concurrency "$conc" --serve-pid $serve)
        start=$(date +%s.%N)
        plain=$(bench "$OUT/structured-$mode-c$conc-plain" $url "blink-$mode-plain" "${common[@]}")
        middle=$(date +%s.%N)
        constrained=$(bench "$OUT/structured-$mode-c$conc-json" $url "blink-$mode-json" "${common[@]}" \
            --response-format "$OUT/structured-schema.json")
        printf '%s\t%s\t%s\n%s\t%s\t%s\n' "$plain" "$start" "$middle" "$constrained" "$middle" "$(date +%s.%N)" \
            >> "$windows"
        [ -n "$plain" ] && [ -n "$constrained" ] && pairs+=(--pair "$plain" "$constrained")
    done
    stop_serve $serve
    echo "[${SECONDS}s] == $mode: constrained (json_schema on every request) vs plain; $MODEL, answers <= $OUT_LEN tokens"
    $PY bench/structured_compare.py "${pairs[@]}" --out "$OUT/structured-$mode.json" \
        --serve-log "$OUT/structured-serve-$mode.log" --windows "$windows" || failed=1
}

failed=0
for mode in $MODE; do one_mode "$mode"; done
exit $failed
