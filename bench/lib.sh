# Helpers the device scripts share (bench/device_prefix.sh, bench/device_structured.sh): `source bench/lib.sh`
# after setting PY (the python) and OUT; processes started with start_serve are stopped on exit.
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT

wait_http() {  # wait_http PORT PID LOG: until /health answers; exits (with LOG's tail) if PID dies first
    for _ in $(seq 900); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "exited:"; tail -30 "$3"; exit 1; }
        sleep 1
    done
    echo "no answer on port $1"; exit 1
}

bench() {  # bench DIR URL LABEL ARGS...: one `blink bench` run into a fresh DIR; its result file's path on stdout
    # (with CLIENT_CORES set, the client runs on those cores only: never on the gateway's, which a DPU's would be)
    local dir=$1 url=$2 label=$3 pin=(); shift 3
    [ -n "${CLIENT_CORES:-}" ] && pin=(taskset -c "$CLIENT_CORES")
    rm -rf "$dir"; mkdir -p "$dir"
    "${pin[@]}" $PY -m blink.bench --url "$url" --label "$label" --out "$dir" --no-progress --warmup-requests 8 "$@" >&2
    ls "$dir"/*.json | head -1
}

start_serve() {  # start_serve PORT LOG ARGS...: `blink serve` in the background (pid in $serve), answering
    $PY -m blink.cli serve --port "$1" "${@:3}" > "$2" 2>&1 &
    serve=$!; pids+=($serve)
    wait_http "$1" $serve "$2"
}

stop_serve() {  # stop_serve PID
    kill -TERM "$1"; wait "$1"
}

pin_gateway() {  # pin_gateway SERVE_PID CORES: the gateway under `blink serve` (and its threads) onto CORES
    local pid
    for pid in $(pgrep -P "$1" -f "blink.cli gateway"); do taskset -acp "$2" "$pid" >/dev/null; done
}

other_cores() {  # other_cores CORES: this shell's cores but CORES (e.g. 14,15 or 12-15), comma-separated
    $PY -c 'import os, sys
gw = {c for part in sys.argv[1].split(",") for lo, _, hi in [part.partition("-")] for c in range(int(lo), int(hi or lo) + 1)}
print(",".join(map(str, sorted(os.sched_getaffinity(0) - gw))))' "$1"
}

pin_backend() {  # pin_backend SERVE_PID CORES: the backend under `blink serve`, what it started, and their threads
    local tree todo pid
    tree=$(pgrep -P "$1" -f "blink.cli backend"); todo=$tree
    while [ -n "$todo" ]; do todo=$(for pid in $todo; do pgrep -P "$pid"; done); tree="$tree $todo"; done
    [ -n "${tree// /}" ] || { echo "no backend child of $1 to pin"; return 1; }
    for pid in $tree; do taskset -acp "$2" "$pid" >/dev/null; done
}

use_carried_wheels() {  # the device machine has no registry: where the serving stack's imports fail, install the
    # wheels carried in .whl/ (Python 3.12 builds) into /tmp/site and put it on PYTHONPATH
    $PY -c "import llguidance, pydantic, grpc" 2>/dev/null && return 0
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        { echo "the serving stack's packages are missing and .whl/ did not install"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
}
