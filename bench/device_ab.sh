#!/usr/bin/env bash
# A kernel change measured against the tree before it, on one GPU machine: the two trees side by side, their bare
# steps (bench/gpu_host.py --bare-only, the new tree's script timing both) alternated, one summary JSON. Two steps:
#   bench/device_ab.sh prepare OLD_REV     # here: .ab/old.tar.gz (git archive OLD_REV), .ab/old.rev, .ab/new.rev
#                                          # (HEAD, "+dirty" when the working tree differs from it)
#   MODELS=random:qwen3-30b-a3b,random:llama-3-8b ROUNDS=2 BATCHES=1 bench/device_ab.sh run
#                                          # on the device (run's carry: [".whl", ".ab"]): per round and model,
#                                          # old then new (even rounds: new then old), each stamped with its .rev
# `run` ends with bench/ab_summary.py's table and writes $OUT/ab-NEW-vs-OLD.json (each run's bare step and floor
# by tree and model, the medians, new - old). TESTS="pytest args" runs those tests on the new tree first.
# The device's copy of the tree carries no trustworthy .git: the stamps come from .ab/*.rev, written here.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
    prepare)
        rev=${2:?usage: $0 prepare OLD_REV}
        mkdir -p .ab
        git archive "$rev" | gzip > .ab/old.tar.gz || exit 1
        git rev-parse --short "$rev" > .ab/old.rev
        new=$(git rev-parse --short HEAD)
        git diff --quiet HEAD -- . ':!.ab' || new="$new+dirty"
        echo "$new" > .ab/new.rev
        echo "old $(cat .ab/old.rev), new $new: run with carry [\".whl\", \".ab\"]" ;;
    run)
        [ -f .ab/old.tar.gz ] || { echo "no .ab/old.tar.gz: run '$0 prepare OLD_REV' here first" >&2; exit 2; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >/dev/null 2>&1 || { echo "installing the carried wheels (.whl/) failed" >&2; exit 1; }
        export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
        OUT=${OUT:-bench/results}; MODELS=${MODELS:-random:qwen3-30b-a3b}; ROUNDS=${ROUNDS:-2}; BATCHES=${BATCHES:-1}
        old_rev=$(cat .ab/old.rev); new_rev=$(cat .ab/new.rev); new_tree=$PWD; old_tree=/tmp/ab_old
        rm -rf "$old_tree" /tmp/ab_runs; mkdir -p "$old_tree" /tmp/ab_runs "$OUT"
        tar xzf .ab/old.tar.gz -C "$old_tree"
        cp bench/gpu_host.py "$old_tree/bench/gpu_host.py"  # one instrument for both trees (the new tree's)
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        if [ -n "${TESTS:-}" ]; then
            PYTHONPATH=/tmp/site:$new_tree:$new_tree/tests/gpu_backend python3 -m pytest -q -p no:warnings $TESTS 2>&1 | tail -3
        fi
        one() {  # one TREE REV MODEL ROUND: a bare-step run into /tmp/ab_runs/REV-ROUND
            (cd "$1" && OUT= BLINK_COMMIT=$2 PYTHONPATH=/tmp/site:$1 python3 bench/gpu_host.py --model "$3" \
                --batches "$BATCHES" --bare-only --out "/tmp/ab_runs/$2-$4" 2>&1 | grep -E "^B=" | cut -c1-100 \
                | sed "s|^|$2 $3 round $4: |")
        }
        for round in $(seq "$ROUNDS"); do
            for model in ${MODELS//,/ }; do
                if [ $((round % 2)) = 1 ]; then
                    one "$old_tree" "$old_rev" "$model" "$round"; one "$new_tree" "$new_rev" "$model" "$round"
                else
                    one "$new_tree" "$new_rev" "$model" "$round"; one "$old_tree" "$old_rev" "$model" "$round"
                fi
            done
        done
        python3 bench/ab_summary.py /tmp/ab_runs --old "$old_rev" --new "$new_rev" --out "$OUT" ;;
    *)
        echo "usage: $0 prepare OLD_REV | run" >&2; exit 2 ;;
esac
