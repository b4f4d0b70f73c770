source devprefix.sh
timeout 300 python3 -m pytest -q -x -m gpu tests/gpu_backend/test_pdl_gpu.py tests/gpu_backend/test_moe_gpu.py tests/gpu_backend/test_models_gpu.py tests/gpu_backend/test_persistent.py tests/kernels/test_gemv_kernel.py 2>&1 | tail -4
for m in qwen3-30b-a3b llama-3-8b; do timeout 150 python3 bench/gpu_host.py --model random:$m --batches 1 --no-persistent --out $OUT 2>&1 | grep "^B=  .*bare" | cut -c1-75; done
