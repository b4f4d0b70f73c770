"""bench/saturation_model.py: the schedule it models and the arithmetic of its step curve."""

from __future__ import annotations

import json

import pytest

from bench.saturation_model import main, simulate, step_curve


def test_the_curve_interpolates_extrapolates_and_scales():
    ms = step_curve({1: 5.0, 64: 8.0, 256: 16.0})
    assert ms(1) == ms(0.5) == 5.0 and ms(64) == 8.0
    assert ms(160) == pytest.approx(12.0)  # halfway between 64 and 256
    assert ms(512) == pytest.approx(16.0 + 256 * 8.0 / 192)  # the last slope goes on
    faster = step_curve({1: 5.0, 64: 8.0, 256: 16.0}, [(256, 1 << 30, 0.5)])
    assert faster(512) == pytest.approx(ms(512) / 2) and faster(64) == 8.0


def test_one_request_prefills_then_decodes_one_token_a_step():
    # a 10-token prompt in budget 4: three prefill steps (4, 4, 2 tokens; the last samples the first token), then
    # 4 decode steps at one row; a step of 2 prefill tokens at cost 0.5 is one row's
    got = simulate([(10, 5)], lambda n: 1.0 if n < 1 else 2.0, max_num_seqs=8, max_num_batched_tokens=4,
                   prefill_cost=0.5)
    assert got["tokens"] == 5 and got["duration_s"] == pytest.approx((3 * 2.0 + 4 * 2.0) / 1e3)
    assert got["mean_first_token_s"] == pytest.approx(3 * 2.0 / 1e3)


def test_fcfs_admission_and_the_time_split_by_decode_rows():
    requests = [(1, 3)] * 4
    # max 2 at once: requests 0-1 first (prefill and first token in one step), then 2-3 once they finished
    got = simulate(requests, lambda n: 1.0, max_num_seqs=2, max_num_batched_tokens=8)
    assert got["tokens"] == 12 and got["duration_s"] == pytest.approx(6 / 1e3)  # (1 prefill + 2 decode) x 2
    split = got["by_decode_rows"]
    assert split["1-16"]["tokens"] == 12 and split["1-16"]["s"] == pytest.approx(0.006)


def test_halving_every_step_doubles_the_throughput(tmp_path):
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    args = ["--step", "1:5,64:8,256:16", "--requests", "50", "--budgets", "512:64"]
    assert main([*args, "--out", str(out_a)]) == 0
    assert main([*args, "--what-if", "1-:0.5", "--out", str(out_b)]) == 0
    a, b = (json.loads(p.read_text())["runs"][0] for p in (out_a, out_b))
    assert a["tokens"] == b["tokens"] and b["output_tok_s"] == pytest.approx(2 * a["output_tok_s"])


def test_contexts_past_the_bare_steps_cost_their_kv_reads():
    # one request, prompt 10, 4 tokens out, budget 16: a prefill step (first token), then 3 decode steps at
    # contexts 11, 12, 13; the bare step's own context is 10, so they cost 1, 2, 3 tokens of KV reads past it
    base = simulate([(10, 4)], lambda n: 1.0, max_num_seqs=1, max_num_batched_tokens=16)
    got = simulate([(10, 4)], lambda n: 1.0, max_num_seqs=1, max_num_batched_tokens=16, kv_ms_per_token=0.5,
                   step_ctx=10)
    assert base["duration_s"] == pytest.approx(4 / 1e3)
    assert got["duration_s"] == pytest.approx((4 + 0.5 * (1 + 2 + 3)) / 1e3)
    shorter = simulate([(10, 4)], lambda n: 1.0, max_num_seqs=1, max_num_batched_tokens=16, kv_ms_per_token=0.1,
                       step_ctx=20)  # contexts under the bare step's give time back
    assert shorter["duration_s"] < base["duration_s"]
