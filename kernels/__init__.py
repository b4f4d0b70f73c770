"""GPU kernels of the model step (Triton), one module per family, each with a thin wrapper that checks
shapes and dtypes on the host and launches with a grid fixed by the shapes (graph-capturable, no sync):

- `rmsnorm`: `rmsnorm`, `add_rmsnorm` (fused residual add)
- `rope_kv`: `rope_and_cache_kv` (RoPE on q and k, k/v written into the paged cache; with `q_norm`/`k_norm`,
  Qwen3's per-head RMSNorm in the same launch)
- `paged_attention`: `paged_attention` (mixed prefill/decode batch, GQA, split-K, one launch + reduce; given
  `rope_and_cache_kv`'s arguments it runs that first, or at one token does its work inside the tile kernel)
- `swiglu`: `swiglu`
- `sampling`: `sample`, `uniforms` (the CPU engine's counter-based RNG, bit for bit)
- `moe`: `fused_moe` (= `moe_route` + `moe_experts`: top-k routing, a counting sort of the token-expert
  pairs by expert, grouped SwiGLU expert GEMMs over stacked weights; routing never leaves the GPU; a decode
  step's routing is one launch, `moe_route_decode`)

The scheduling step of the GPU-resident loop is C++ (`csrc/include/blink_sched.h`, device and host);
`sched_host` builds its host library with the C++ compiler on first use (no triton, no torch) for
`gpu_backend/engine/sched_native.py`.

The structs the loop, the scheduler and the step buffer share with Python are declared once
(`loop_decl.py`, `sched_decl.py`, `step_decl.py`); `python -m protocols.layout.gen` writes their
`*_layout.py` views and `csrc/include/blink_*_layout.h` headers.

Modules import triton; import them only where it is installed. `device_check.sh` runs the GPU tests and
a timing table on a GPU host; `python -m kernels.compile_check` compiles everything for sm_90 without one.
"""
