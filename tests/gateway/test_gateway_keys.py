"""Hashed API keys, per-key limits (429 + Retry-After, RESOURCE_EXHAUSTED), the token budget, the admin
API and `blinkctl` against a live gateway (real sockets, the echo engine of conftest.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from blink.ctl import main as blinkctl
from gateway.config import GatewayConfig
from gateway.policy.keys import KeyLimits, KeyStore, KeysFileError, read_keys_file
from gateway.policy.quotas import Quotas, TokenBucket
from protocols import inference_pb2, inference_pb2_grpc


if TYPE_CHECKING:
    from conftest import Harness

PROMPT = "hello world hello there the quick brown fox"  # no special token: the echo never stops on EOS
LIMITS = {"plain": {}, "rpm": {"requests_per_minute": 2}, "tpm": {"tokens_per_minute": 20},
          "streams": {"max_streams": 1}, "budget": {"max_tokens_per_request": 5}, "grpc": {"requests_per_minute": 1}}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, start_harness, pick_free_port):
    """A gateway with a keys file (one client key per limit, plus an admin key) and a plain BLINK_API_KEY."""
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    store = KeyStore(path)
    keys = {name: store.add(name, "client", KeyLimits(**limits)) for name, limits in LIMITS.items()}
    keys["admin"] = store.add("ops", "admin")
    keys["legacy"] = "legacy-" + os.urandom(4).hex()
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({keys["legacy"]}),
                           keys_file=str(path), slot_wait_s=2.0)
    yield start_harness(config, keys["plain"]), keys, path


def client(h: Harness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0)  # the client retries 429s itself


def complete(h: Harness, key: str, **kw):
    return client(h, key).completions.create(model=h.model, prompt=PROMPT, max_tokens=kw.pop("max_tokens", 4), **kw)


def raw(h: Harness, method: str, path: str, key: str | None, body=None):
    """(status, headers, JSON body) of one call."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(h.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


def test_keys_file_holds_hashes_only(keyed):
    h, keys, path = keyed
    text = path.read_text()
    assert all(key not in text for key in keys.values())
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert set(read_keys_file(path)) == {*LIMITS, "ops"}
    assert complete(h, keys["plain"]).choices[0].text
    assert complete(h, keys["legacy"]).choices[0].text  # BLINK_API_KEY / --api-key keep working
    with pytest.raises(openai.AuthenticationError):
        complete(h, "blk-not-a-key")
    with pytest.raises(KeysFileError):
        KeyLimits(requests_per_minute=0)


def _assert_429(exc: openai.RateLimitError, type_: str) -> int:
    assert exc.value.status_code == 429
    body = exc.value.body
    assert body["code"] == "rate_limit_exceeded" and body["type"] == type_
    retry_after = int(exc.value.response.headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


def test_requests_per_minute(keyed):
    h, keys, _ = keyed
    complete(h, keys["rpm"]), complete(h, keys["rpm"])
    with pytest.raises(openai.RateLimitError) as exc:
        complete(h, keys["rpm"])
    assert "2 requests per minute" in exc.value.body["message"]
    assert 20 <= _assert_429(exc, "requests") <= 30  # one request comes back every 30 s
    assert complete(h, keys["plain"]).choices[0].text  # other keys keep being served
    status, _, text = raw_metrics(h)
    assert 'blink:request_rejected_total{reason="rate_limit_exceeded"}' in text


def raw_metrics(h: Harness):
    with urllib.request.urlopen(h.url + "/metrics", timeout=10) as resp:
        return resp.status, resp.headers, resp.read().decode()


def test_tokens_per_minute(keyed):
    h, keys, _ = keyed
    first = complete(h, keys["tpm"], max_tokens=16)
    assert first.usage.total_tokens > 20  # the bucket is in debt now
    with pytest.raises(openai.RateLimitError) as exc:
        complete(h, keys["tpm"])
    _assert_429(exc, "tokens")
    assert complete(h, keys["plain"]).choices[0].text


def test_max_streams(keyed):
    h, keys, _ = keyed
    h.call(setattr, h.engine, "paused", True)
    holder = threading.Thread(target=complete, args=(h, keys["streams"]), kwargs={"stream": False})
    try:
        holder.start()
        deadline = time.monotonic() + 5
        while h.call(lambda: h.backend.num_in_flight) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as exc:
            list(complete(h, keys["streams"], stream=True))
        assert "max_streams" in exc.value.body["message"]
        _assert_429(exc, "requests")
    finally:
        h.call(setattr, h.engine, "paused", False)
        holder.join(timeout=10)
    assert complete(h, keys["streams"]).choices[0].text  # the stream is free again
    h.wait_idle()


def test_token_budget_cuts_the_stream_and_cancels_the_engine(keyed):
    h, keys, _ = keyed
    cancelled = h.call(lambda: h.engine.num_cancelled)
    chunks = list(complete(h, keys["budget"], max_tokens=200, stream=True, stream_options={"include_usage": True}))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 5
    h.wait_idle()
    assert h.call(lambda: h.engine.num_cancelled) == cancelled + 1  # the engine stopped generating
    unary = complete(h, keys["budget"], max_tokens=200)
    assert unary.choices[0].finish_reason == "length" and unary.usage.completion_tokens == 5


def test_grpc_resource_exhausted(keyed):
    h, keys, _ = keyed
    meta = [("authorization", f"Bearer {keys['grpc']}")]
    with grpc.insecure_channel(h.grpc_addr) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        request = inference_pb2.GenerateRequest(model=h.model, prompt=PROMPT, max_tokens=3)
        assert list(stub.Generate(request, metadata=meta))[-1].finish_reason == "length"
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(request, metadata=meta))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(exc.value.trailing_metadata())
    assert trailing["error-code"] == "rate_limit_exceeded" and int(trailing["retry-after"]) >= 1


