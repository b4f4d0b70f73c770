#!/usr/bin/env bash
# On a GPU host: `transformers serve --continuous-batching` on a random-weight folder as a peer, driven
# by `blink bench` (chat endpoint, w<id> words: exact prompt lengths with the WordLevel tokenizer; no
# ignore_eos, which it rejects: the folder's generation config has no EOS instead).
#   bench/device_peer.sh start   # build the folder, start the server detached (setsid), wait until ready
#   N=160 CONC=64 bench/device_peer.sh bench    # drive it; writes the bench JSON under $OUT
# REQUEST_TIMEOUT (default 600 s of silence before a stream fails: interfered runs are slow).
# The server takes minutes to load (466 s on an H200 here), so the two halves can be separate calls.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; N=${N:-160}; CONC=${CONC:-64}; PY=${PYTHON:-python3}; DIR=${DIR:-/tmp/peer-model}
mkdir -p "$OUT"
if [ "${1:-}" = start ]; then
    [ -f "$DIR/model.safetensors" ] || $PY bench/peer_hf_model.py random:llama-3-8b "$DIR" || exit 1
    setsid transformers serve "$DIR" --continuous-batching --host 127.0.0.1 --port 8001 > /tmp/hf_serve.log 2>&1 &
    echo $! > /tmp/hf_serve.pid
fi
for _ in $(seq 1100); do
    curl -sf http://127.0.0.1:8001/health >/dev/null && break
    kill -0 "$(cat /tmp/hf_serve.pid)" 2>/dev/null || { echo "transformers serve exited"; tail -40 /tmp/hf_serve.log; exit 1; }
    sleep 0.5
done
curl -sf http://127.0.0.1:8001/health >/dev/null || { echo "transformers serve not ready yet"; exit 3; }
echo "transformers serve ready after $SECONDS s"
[ "${1:-}" = bench ] || exit 0
$PY -m blink.bench --url http://127.0.0.1:8001/v1 --api-key none --model "$DIR" --endpoint chat \
    --workload sharegpt --rates inf --max-concurrency "$CONC" --num-requests "$N" --label hf-serve-cb --no-ignore-eos \
    --backend-pid "$(cat /tmp/hf_serve.pid)" --out "$OUT" --no-progress --warmup-requests 2 --request-timeout ${REQUEST_TIMEOUT:-600} ${EXTRA:-}
cp /tmp/hf_serve.log "$OUT/hf_serve.log"
