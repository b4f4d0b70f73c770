"""The blink gateway: OpenAI-compatible HTTP in front of backends reached through rings."""
