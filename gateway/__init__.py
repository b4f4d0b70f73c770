"""The blink gateway: OpenAI-compatible HTTP and a gRPC API in front of backends reached through rings.

A request's way, room by room:
  api/        where it enters and its answer leaves: HTTP routes, gRPC API, admin API, response formats, SSE
  policy/     who may ask: API keys, authentication, per-key quotas
  request/    the one path both APIs take: limits, tokenize, prefix-cache hashes, submit its choices, detokenize
  backends/   where it runs: one backend and its ring, the pool, routing (prefix_index: what each backend
              caches), the transports (shm, tcp, rdma)
  streaming/  how its tokens come back: the poller, the request's handle, the native round in C, pacing
The process around them: main (flags), server (the app), workers, config, config_file, env (environment
variables), metrics, logs, gc_policy, state, errors."""
