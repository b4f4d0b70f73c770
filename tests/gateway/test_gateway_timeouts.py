"""Slow clients (slowloris): a connection that sends its request head or body too slowly is closed
after `header_timeout_s` / `body_timeout_s` (408 for a body), while other clients are served meanwhile."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse

import pytest

from gateway.config import GatewayConfig

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
SLACK_S = 1.5  # event-loop timers and a loaded 2-core machine


@pytest.fixture(scope="module")
def gw(start_harness):
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=0, api_keys=frozenset({"k"}),
                           header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)
    return start_harness(config, api_key="k")


def _body(harness) -> bytes:
    return json.dumps({"model": harness.model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()


def _head(harness, body: bytes) -> bytes:
    return (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {harness.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()


def _connect(harness) -> socket.socket:
    url = urllib.parse.urlsplit(harness.url)
    return socket.create_connection((url.hostname, url.port), timeout=HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 10)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _closed_after(sock: socket.socket, start_s: float) -> tuple[float, bytes]:
    reply = _read_until_closed(sock)
    return time.monotonic() - start_s, reply


@pytest.mark.parametrize("part", ["nothing", "request-line", "half-headers", "headers-no-blank-line"])
def test_partial_head_is_closed_after_header_timeout(gw, part):
    head = _head(gw, _body(gw))
    payload = {"nothing": b"", "request-line": b"POST /v1/chat/comp", "half-headers": head[:len(head) // 2],
               "headers-no-blank-line": head[:-2]}[part]
    with _connect(gw) as sock:
        start_s = time.monotonic()
        sock.sendall(payload)
        elapsed_s, reply = _closed_after(sock, start_s)
    assert reply == b""  # no request was parsed: nothing to answer
    assert HEADER_TIMEOUT_S - 0.2 <= elapsed_s <= HEADER_TIMEOUT_S + SLACK_S, elapsed_s


def test_trickled_head_does_not_extend_the_timeout(gw):
    """One byte every 0.2 s keeps a connection busy but never completes a head: closed on time anyway."""
    head = _head(gw, _body(gw))
    with _connect(gw) as sock:
        start_s = time.monotonic()
        closed = False
        for byte in head[:40]:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - start_s > HEADER_TIMEOUT_S + SLACK_S:
                break
        if not closed:
            sock.settimeout(SLACK_S)
            try:
                closed = sock.recv(1) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False
        elapsed_s = time.monotonic() - start_s
    assert closed, "a trickled head kept its connection open"
    assert elapsed_s <= HEADER_TIMEOUT_S + SLACK_S + 0.3, elapsed_s


def test_partial_body_gets_408_then_close(gw):
    body = _body(gw)
    with _connect(gw) as sock:
        start_s = time.monotonic()
        sock.sendall(_head(gw, body) + body[:len(body) // 2])
        elapsed_s, reply = _closed_after(sock, start_s)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and "body_timeout_s" in error["message"], error
    assert BODY_TIMEOUT_S - 0.2 <= elapsed_s <= BODY_TIMEOUT_S + SLACK_S, elapsed_s


def test_slow_body_within_its_timeout_is_served(gw):
    """The head timer does not cut a request in progress: a body that takes longer than header_timeout_s
    but less than body_timeout_s is served, and the connection then serves a second request."""
    body = _body(gw)
    with _connect(gw) as sock:
        sock.sendall(_head(gw, body) + body[:10])
        time.sleep(HEADER_TIMEOUT_S + 0.2)
        sock.sendall(body[10:])
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        sock.sendall(_head(gw, body) + body)  # keep-alive: the next request on the same connection
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_others_are_served_while_slow_clients_wait(gw):
    """Slow connections in every state, and normal requests completing one after another meanwhile."""
    body = _body(gw)
    head = _head(gw, body)
    slow = [_connect(gw) for _ in range(12)]
    for i, sock in enumerate(slow):
        sock.sendall([b"POST /v1/ch", head[:30], head + body[:5]][i % 3])
    closed_s: list[float] = []
    start_s = time.monotonic()

    def wait_closed(sock):
        _read_until_closed(sock)
        closed_s.append(time.monotonic() - start_s)

    threads = [threading.Thread(target=wait_closed, args=(s,)) for s in slow]
    for t in threads:
        t.start()
    served = 0
    while time.monotonic() - start_s < HEADER_TIMEOUT_S:
        status, reply = gw.post(CHAT, json.loads(body))
        assert status == 200, reply
        served += 1
    for t in threads:
        t.join(timeout=BODY_TIMEOUT_S + SLACK_S + 5)
    for sock in slow:
        sock.close()
    assert served >= 3
    assert len(closed_s) == len(slow) and max(closed_s) <= BODY_TIMEOUT_S + SLACK_S, closed_s
    status, _ = gw.post(CHAT, json.loads(body))
    assert status == 200


def test_timeouts_are_validated():
    with pytest.raises(ValueError, match="header_timeout_s"):
        GatewayConfig(header_timeout_s=0)
    with pytest.raises(ValueError, match="body_timeout_s"):
        GatewayConfig(body_timeout_s=-1)


def test_timeout_flags(tmp_path):
    from gateway.main import config_from_args, parse_args
    config = config_from_args(parse_args(["--header-timeout", "3", "--body-timeout", "7"]), environ={})
    assert (config.header_timeout_s, config.body_timeout_s) == (3.0, 7.0)
    config = config_from_args(parse_args([]), environ={"BLINK_HEADER_TIMEOUT": "4", "BLINK_BODY_TIMEOUT": "5"})
    assert (config.header_timeout_s, config.body_timeout_s) == (4.0, 5.0)
