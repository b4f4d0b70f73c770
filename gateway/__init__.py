"""The blink gateway: OpenAI-compatible HTTP and a gRPC API in front of backends reached through rings."""
