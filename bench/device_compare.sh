#!/usr/bin/env bash
# Issue 5's recorded comparison, every system doing the same work (N requests of the ShareGPT-shaped
# workload all at once, at most CONC in flight), isolated and under each INTERFERE level, in three calls:
#   bench/device_compare.sh peer-start   # build the peer's random-weight folder, start `transformers serve
#                                        # --continuous-batching` detached, wait until it answers (~5-8 min)
#   bench/device_compare.sh peer         # the next call, while the machine is warm: the peer's runs
#                                        # (PEER_LEVELS=iso,12 then PEER_LEVELS=24 splits them over calls)
#   bench/device_compare.sh blink        # stops the peer, then persistent and host mode (MODES), the same runs
#   python bench/compare_table.py $OUT --requests $N    # the table for bench/RESULTS.md
# N=128 CONC=64 INTERFERE=12,24 GATEWAY_CORES=14,15 by default; JSON files under $OUT (bench/results).
set -u
cd "$(dirname "$0")/.."
N=${N:-128}; CONC=${CONC:-64}; INTERFERE=${INTERFERE:-12,24}; GATEWAY_CORES=${GATEWAY_CORES:-14,15}
PEER_LEVELS=${PEER_LEVELS:-iso,$INTERFERE}; MODES=${MODES:-persistent,host}
export OUT=${OUT:-bench/results}
case "${1:-}" in
    peer-start)
        bench/device_peer.sh start ;;
    peer)
        for level in ${PEER_LEVELS//,/ }; do
            extra=""; [ "$level" = iso ] || extra="--interference $level --gateway-cores $GATEWAY_CORES"
            N=$N CONC=$CONC EXTRA="$extra" bench/device_peer.sh bench || exit 1
        done ;;
    blink)
        # the peer, if still up, holds GPU memory and host CPU: stop its process group (started with setsid)
        if [ -f /tmp/hf_serve.pid ] && kill -0 "$(cat /tmp/hf_serve.pid)" 2>/dev/null; then
            pid=$(cat /tmp/hf_serve.pid); kill -TERM -- -"$pid" 2>/dev/null || kill -TERM "$pid"
            for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -KILL -- -"$pid" 2>/dev/null; echo "stopped transformers serve ($pid)"
        fi
        for mode in ${MODES//,/ }; do
            MODE=$mode RATES=inf N=$N N_SAT=0 GATEWAY_CORES=$GATEWAY_CORES INTERFERE=$INTERFERE RATES_I=inf \
                EXTRA="--max-concurrency $CONC" bench/device_serving.sh || exit 1
        done ;;
    *)
        echo "usage: $0 peer-start | peer | blink" >&2; exit 2 ;;
esac
