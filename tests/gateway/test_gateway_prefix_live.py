"""Prefix caching through `blink serve` (CPU engine, demo model) with the official openai client: usage reports
cached_tokens in whole KV blocks (the block size its Describe states), a repeated prompt hits, `cache_salt` is
checked and keeps tenants apart, the metrics are exported."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from tests.conftest import _describe

pytestmark = pytest.mark.slow

# About 300 tokens for the demo model's tokenizer: several KV blocks of 16
LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(24))


def kv_block_size(live_server) -> int:
    return _describe(live_server.control).geometry.kv_block_size


def cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    return details.cached_tokens if details is not None else None


def complete(client, salt: str | None = None, prompt: str = LONG_PROMPT):
    extra = {"cache_salt": salt} if salt is not None else {}
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=2,
                                     temperature=0.0, extra_body=extra)


def test_usage_reports_cached_tokens_in_whole_blocks(live_server, live_client):
    block = kv_block_size(live_server)
    first, second = complete(live_client, "live-a"), complete(live_client, "live-a")
    for response in (first, second):
        cached = cached_tokens(response.usage)
        assert cached is not None and 0 <= cached <= response.usage.prompt_tokens and cached % block == 0


def test_streamed_usage_reports_cached_tokens_too(live_server, live_client):
    chat = live_client.chat.completions.create(
        model=live_client.models.list().data[0].id, messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=2, stream=True, stream_options={"include_usage": True}, extra_body={"cache_salt": "live-s"})
    usage = [chunk.usage for chunk in chat if chunk.usage is not None]
    assert len(usage) == 1 and cached_tokens(usage[0]) is not None
    assert cached_tokens(usage[0]) <= usage[0].prompt_tokens


def test_an_empty_or_non_string_cache_salt_is_a_400_naming_it(live_client):
    for bad in ("", 7):
        with pytest.raises(openai.BadRequestError) as err:
            complete(live_client, bad)
        assert err.value.body["param"] == "cache_salt"


def test_a_repeated_prompt_hits_the_cache(live_server, live_client):
    block = kv_block_size(live_server)
    prompt = LONG_PROMPT + " A prompt of its own for this test."
    complete(live_client, "live-hit", prompt)
    again = complete(live_client, "live-hit", prompt)
    cached = cached_tokens(again.usage)
    assert 0 < cached <= again.usage.prompt_tokens and cached % block == 0
    other_tenant = complete(live_client, "live-other", prompt)
    assert cached_tokens(other_tenant.usage) == 0  # another salt never hits the first one's blocks
    with urllib.request.urlopen(live_server.root_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "blink:prefix_cache_queries_total" in text and "blink:prefix_cache_hits_total" in text
