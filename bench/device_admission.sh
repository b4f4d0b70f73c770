#!/usr/bin/env bash
# Admission at saturation (issue 22): the same server and workload under several step budgets, one GPU, one call.
#   CONFIGS="512:256 1024:512 2048:512 2048:1024" MODE=persistent bench/device_admission.sh
# Each config is TOKENS:SEQS = `--max-num-batched-tokens TOKENS --max-num-seqs SEQS` (today's GPU defaults are
# 512:256; vLLM's server on an 80 GB card uses 8192:1024). For each: `bench/device_serving.sh` with 300 and
# 1,000 ShareGPT-shaped requests at once (prefix caching off: sharegpt repeats prompts across runs), gateway on
# GATEWAY_CORES (default 14,15), goodput against TTFT 2 s / TPOT 50 ms; then one table over all the runs
# (bench/compare_table.py: throughput, TTFT and TPOT percentiles, backend CPU per token).
# The trade: a bigger budget admits the queue faster (TTFT) and amortises the weights over more rows
# (throughput), and makes every step longer (TPOT). JSON files and serve logs under $OUT (default bench/results).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; MODE=${MODE:-persistent}; PY=${PYTHON:-python3}
CONFIGS=${CONFIGS:-512:256 1024:512 2048:512 2048:1024}
export GATEWAY_CORES=${GATEWAY_CORES:-14,15}
for config in $CONFIGS; do
    tokens=${config%%:*}; seqs=${config##*:}
    echo "=== $MODE, --max-num-batched-tokens $tokens --max-num-seqs $seqs"
    MODE=$MODE RATES=inf N=300 N_SAT=1000 LABEL="blink-$MODE-t$tokens-s$seqs" OUT="$OUT" \
        SERVE_ARGS="--no-prefix-caching --max-num-batched-tokens $tokens --max-num-seqs $seqs ${SERVE_ARGS:-}" \
        bash bench/device_serving.sh
done
$PY bench/compare_table.py "$OUT"/blink-"$MODE"-t*_sharegpt_*.json --rate inf
