#!/usr/bin/env bash
# Issue 5's recorded comparison, every system doing the same work (N requests of the ShareGPT-shaped
# workload all at once, at most CONC in flight), isolated and under each INTERFERE level, in three calls:
#   bench/device_compare.sh peer-start   # build the peer's random-weight folder, start `transformers serve
#                                        # --continuous-batching` detached, wait until it answers (~5-8 min)
#   bench/device_compare.sh peer         # the next call, while the machine is warm: the peer's runs
#   bench/device_compare.sh blink        # persistent and host mode, the same runs
#   python bench/compare_table.py $OUT --requests $N    # the table for bench/RESULTS.md
# N=128 CONC=64 INTERFERE=12,24 GATEWAY_CORES=14,15 by default; JSON files under $OUT (bench/results).
set -u
cd "$(dirname "$0")/.."
N=${N:-128}; CONC=${CONC:-64}; INTERFERE=${INTERFERE:-12,24}; GATEWAY_CORES=${GATEWAY_CORES:-14,15}
export OUT=${OUT:-bench/results}
case "${1:-}" in
    peer-start)
        bench/device_peer.sh start ;;
    peer)
        N=$N CONC=$CONC bench/device_peer.sh bench || exit 1
        for threads in ${INTERFERE//,/ }; do
            N=$N CONC=$CONC EXTRA="--interference $threads --gateway-cores $GATEWAY_CORES" bench/device_peer.sh bench || exit 1
        done ;;
    blink)
        for mode in persistent host; do
            MODE=$mode RATES=inf N=$N N_SAT=0 GATEWAY_CORES=$GATEWAY_CORES INTERFERE=$INTERFERE RATES_I=inf \
                EXTRA="--max-concurrency $CONC" bench/device_serving.sh || exit 1
        done ;;
    *)
        echo "usage: $0 peer-start | peer | blink" >&2; exit 2 ;;
esac
