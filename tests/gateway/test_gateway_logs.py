"""Structured logs: one JSON object per line, carrying the request id the client and the ring see."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.request

from gateway.logs import JsonFormatter, setup_logging


def test_json_formatter_keeps_extras_and_exceptions():
    record = logging.LogRecord("blink.x", logging.WARNING, __file__, 1, "request %d: %s", (7, "ok"), None)
    record.request_id, record.ttft_ms = 7, None
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "request 7: ok" and line["level"] == "WARNING" and line["logger"] == "blink.x"
    assert line["request_id"] == 7 and line["ttft_ms"] is None and line["ts"].endswith("Z")
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("blink.x", logging.ERROR, __file__, 1, "failed", (), __import__("sys").exc_info())
    assert "ValueError: boom" in json.loads(JsonFormatter().format(record))["exc"]


def test_setup_logging_replaces_the_root_handlers():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("DEBUG", "json")
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, JsonFormatter)
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:], root.level = saved


def test_request_log_line_has_the_request_id_of_the_reply_and_the_ring(harness):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("blink.gateway.requests")
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.INFO
    try:
        req = urllib.request.Request(harness.url + "/v1/completions", method="POST", data=json.dumps(
            {"model": harness.model, "prompt": "hello world", "max_tokens": 3}).encode(),
            headers={"Authorization": f"Bearer {harness.api_key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            request_id = int(resp.headers["X-Request-Id"])
        deadline = time.monotonic() + 5
        while '"request_id"' not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        logger.removeHandler(handler)
        logger.level = old_level
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    mine = [line for line in lines if line.get("request_id") == request_id]
    assert len(mine) == 1, lines
    assert mine[0]["completion_tokens"] == 3 and mine[0]["finish_reason"] == "length"
    assert harness.call(lambda: harness.engine.request_ids[-1]) == request_id
