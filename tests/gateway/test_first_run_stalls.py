"""The stall rule (issue 21, item 7): a backend is ejected only when it has work pending and its heartbeat
stood still for its engine mode's timeout; once per stall, as a warning; never while idle or stopping."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.config import GatewayConfig
from protocols.ring import EngineState

TIMEOUT_S = 0.4  # the echo engine's mode in this module's config
CONFIG = dict(host="127.0.0.1", port=0, grpc_port=0, health_check_s=0.05,
              heartbeat_timeouts_s={"echo": TIMEOUT_S, "default": 0.05})


@pytest.fixture()
def harness(start_harness):
    key = "stall-" + os.urandom(4).hex()
    h = start_harness(GatewayConfig(api_keys=frozenset({key}), **CONFIG), key)
    yield h
    h.call(setattr, h.engine, "paused", False)


def _until(predicate, timeout_s: float = 5.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached"
        time.sleep(0.02)
    return time.monotonic() - started


def _ejections(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "blink.gateway.pool" and "ejected" in r.getMessage()]


def test_an_idle_backend_whose_heartbeat_stands_still_is_not_ejected(harness, caplog):
    with caplog.at_level(logging.INFO, logger="blink.gateway.pool"):
        harness.call(setattr, harness.engine, "paused", True)
        time.sleep(3 * TIMEOUT_S)
        assert not harness.call(lambda: harness.backend.ejected)
    assert not _ejections(caplog)


def test_pending_work_without_progress_ejects_once_after_the_modes_timeout(harness, caplog):
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=30)
    with caplog.at_level(logging.INFO, logger="blink.gateway.pool"), ThreadPoolExecutor(1) as pool:
        harness.call(setattr, harness.engine, "paused", True)
        time.sleep(0.2)  # idle and still: the clock of a stall has not started
        pending = pool.submit(client.completions.create, model=harness.model, prompt="hello", max_tokens=3)
        _until(lambda: harness.call(lambda: harness.backend.num_in_flight) == 1)
        waited_s = _until(lambda: harness.call(lambda: harness.backend.ejected))
        assert waited_s >= TIMEOUT_S - 0.1  # its mode's timeout, not "default"'s 0.05 s
        time.sleep(3 * TIMEOUT_S)  # still stuck: no second line
        harness.call(setattr, harness.engine, "paused", False)
        assert pending.result(timeout=10).usage.completion_tokens == 3
        _until(lambda: not harness.call(lambda: harness.backend.ejected))
    (line,) = _ejections(caplog)
    assert line.levelno == logging.WARNING and "echo engine" in line.getMessage()
    assert "None" not in line.getMessage()


def test_an_engine_that_announced_its_shutdown_is_never_ejected(harness, caplog):
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=30)
    with caplog.at_level(logging.INFO, logger="blink.gateway.pool"), ThreadPoolExecutor(1) as pool:
        harness.call(setattr, harness.engine, "paused", True)
        pending = pool.submit(client.completions.create, model=harness.model, prompt="hello", max_tokens=3)
        _until(lambda: harness.call(lambda: harness.backend.num_in_flight) == 1)
        harness.call(harness.engine.consumer.set_state, EngineState.STOPPING)
        time.sleep(3 * TIMEOUT_S)
        assert not harness.call(lambda: harness.backend.ejected)
        harness.call(setattr, harness.engine, "paused", False)  # SERVING again, then it answers
        assert pending.result(timeout=10).usage.completion_tokens == 3
    assert not _ejections(caplog)


def test_timeouts_per_mode_and_one_for_all():
    config = GatewayConfig()
    assert config.heartbeat_timeout_for("cpu") > config.heartbeat_timeout_for("persistent")
    assert config.heartbeat_timeout_for("tcp-relay-9") == config.heartbeat_timeouts_s["default"]
    assert GatewayConfig(heartbeat_timeout_s=2.5).heartbeat_timeout_for("cpu") == 2.5
    with pytest.raises(ValueError, match="default"):
        GatewayConfig(heartbeat_timeouts_s={"cpu": 3.0})
    with pytest.raises(ValueError, match="positive"):
        GatewayConfig(heartbeat_timeouts_s={"default": 0})
