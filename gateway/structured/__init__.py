"""Structured outputs: constraints from the API (`constraint.py`), their grammars compiled and cached per
model (`grammar.py`), the per-request mask loop that follows the stream (`mask_loop.py`), and tool calling
(`tools.py`, `tool_parsers.py`)."""
