"""Where a request enters and its answer leaves: HTTP routes (`http`), the gRPC API (`grpc_api`), the admin API
(`admin`), the OpenAI response formats (`formats`) and the SSE stream writer (`sse`)."""
