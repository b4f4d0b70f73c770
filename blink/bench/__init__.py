"""`blink bench`: a load generator over the OpenAI API with `vllm bench serve`'s metric definitions.

One module per concern: `workloads` (seeded request lists), `loadgen` (arrivals, concurrency gate,
streamed requests over aiohttp), `metrics` (TTFT/TPOT/ITL/E2EL, throughput, goodput), `collectors`
(backend CPU per token, NVML energy, roofline), `interference` (CPU noise), `results` (JSON files,
table), `cli`. Definitions: ../shared/BENCH.md. Plots: bench/plots.py.
"""
