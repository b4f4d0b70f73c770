"""Workload generators: deterministic for a seed, inside their documented bounds."""
from __future__ import annotations

import random
import statistics

from blink.bench.workloads import TOKEN_ID_HIGH, batch1, nano_vllm, scaled, sharegpt


def test_sharegpt_is_deterministic_and_bounded():
    a, b, c = sharegpt(500, seed=1), sharegpt(500, seed=1), sharegpt(500, seed=2)
    assert a.requests == b.requests
    assert a.requests != c.requests
    for r in a.requests:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048
        assert all(0 <= t <= TOKEN_ID_HIGH for t in r.prompt_ids)


def test_sharegpt_has_the_documented_long_tailed_shape():
    w = sharegpt(2000, seed=0)
    prompts = [r.prompt_len for r in w.requests]
    outputs = [r.output_len for r in w.requests]
    # means near 161 / 338 before the length filter trims the tail; the median well below the mean
    assert 120 < statistics.mean(prompts) < 200 and statistics.median(prompts) < statistics.mean(prompts)
    assert 250 < statistics.mean(outputs) < 380 and statistics.median(outputs) < statistics.mean(outputs)
    assert max(prompts) > 700  # a long tail, not a narrow band


def test_nano_vllm_reproduces_its_bench_draws():
    w = nano_vllm()
    assert len(w.requests) == 256 and w.temperature == 0.6
    # nano-vllm's bench.py, verbatim in its draw order
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outputs = [rng.randint(100, 1024) for _ in range(256)]
    assert [list(r.prompt_ids) for r in w.requests] == prompts
    assert [r.output_len for r in w.requests] == outputs
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in w.requests)


def test_batch1_is_one_fixed_request_at_a_time():
    w = batch1(num_requests=3, prompt_len=20, output_len=7)
    assert w.max_concurrency == 1 and len(set(w.requests)) == 1
    assert w.requests[0].prompt_len == 20 and w.requests[0].output_len == 7


def test_scaled_cuts_and_records_the_cuts():
    w = scaled(nano_vllm(), num_requests=5, max_input=16, max_output=8, vocab_size=50)
    assert len(w.requests) == 5
    assert all(r.prompt_len == 16 and r.output_len == 8 for r in w.requests)
    assert all(t < 50 for r in w.requests for t in r.prompt_ids)
    assert w.params["scaled"] == {"num_requests": 5, "max_input": 16, "max_output": 8, "vocab_size": 50}
    assert w.describe()["total_output_len"] == 40
    assert scaled(nano_vllm()) == nano_vllm()
