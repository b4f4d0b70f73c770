"""Prefix caching at the gateway: block hashes per backend, tenant salts, the `prefix_cache` routing policy
(hit routing, hot-prefix spill, correction by the engine's cached_tokens) and what usage reports."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from gateway.api.formats import ChatFormat, CompletionFormat
from gateway.backends.prefix_index import BlockIndex, PrefixCache
from gateway.backends.route import Router, make_policy
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.metrics import Metrics
from gateway.policy.keys import KeyRecord, KeysFileError, KeyStore, new_record, write_keys_file
from gateway.request.generate import Generation
from gateway.request.pipeline import Failover, parse
from gateway.request.prefix import PromptBlocks, effective_salt
from protocols.messages import TokenUpdate
from protocols.openai import ChatCompletionRequest, CompletionRequest
from protocols.prefix_hash import block_hashes
from protocols.ring import FinishReason, RequestSpec, RingGeometry

BLOCK = 16


def info(addr: str, block_size: int = BLOCK, fingerprint: str = "fp", max_prompt_len: int = 8192,
         prefix_caching: bool = True):
    geometry = RingGeometry(num_slots=8, max_prompt_len=max_prompt_len, kv_block_size=block_size)
    return SimpleNamespace(addr=addr, model_name="m", model_fingerprint=fingerprint, geometry=geometry,
                           prefix_caching=prefix_caching)


class FakeBackend:
    """What routing reads of a backend: its info, its load and its ring header."""

    def __init__(self, addr: str, outstanding_tokens: int = 0, total_kv_blocks: int = 1000):
        self.info = info(addr)
        self.outstanding_tokens = outstanding_tokens
        self.total_kv_blocks = total_kv_blocks
        self.healthy, self.draining, self.stalled, self.dead = True, False, False, False

    def engine_stats(self) -> dict[str, int]:
        return {"total_kv_blocks": self.total_kv_blocks, "free_kv_blocks": self.total_kv_blocks}


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(num_tokens)]


# ---------------------------------------------------------------- hashes and salts

def test_effective_salt_keeps_keys_apart_whatever_the_request_salt():
    assert effective_salt("", None) == ""
    salts = {effective_salt(k, r) for k, r in [("a", "bc"), ("ab", "c"), ("abc", None), ("", "abc"), ("", "1:abc"),
                                               ("a", None), ("", "1:a")]}
    assert len(salts) == 7  # no key salt + request salt pair spells another's


def test_prompt_blocks_hash_once_per_backend_model_and_block_size():
    ids = prompt(1, 3 * BLOCK + 5)
    blocks = PromptBlocks(ids, "s")
    hashes = blocks.hashes_for(info("a"))
    assert hashes == tuple(block_hashes(ids, BLOCK, "fp", "s")) and len(hashes) == 3
    assert blocks.hashes_for(info("b")) is hashes  # same model and block size: computed once
    assert blocks.hashes_for(info("c", fingerprint="other")) != hashes
    assert blocks.hashes_for(info("d", block_size=2 * BLOCK)) == tuple(block_hashes(ids, 2 * BLOCK, "fp", "s"))
    assert blocks.hashes_for(info("e", max_prompt_len=4 * BLOCK)) is hashes  # the slot's size changes nothing
    assert blocks.max_cached_blocks(info("a")) == 3
    assert PromptBlocks(prompt(1, 3 * BLOCK)).max_cached_blocks(info("a")) == 2  # the last token is always computed


def test_a_backend_without_a_prefix_cache_gets_no_hashes_and_counts_in_no_metric(byte_tokenizer):
    from gateway.request.detokenize import TextStream
    ids = prompt(4, 3 * BLOCK + 1)
    off = info("off", prefix_caching=False)
    blocks = PromptBlocks(ids, "s")
    assert blocks.hashes_for(off) == () and blocks.max_cached_blocks(off) == 0
    assert blocks.spec_for(RequestSpec(1, ids, 2), off).block_hashes == ()
    backend = FakeBackend("off")
    backend.info = off
    metrics = Metrics()
    gen = Generation(Handle(backend, RequestSpec(1, ids, 2), [update([65], 0, FinishReason.LENGTH)]),
                     TextStream(byte_tokenizer, [], ids), len(ids), "m", metrics)

    async def read():
        while not (await gen.next_piece()).finish_reason:
            pass
    asyncio.run(read())
    gen.close()
    assert "blink:prefix_cache_queries_total{" not in metrics.render()[0].decode()  # vLLM counts cached engines only


def test_the_describe_reply_says_whether_the_engine_caches():
    from protocols.messages import BackendDescription, BackendInfo

    for caching in (True, False):
        reply = BackendDescription("m", "", "fp", 64, 100, (2,), "host", prefix_caching=caching).to_reply(
            "ring", RingGeometry(num_slots=4))
        assert BackendInfo.from_reply("addr", reply).prefix_caching is caching


def test_the_spec_carries_the_hashes_of_the_backend_it_goes_to():
    ids = prompt(2, 2 * BLOCK + 3)
    spec, blocks = RequestSpec(1, ids, 8), PromptBlocks(ids)
    out = blocks.spec_for(spec, info("a"))
    assert tuple(out.block_hashes) == tuple(block_hashes(ids, BLOCK, "fp", "")) and len(out.block_hashes) == 2
    out.validate(info("a").geometry)  # fits the ring's slot
    assert blocks.spec_for(out, info("b")) is out  # same hashes: the same spec
    other = blocks.spec_for(out, info("c", fingerprint="other"))  # a failover to another model's backend
    assert other.block_hashes != out.block_hashes and len(other.block_hashes) == 2


def test_keys_file_cache_salt_defaults_to_the_key_name_and_may_be_shared(tmp_path):
    a, key_a = new_record("alice")
    b, key_b = new_record("bob")
    c, key_c = new_record("carol")
    path = tmp_path / "keys.yaml"
    write_keys_file(path, [a, KeyRecord(b.name, b.salt, b.sha256, cache_salt="team"),
                           KeyRecord(c.name, c.salt, c.sha256, cache_salt="team")])
    store = KeyStore(path)
    assert store.identify(key_a).cache_salt == "alice"
    assert store.identify(key_b).cache_salt == store.identify(key_c).cache_salt == "team"
    plain = KeyStore(None, ["k1", "k2"])
    assert plain.identify("k1").cache_salt != plain.identify("k2").cache_salt  # one namespace per plain key
    with pytest.raises(KeysFileError, match="cache_salt"):
        KeyRecord.from_yaml("x", {"salt": "00", "sha256": "00", "cache_salt": ""})
    with pytest.raises(KeysFileError, match="cache_salt"):
        KeyRecord.from_yaml("x", {"salt": "00", "sha256": "00", "cache_salt": 5})


@pytest.mark.parametrize("cls,body", [(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                                      (CompletionRequest, {"prompt": "hi"})])
def test_cache_salt_must_be_a_non_empty_string(cls, body):
    assert parse(cls, json.dumps({"model": "m", **body, "cache_salt": "t1"}).encode()).cache_salt == "t1"
    for bad in ("", 5, ["x"]):
        with pytest.raises(ApiError) as err:
            parse(cls, json.dumps({"model": "m", **body, "cache_salt": bad}).encode())
        assert err.value.status == 400 and err.value.detail.param == "cache_salt"


# ---------------------------------------------------------------- routing

def route(policy: PrefixCache, backends: list[FakeBackend], ids: list[int], salt: str = "") -> tuple[FakeBackend, PromptBlocks]:
    blocks = PromptBlocks(ids, salt)
    return policy.choose(backends, ids, blocks), blocks


def test_prefix_cache_routes_to_the_backend_holding_the_longest_prefix():
    a, b = FakeBackend("a", 100), FakeBackend("b", 0)
    policy = PrefixCache()
    system = prompt(3, 8 * BLOCK)
    first, _ = route(policy, [a, b], system + prompt(4, 20))
    assert first is b  # nothing cached anywhere: the least loaded
    b.outstanding_tokens = 500  # busier now, but within the balance limits
    for question in range(5, 10):
        chosen, blocks = route(policy, [a, b], system + prompt(question, 20))
        assert chosen is b and blocks.predicted["b"][0] == 8
    other, _ = route(policy, [a, b], prompt(99, 8 * BLOCK))
    assert other is a  # an unrelated prompt goes by load
    salted, _ = route(policy, [a, b], system + prompt(5, 20), salt="tenant")
    assert salted is a  # another tenant's chain: no hit on b


def test_a_hot_prefix_spills_to_the_least_loaded_backend():
    a, b = FakeBackend("a", 0), FakeBackend("b", 0)
    policy = PrefixCache(balance_ratio=1.5, balance_slack_tokens=1500)
    system = prompt(3, 8 * BLOCK)
    assert route(policy, [a, b], system)[0] is a  # ties by load: the first
    a.outstanding_tokens, b.outstanding_tokens = 2000, 1500  # 1.33x: stays
    assert route(policy, [a, b], system + prompt(1, 5))[0] is a
    a.outstanding_tokens, b.outstanding_tokens = 1400, 0  # over 1.5x but within the slack: stays
    assert route(policy, [a, b], system + prompt(2, 5))[0] is a
    a.outstanding_tokens = 5000  # over both: the least loaded takes it, and learns the prefix
    spilled, blocks = route(policy, [a, b], system + prompt(3, 5))
    assert spilled is b and blocks.predicted["b"] == (0, 0)
    a.outstanding_tokens = b.outstanding_tokens = 0
    assert policy.index_of(a).match_len(blocks.hashes_for(a.info)) == 8
    assert policy.index_of(b).match_len(blocks.hashes_for(b.info)) == 8  # both hold it now


def test_the_engines_cached_tokens_correct_the_index():
    a, b = FakeBackend("a", 0), FakeBackend("b", 10)
    policy = PrefixCache()
    ids = prompt(5, 6 * BLOCK + 3)
    chosen, first = route(policy, [a, b], ids)
    hashes = first.hashes_for(a.info)
    assert chosen is a and policy.index_of(a).match_len(hashes) == 6
    policy.cached(a, first, 0)  # prefilled from scratch: the engine holds its blocks now
    assert policy.index_of(a).confirmed_len(hashes) == 6
    again, blocks = route(policy, [a, b], ids)
    assert again is a and blocks.predicted["a"] == (6, 6)
    policy.cached(a, blocks, 6 * BLOCK)  # the engine had all of it: nothing changes
    assert policy.index_of(a).match_len(hashes) == 6
    policy.cached(a, blocks, 2 * BLOCK)  # it had evicted blocks 2..5: they leave the index
    assert policy.index_of(a).match_len(hashes) == 2
    assert all(h not in policy.index_of(a) for h in hashes[2:])
    policy.cached(a, route(policy, [a, b], ids)[1], 2 * BLOCK)
    _, blocks = route(policy, [a, b], ids)
    assert blocks.predicted["a"] == (6, 6)
    policy.cached(a, blocks, 0)  # the engine caches nothing (prefix caching off there)
    assert policy.index_of(a).match_len(hashes) == 0


def test_a_burst_sharing_a_prefix_is_no_evidence_of_eviction():
    """Requests routed while the first is still prefilling count on blocks no engine has confirmed: their
    misses (the engine had not published the blocks yet) leave the index alone."""
    a, b = FakeBackend("a", 0), FakeBackend("b", 10)
    policy = PrefixCache()
    system = prompt(11, 8 * BLOCK)
    burst = [route(policy, [a, b], system + prompt(20 + i, 9)) for i in range(4)]
    assert all(chosen is a for chosen, _ in burst) and burst[1][1].predicted["a"] == (8, 0)
    for _, blocks in burst[1:]:
        policy.cached(a, blocks, 0)
    hashes = burst[0][1].hashes_for(a.info)
    assert policy.index_of(a).match_len(hashes) == 8 and policy.index_of(a).confirmed_len(hashes) == 8


def test_a_prompt_of_whole_blocks_all_cached_is_no_miss():
    a = FakeBackend("a")
    policy = PrefixCache()
    ids = prompt(6, 4 * BLOCK)  # the engine computes the last token: at most 3 blocks reported
    policy.cached(a, route(policy, [a], ids)[1], 0)
    _, blocks = route(policy, [a], ids)
    assert blocks.predicted["a"] == (4, 4)
    policy.cached(a, blocks, 3 * BLOCK)
    assert policy.index_of(a).match_len(blocks.hashes_for(a.info)) == 4


def test_the_index_is_capped_by_the_backends_kv_blocks_least_recently_used_out():
    a = FakeBackend("a", total_kv_blocks=10)
    policy = PrefixCache()
    old = prompt(7, 6 * BLOCK)
    route(policy, [a], old)
    new, _ = route(policy, [a], prompt(8, 6 * BLOCK))
    index = policy.index_of(a)
    assert len(index) == 10
    assert index.match_len(PromptBlocks(old).hashes_for(a.info)) == 0  # its first blocks were the oldest
    capped = PrefixCache(max_blocks=3)
    route(capped, [a], old)
    assert len(capped.index_of(a)) == 3


def test_block_index_match_stops_at_the_first_missing_block():
    index = BlockIndex()
    index.add([1, 2, 3, 4], 10)
    index.drop([2])
    assert index.match_len([1, 2, 3, 4]) == 1 and index.match_len([5, 1]) == 0


def test_without_hashes_prefix_cache_is_least_outstanding_tokens():
    a, b = FakeBackend("a", 50), FakeBackend("b", 10)
    policy = PrefixCache()
    short = prompt(1, BLOCK - 1)  # no full block: no hashes
    assert route(policy, [a, b], short)[0] is b and route(policy, [a, b], short)[0] is b
    assert policy.choose([a, b], prompt(1, 64)) is b  # a request routed without its blocks


def test_the_config_names_the_policy_and_checks_its_settings():
    config = GatewayConfig(backend_addrs=("x:1",), routing="prefix_cache", prefix_cache_balance_ratio=2.0,
                           prefix_cache_max_blocks=64)
    policy = make_policy(config)
    assert isinstance(policy, PrefixCache) and policy.balance_ratio == 2.0 and policy.max_blocks == 64
    with pytest.raises(ValueError, match="prefix_cache_balance_ratio"):
        GatewayConfig(backend_addrs=("x:1",), prefix_cache_balance_ratio=0.5)
    with pytest.raises(ValueError, match="prefix_cache_max_blocks"):
        GatewayConfig(backend_addrs=("x:1",), prefix_cache_max_blocks=0)


# ---------------------------------------------------------------- a request's end: usage, metrics, correction

class Handle:
    """A RequestHandle stand-in on a FakeBackend: scripted updates."""

    def __init__(self, backend: FakeBackend, spec: RequestSpec, updates: list[TokenUpdate]):
        self.backend, self.spec, self.slot = backend, spec, 0
        self.submitted_s = 0.0
        self._updates = updates
        self.sink, self.queue = None, ()

    async def next(self) -> TokenUpdate:
        return self._updates.pop(0)

    def close(self) -> None:
        pass


def update(tokens: list[int], cached_tokens: int, finish=FinishReason.NONE) -> TokenUpdate:
    return TokenUpdate(tokens=tokens, finish=finish, started=True, cached_tokens=cached_tokens)


def test_a_finished_request_reports_cached_tokens_to_usage_metrics_and_routing(byte_tokenizer):
    from gateway.request.detokenize import TextStream
    a, b = FakeBackend("a"), FakeBackend("b", 100)
    router = Router([a, b], PrefixCache())
    ids = prompt(9, 5 * BLOCK + 1)
    spec = RequestSpec(1, ids, 2)
    metrics = Metrics()
    failover = Failover(router, "m", spec, metrics, PromptBlocks(ids))
    backend = router.pick("m", ids, blocks=failover.blocks)
    assert backend is a
    router.cached(a, failover.blocks, 0)  # an earlier request prefilled the prompt there
    router.pick("m", ids, blocks=failover.blocks)  # this one: predicted 5 confirmed blocks on a
    handle = Handle(a, spec, [update([65], 2 * BLOCK), update([66], 2 * BLOCK, FinishReason.LENGTH)])
    gen = Generation(handle, TextStream(byte_tokenizer, [], ids), len(ids), "m", metrics, failover=failover)

    async def read():
        while not (await gen.next_piece()).finish_reason:
            pass
    asyncio.run(read())
    gen.close()
    assert gen.cached_tokens == 2 * BLOCK
    text = metrics.render()[0].decode()
    assert f'blink:prefix_cache_queries_total{{model_name="m"}} {float(len(ids))}' in text
    assert f'blink:prefix_cache_hits_total{{model_name="m"}} {float(2 * BLOCK)}' in text
    assert router.policy.index_of(a).match_len(failover.blocks.hashes_for(a.info)) == 2  # corrected


def test_usage_shows_cached_tokens_in_both_formats():
    chunk = json.loads(ChatFormat("id", "m").usage_chunk(40, 3, 32).model_dump_json())
    assert chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    full = json.loads(CompletionFormat("id", "m").full([], 40, 3, 16).model_dump_json())
    assert full["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                             "prompt_tokens_details": {"cached_tokens": 16}}


def test_grpc_takes_cache_salt_as_http_does():
    from gateway.api.grpc_api import generate_request
    from protocols import inference_pb2

    req, _ = generate_request(inference_pb2.GenerateRequest(model="m", prompt="hi", cache_salt="t1"))
    assert req.cache_salt == "t1"
    assert generate_request(inference_pb2.GenerateRequest(model="m", prompt="hi"))[0].cache_salt is None
    with pytest.raises(ApiError) as err:
        generate_request(inference_pb2.GenerateRequest(model="m", prompt="hi", cache_salt=""))
    assert err.value.status == 400 and err.value.detail.param == "cache_salt"


def test_the_cached_blocks_gauge_is_exported_where_a_backend_reports_it():
    with_cache, without = FakeBackend("a"), FakeBackend("b")
    with_cache.engine_stats = lambda: {"total_kv_blocks": 10, "free_kv_blocks": 4, "running": 1, "waiting": 0,
                                       "cached_kv_blocks": 7}
    without.engine_stats = lambda: {"total_kv_blocks": 10, "free_kv_blocks": 10, "running": 0, "waiting": 0}
    for b in (with_cache, without):
        b.num_waiting, b.free_slots, b.serving = 0, 8, True
    text = Metrics(lambda: [with_cache, without]).render()[0].decode()
    assert 'blink:kv_cache_cached_blocks{backend="a",model_name="m"} 7.0' in text
    assert 'blink:kv_cache_cached_blocks{backend="b"' not in text


def test_usage_counts_each_prompts_cached_tokens_once_whatever_n():
    from gateway.request.choices import Choices

    gens = [SimpleNamespace(cached_tokens=c, prompt_len=40) for c in (32, 48, 16, 0)]  # 2 prompts x n=2
    assert Choices(gens, None, prompt_len=80, n=2).cached_tokens == 32 + 16
    assert Choices(gens[:1], None).cached_tokens == 32
