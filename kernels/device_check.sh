#!/usr/bin/env bash
# On a GPU host, from anywhere: the kernels' GPU tests, then a timing table of each kernel against the
# copy bandwidth measured on the same device. About 2 minutes on an H100 (mostly Triton compiling).
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA GPU visible'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 2

rc=0
start=$SECONDS
timeout 200 "$PY" -m pytest tests/kernels -m gpu -q -rs -p no:cacheprovider || rc=$?
echo "gpu tests: exit $rc, $((SECONDS - start)) s"
start=$SECONDS
timeout 100 "$PY" kernels/device_check.py || rc=$?
echo "timing: $((SECONDS - start)) s"
exit $rc