def test_admin_api_needs_the_admin_key(keyed):
    h, keys, _ = keyed
    assert raw(h, "GET", "/admin/status", None)[0] == 401
    assert raw(h, "GET", "/admin/status", keys["plain"])[0] == 403
    assert raw(h, "GET", "/admin/status", keys["legacy"])[0] == 403
    status, _, body = raw(h, "GET", "/admin/status", keys["admin"])
    assert status == 200 and body["backends"][0]["addr"] == "in-process" and body["workers"] == 1
    assert body["backends"][0]["native_stream"].startswith("on") and body["backends"][0]["native_streams"] == 0
    listed = json.dumps(raw(h, "GET", "/admin/keys", keys["admin"])[2])
    assert '"salt"' not in listed and '"sha256"' not in listed  # the hashing salts and hashes stay in the file
    status, _, body = raw(h, "GET", "/v1/models", keys["admin"])  # an admin key alone is no client key
    assert status == 403 and body["error"]["code"] == "permission_denied"


def test_drain_and_undrain(keyed):
    h, keys, _ = keyed
    assert raw(h, "POST", "/admin/backends/drain", keys["admin"], {"addr": "nowhere:1"})[0] == 404
    status, _, body = raw(h, "POST", "/admin/backends/drain", keys["admin"], {"addr": "in-process"})
    assert status == 200 and body["backends"][0]["draining"]
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            complete(h, keys["plain"])
        assert exc.value.status_code == 503 and "draining" in exc.value.body["message"]
    finally:
        raw(h, "POST", "/admin/backends/undrain", keys["admin"], {"addr": "in-process"})
    assert complete(h, keys["plain"]).choices[0].text


def test_blinkctl_round_trip(keyed, capsys):
    h, keys, path = keyed
    base = ["--url", h.url, "--admin-key", keys["admin"]]
    assert blinkctl(["status", *base]) == 0
    assert "in-process" in capsys.readouterr().out
    assert blinkctl(["backends", *base]) == 0
    head, row = capsys.readouterr().out.splitlines()[:2]
    assert head.split()[-1] == "native" and row.split()[-1] == "on"  # the native stream round is in use
    assert blinkctl(["keys", "add", "carol", "--rpm", "100", "--max-tokens", "3", *base]) == 0
    carol = capsys.readouterr().out.strip()
    assert carol.startswith("blk-") and carol not in path.read_text()
    assert complete(h, carol, max_tokens=50).usage.completion_tokens == 3
    assert blinkctl(["keys", "list", *base]) == 0
    assert "carol" in capsys.readouterr().out
    assert blinkctl(["drain", "in-process", *base]) == 0 and blinkctl(["undrain", "in-process", *base]) == 0
    assert blinkctl(["keys", "remove", "carol", *base]) == 0
    with pytest.raises(openai.AuthenticationError):
        complete(h, carol)
    assert blinkctl(["reload", *base]) == 0
    assert blinkctl(["status", "--url", h.url, "--admin-key", keys["plain"]]) == 1  # a client key: 403
    assert "403" in capsys.readouterr().err


def test_a_key_may_be_given_a_shared_cache_salt(keyed, capsys):
    h, keys, path = keyed
    base = ["--url", h.url, "--admin-key", keys["admin"]]
    assert blinkctl(["keys", "add", "erin", "--cache-salt", "team", *base]) == 0
    capsys.readouterr()
    assert blinkctl(["keys", "add", "fred", "--cache-salt", "team", "--file", str(path)]) == 0
    listed = {k["name"]: k for k in raw(h, "GET", "/admin/keys", keys["admin"])[2]["keys"]}
    assert listed["erin"]["cache_salt"] == listed["fred"]["cache_salt"] == "team"
    status, _, body = raw(h, "POST", "/admin/keys", keys["admin"], {"name": "gina", "cache_salt": ""})
    assert status == 400 and body["error"]["param"] == "cache_salt"
    for name in ("erin", "fred"):
        assert blinkctl(["keys", "remove", name, *base]) == 0


