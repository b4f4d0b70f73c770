#!/usr/bin/env bash
# On a GPU host: `transformers serve --continuous-batching` on a random-weight folder as a peer, driven
# by `blink bench` (chat endpoint, w<id> words: exact prompt lengths with the WordLevel tokenizer).
#   N=200 CONC=64 bench/device_peer.sh        (writes the bench JSON and hf_serve.log under $OUT)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; N=${N:-200}; CONC=${CONC:-64}; PY=${PYTHON:-python3}; DIR=${DIR:-/tmp/peer-model}
mkdir -p "$OUT"
[ -f "$DIR/model.safetensors" ] || $PY bench/peer_hf_model.py random:llama-3-8b "$DIR" || exit 1
transformers serve --help > "$OUT/hf_serve_help.txt" 2>&1
transformers serve "$DIR" --continuous-batching --host 127.0.0.1 --port 8001 \
    > "$OUT/hf_serve.log" 2>&1 &
serve=$!
trap 'kill -TERM $serve 2>/dev/null; wait $serve' EXIT
for _ in $(seq 900); do
    curl -sf http://127.0.0.1:8001/v1/models >/dev/null && break
    kill -0 $serve 2>/dev/null || { echo "transformers serve exited"; tail -40 "$OUT/hf_serve.log"; exit 1; }
    sleep 0.5
done
echo "transformers serve ready after $SECONDS s"
$PY -m blink.bench --url http://127.0.0.1:8001/v1 --api-key none --model "$DIR" --endpoint chat \
    --workload sharegpt --rates inf --max-concurrency "$CONC" --num-requests "$N" --label hf-serve-cb --no-ignore-eos \
    --backend-pid $serve --out "$OUT" --no-progress --warmup-requests 2 --request-timeout 300 ${EXTRA:-}
