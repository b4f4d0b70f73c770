"""The prefix-cache path through a whole gateway (HTTP, keys, pipeline, routing, metrics) on the echo engine,
its backend made to state a KV block size (the ring's geometry gets the field with the engine side)."""
from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest

from gateway.config import GatewayConfig
from gateway.request.prefix import PromptBlocks, effective_salt

BLOCK = 16


class BlockGeometry:
    """The harness ring's geometry, stating a KV block size."""

    kv_block_size = BLOCK
    max_block_hashes = None

    def __init__(self, geometry):
        self._geometry = geometry

    def __getattr__(self, name):
        return getattr(self._geometry, name)


@pytest.fixture(scope="module")
def gw(start_harness, pick_free_port):
    with pytest.MonkeyPatch.context() as patch:
        # the echo engine's ring takes no hashes whatever its geometry says: these tests are about routing
        patch.setattr("gateway.request.prefix.SPEC_HAS_HASHES", False)
        yield _start(start_harness, pick_free_port)


def _start(start_harness, pick_free_port):
    api_key = "key-" + os.urandom(4).hex()
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({api_key}),
                           routing="prefix_cache")
    h = start_harness(config, api_key)
    info = h.backend.info
    h.call(lambda: setattr(h.backend, "info", dataclasses.replace(info, geometry=BlockGeometry(info.geometry))))
    return h


def index_holds(h, ids: list[int], salt: str) -> int:
    policy = h.server.state.router.policy
    hashes = PromptBlocks(ids, salt).hashes_for(h.backend.info)
    return h.call(lambda: policy.index_of(h.backend).match_len(hashes))


def test_a_request_routes_by_its_salted_block_hashes_and_reports_usage(gw):
    ids = [(7 * i) % 200 + 3 for i in range(3 * BLOCK + 5)]
    key_salt = "plain:" + hashlib.sha256(gw.api_key.encode()).hexdigest()[:16]
    status, body = gw.post("/v1/completions", {"model": gw.model, "prompt": ids, "max_tokens": 2})
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the echo engine caches nothing
    assert index_holds(gw, ids, effective_salt(key_salt, None)) == 3  # the key's own namespace
    assert index_holds(gw, ids, effective_salt(key_salt, "t1")) == 0
    status, _ = gw.post("/v1/completions", {"model": gw.model, "prompt": ids, "max_tokens": 2, "cache_salt": "t1"})
    assert status == 200 and index_holds(gw, ids, effective_salt(key_salt, "t1")) == 3
    assert index_holds(gw, ids, effective_salt("", None)) == 0  # nothing under the anonymous namespace
    gw.wait_idle()


def test_prefix_cache_metrics_count_prompt_tokens_as_queries(gw):
    import urllib.request

    def queries() -> float:
        with urllib.request.urlopen(gw.url + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("blink:prefix_cache_queries_total"):
                    return float(line.split()[-1])
        return 0.0
    before = queries()
    ids = [5 + i % 50 for i in range(40)]
    assert gw.post("/v1/completions", {"model": gw.model, "prompt": ids, "max_tokens": 2})[0] == 200
    gw.wait_idle()
    assert queries() == before + 40
