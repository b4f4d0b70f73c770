#!/usr/bin/env bash
# On a GPU host, from anywhere: the GPU ring fuzzer (tests/gpu_backend/test_ring_fuzz_gpu.py: bad requests
# written straight into the ring of a running persistent loop) under compute-sanitizer's memcheck, so that any
# out-of-bounds or misaligned access on the GPU while they arrive is reported. Exits 0 only when the tests
# ran (none skipped) and passed and memcheck reported no error in any process; 2: no GPU or no tool.
#
# Environment:
#   PYTHON                      interpreter (default .venv/bin/python if present, else python)
#   COMPUTE_SANITIZER           the tool (default: on PATH, else under $CUDA_HOME, default /usr/local/cuda)
#   BLINK_FUZZ_REQUESTS         bad requests per engine (default 400 here: memcheck slows every kernel)
#   BLINK_FUZZ_TIMEOUT_S        the test's longest wait for one answer (default 600)
#   BLINK_SANITIZE_TIMEOUT_S    the whole run (default 3000)
#   BLINK_SANITIZE_API_ERRORS   memcheck's --report-api-errors (default no: torch makes failing CUDA calls on
#                               purpose, e.g. probes; `explicit` lists them too, and they then count as errors)
#   BLINK_SANITIZE_NO_CACHING=1 torch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING): each tensor its
#                               own allocation, so an access past one tensor into the next is caught as well
#                               (by default memcheck sees the allocator's segments, not the tensors in them)
#   BLINK_SANITIZE_LOG_DIR      where the sanitizer's logs go (default a new temporary folder)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
for candidate in "$CUDA_HOME/compute-sanitizer/compute-sanitizer" "$CUDA_HOME/bin/compute-sanitizer"; do
  if [ -z "$CS" ] && [ -x "$candidate" ]; then CS=$candidate; fi
done
if [ -z "$CS" ]; then
  echo "compute-sanitizer not found (PATH, \$CUDA_HOME): it ships with the CUDA toolkit" >&2
  exit 2
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || exit 2
"$CS" --version | tail -1

LOG_DIR=${BLINK_SANITIZE_LOG_DIR:-$(mktemp -d /tmp/blink-memcheck.XXXXXX)}
mkdir -p "$LOG_DIR"

# The loop's library with line information, so that a report names the source line: the flags of
# kernels/persistent_loop.py build(), plus -lineinfo; the engine loads it through BLINK_LOOP_LIB.
NVCC=$("$PY" -c "from kernels import persistent_loop as p; print(p.nvcc() or '')")
if [ -z "$NVCC" ]; then
  echo "nvcc not found (PATH, \$CUDA_HOME/bin): the loop's library is built with it" >&2
  exit 2
fi
ARCH=$("$PY" -c "from kernels import persistent_loop as p; print(p.ARCH)")
LIB="$LOG_DIR/persistent_loop_lineinfo.so"
"$NVCC" -arch="$ARCH" -std=c++17 -O3 -lineinfo -shared -Xcompiler -fPIC -cudart static -rdc=true \
  -I kernels/csrc/include kernels/csrc/persistent_loop.cu -lcudadevrt -o "$LIB" || exit 2
export BLINK_LOOP_LIB=$LIB

export BLINK_FUZZ_REQUESTS=${BLINK_FUZZ_REQUESTS:-400} BLINK_FUZZ_TIMEOUT_S=${BLINK_FUZZ_TIMEOUT_S:-600}
export CUDA_MODULE_LOADING=EAGER CUDA_MODULE_DATA_LOADING=EAGER  # a spinning loop and lazy loading can deadlock
if [ "${BLINK_SANITIZE_NO_CACHING:-0}" = 1 ]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi

# The file's three engines: the cpu one (quick, no GPU work) and the persistent loop without and with the
# sampling extensions; none may be skipped.
# --target-processes all: any process the test starts is checked too; --launch-timeout: python and torch take a
# while before the first CUDA call; a kernel that spins (the loop's) is fine: memcheck does not serialize it.
start=$SECONDS
timeout "${BLINK_SANITIZE_TIMEOUT_S:-3000}" "$CS" --tool memcheck --target-processes all --launch-timeout 600 \
  --report-api-errors "${BLINK_SANITIZE_API_ERRORS:-no}" --error-exitcode 86 --print-limit 200 \
  --log-file "$LOG_DIR/memcheck.%p.log" \
  "$PY" -m pytest tests/gpu_backend/test_ring_fuzz_gpu.py -q -rs -p no:cacheprovider \
  2>&1 | tee "$LOG_DIR/pytest.log"
rc=${PIPESTATUS[0]}
echo "memcheck run: exit $rc, $((SECONDS - start)) s; logs in $LOG_DIR"
cat "$LOG_DIR"/memcheck.*.log 2>/dev/null

summaries=$(cat "$LOG_DIR"/memcheck.*.log 2>/dev/null | grep -c "ERROR SUMMARY")
errors=$(cat "$LOG_DIR"/memcheck.*.log 2>/dev/null | grep -Eo "ERROR SUMMARY: [0-9]+" | awk '{s += $3} END {print s + 0}')
echo "memcheck: $summaries process(es) checked, $errors error(s) reported"
if [ "$summaries" -lt 1 ]; then
  echo "FAIL: no ERROR SUMMARY: the sanitizer did not run to the end" >&2
  exit 1
fi
if grep -Eq "[0-9]+ (skipped|deselected)" "$LOG_DIR/pytest.log" || ! grep -Eq "[0-9]+ passed" "$LOG_DIR/pytest.log"; then
  echo "FAIL: the fuzz tests did not all run (a skipped test is not a pass)" >&2
  exit 1
fi
if [ "$errors" -ne 0 ] || [ "$rc" -ne 0 ]; then
  echo "FAIL: memcheck errors or failing tests (exit $rc)" >&2
  exit 1
fi
echo "OK: the persistent loop took the bad requests with no memory error"