def test_keys_file_edits_reach_a_running_gateway(keyed, capsys):
    h, keys, path = keyed
    assert blinkctl(["keys", "add", "dave", "--file", str(path)]) == 0  # offline: no gateway involved
    dave = capsys.readouterr().out.strip()
    deadline = time.monotonic() + 5
    while raw(h, "GET", "/v1/models", dave)[0] != 200:  # the gateway notices the file within a second
        assert time.monotonic() < deadline, "the gateway did not reload its keys file"
        time.sleep(0.1)
    assert blinkctl(["keys", "remove", "dave", "--file", str(path)]) == 0


def test_token_bucket_and_quotas_without_a_server():
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])
    bucket.take(70)
    assert bucket.wait_s(1) == pytest.approx(11.0)
    now[0] = 11.0
    assert bucket.wait_s(1) == 0.0
    quotas = Quotas(clock=lambda: now[0])
    from gateway.policy.keys import Principal
    who = Principal("k", True, False, KeyLimits(max_streams=1))
    admission = quotas.admit(who)
    with pytest.raises(Exception) as exc:
        quotas.admit(who)
    assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "1"
    admission.close()
    admission.close()  # once only
    assert quotas.in_flight() == {"k": 0}
    quotas.admit(who).close()


def test_config_flags_environment_and_file_errors(tmp_path):
    from gateway.env import config_overrides
    from gateway.main import config_from_args, parse_args

    env = {"BLINK_ADMIN_KEY": "a1,a2", "BLINK_KEYS_FILE": "/etc/blink/keys.yaml", "BLINK_WORKERS": "3"}
    assert config_overrides(env) == {"admin_keys": frozenset({"a1", "a2"}), "keys_file": "/etc/blink/keys.yaml",
                                  "workers": 3}
    cfg = config_from_args(parse_args(["--admin-key", "x", "--keys", "k.yaml", "--workers", "2"]), env)
    assert cfg.admin_keys == {"x"} and cfg.keys_file == "k.yaml" and cfg.workers == 2 and cfg.worker_index == 0
    with pytest.raises(ValueError, match="fixed port"):
        GatewayConfig(port=0, workers=2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys:\n  x: {salt: aa, sha256: bb, rpm: 3}\n")
    with pytest.raises(KeysFileError, match="unknown field.*rpm"):
        KeyStore(bad)
    bad.write_text("keys:\n  x: {salt: aa, sha256: bb, role: root}\n")
    with pytest.raises(KeysFileError, match="role"):
        KeyStore(bad)
    store = KeyStore(tmp_path / "k.yaml", plain_client_keys=["plain"], plain_admin_keys=["adm"])
    both = store.add("ops", "both")
    assert store.identify(both).client and store.identify(both).admin
    assert store.identify("plain").client and not store.identify("plain").admin
    assert store.identify("adm").admin and not store.identify("adm").client
    assert store.identify("nope") is None
    with pytest.raises(KeysFileError, match="exists"):
        store.add("ops")
    with pytest.raises(KeysFileError, match="no keys file"):
        KeyStore().add("x")


def test_quotas_on_one_shared_table_count_together(tmp_path):
    """Two workers' Quotas on one table file: a key's streams and buckets are the same for both."""
    from gateway.policy.keys import Principal
    from gateway.policy.quotas import attach_shared_table, create_shared_table

    path = str(tmp_path / "usage.limits")
    create_shared_table(path, num_records=64)
    now = [0.0]
    one, two = (Quotas(clock=lambda: now[0], table=attach_shared_table(path)) for _ in range(2))
    streams = Principal("s", True, False, KeyLimits(max_streams=2))
    held = [one.admit(streams), two.admit(streams)]
    for quotas in (one, two):
        with pytest.raises(Exception) as exc:
            quotas.admit(streams)
        assert exc.value.status == 429 and "max_streams" in str(exc.value)
    held[0].close()
    assert two.in_flight() == {"s": 1}
    two.admit(streams).close()
    tokens = Principal("t", True, False, KeyLimits(tokens_per_minute=60))
    admission = one.admit(tokens)
    admission.charge(50)
    admission.close(20)  # 70 of 60: 10 in debt, paid back at 1 per second
    with pytest.raises(Exception) as exc:
        two.admit(tokens)
    assert exc.value.headers["Retry-After"] == "11"
    now[0] = 11.0
    two.admit(tokens).close()
    rpm = Principal("r", True, False, KeyLimits(requests_per_minute=60))
    for _ in range(30):
        one.admit(rpm).close()
        two.admit(rpm).close()
    with pytest.raises(Exception):
        one.admit(rpm)
    resized = Principal("r", True, False, KeyLimits(requests_per_minute=120))  # a reloaded keys file
    two.admit(resized).close()  # a new size starts full
