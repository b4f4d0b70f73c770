"""The prefix-cache path through a whole gateway (HTTP, keys, pipeline, routing, metrics) to the echo engine's
ring: what the engine reads back of the block hashes, and what routing learns of them."""
from __future__ import annotations

import hashlib
import os

import pytest

from gateway.config import GatewayConfig
from gateway.request.prefix import PromptBlocks, effective_salt
from protocols.prefix_hash import block_hashes


@pytest.fixture(scope="module")
def gw(start_harness, pick_free_port):
    api_key = "key-" + os.urandom(4).hex()
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({api_key}),
                           routing="prefix_cache")
    return start_harness(config, api_key)


def index_holds(h, ids: list[int], salt: str) -> int:
    policy = h.server.state.router.policy
    hashes = PromptBlocks(ids, salt).hashes_for(h.backend.info)
    return h.call(lambda: policy.index_of(h.backend).match_len(hashes))


def key_salt(gw) -> str:
    return "plain:" + hashlib.sha256(gw.api_key.encode()).hexdigest()[:16]  # a plain key's cache salt


def test_the_engine_reads_the_salted_block_hashes_of_the_prompt_from_its_ring(gw):
    geometry = gw.backend.info.geometry
    block = geometry.kv_block_size
    ids = [(11 * i) % 200 + 3 for i in range(2 * block + 3)]
    status, body = gw.post("/v1/completions", {"model": gw.model, "prompt": ids, "max_tokens": 1,
                                               "cache_salt": "ring"})
    assert status == 200, body
    spec = next(s for s in reversed(gw.engine.specs) if list(s.prompt_ids) == ids)
    expected = block_hashes(ids, block, "fp-test", effective_salt(key_salt(gw), "ring"))
    assert tuple(spec.block_hashes) == tuple(expected) and len(expected) == 2  # full blocks only
    short = ids[:block - 1]
    assert gw.post("/v1/completions", {"model": gw.model, "prompt": short, "max_tokens": 1})[0] == 200
    spec = next(s for s in reversed(gw.engine.specs) if list(s.prompt_ids) == short)
    assert tuple(spec.block_hashes) == ()  # no full block: nothing to share
    gw.wait_idle()


def test_a_request_routes_by_its_salted_block_hashes_and_reports_usage(gw):
    block = gw.backend.info.geometry.kv_block_size
    ids = [(7 * i) % 200 + 3 for i in range(3 * block + 5)]
    salt = key_salt(gw)
    status, body = gw.post("/v1/completions", {"model": gw.model, "prompt": ids, "max_tokens": 2})
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the echo engine caches nothing
    assert index_holds(gw, ids, effective_salt(salt, None)) == 3  # the key's own namespace
    assert index_holds(gw, ids, effective_salt(salt, "t1")) == 0
    status, _ = gw.post("/v1/completions", {"model": gw.model, "prompt": ids, "max_tokens": 2, "cache_salt": "t1"})
    assert status == 200 and index_holds(gw, ids, effective_salt(salt, "t1")) == 3
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
