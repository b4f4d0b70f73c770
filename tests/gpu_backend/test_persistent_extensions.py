"""Penalties, logit bias and logprobs in the `persistent` engine (the GPU-resident loop's extended branches;
run on the device machine, skipped elsewhere):

- for the same seeded requests, mixing plain rows with rows that use penalties, logit bias and logprobs, the
  loop gives the host engine's tokens and logprobs bit for bit (same batches, same LOGITS graphs, the
  adjust kernel against sampler.LogitAdjustments, the same sampler, the same logprob math);
- logit_bias +100 forces a token, -100 bans the one greedy decoding would pick;
- a finished slot leaves nothing behind: the adjust kernel's scratch is zero again, and the next request in
  the same slot (plain) gets the tokens it gets in a fresh engine;
- the extended branches run through the speculation too (decode steps take it).
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

from test_gpu_runner import _drive, _peaky_model  # noqa: E402
from test_persistent import CONFIG, Served, served  # noqa: E402,F401 (served: the fixture)
from protocols.ring import FinishReason, RequestSpec, RingGeometry  # noqa: E402

VOCAB = 512


def _runner(model, cfg):
    from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig

    return GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                                 context_len=512, num_kv_blocks=96, sampling_extensions=True),
                     progress=False, keep_graphs=True)


@pytest.fixture(scope="module")
def runner_cfg():
    cfg, model = _peaky_model()
    return _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg), cfg


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]
    logprobs: list[list]
    finishes: list[FinishReason]
    ctl: dict[str, int]


def _run(runner, cfg, specs, geometry=RingGeometry(16, 256, 256)) -> Result:
    """The specs queued before the launch (admitted together, as the host engine takes them), run to the end."""
    s = Served(runner, cfg, geometry)
    try:
        slots = s.submit(specs)
        s.engine.start()
        s.wait(lambda: len(s.finishes) == len(slots))
        s.engine.shutdown()
        return Result([s.tokens[x] for x in slots], [s.logprobs[x] for x in slots],
                      [s.finishes[x][0] for x in slots], s.engine.final_ctl)
    finally:
        s.close()


def _host(runner, cfg, specs):
    """The host engine over the same runner (its prompt cache is keyed by ring submission: start it afresh)."""
    from gpu_backend.engine.sampler import PromptCache

    runner._prompts = PromptCache()
    return _drive(runner, cfg, specs, config=CONFIG)


def _lp(entries) -> list:
    return [(e.logprob, tuple(e.top)) for e in entries]


def _specs(seed: int = 0, max_tokens: int = 24) -> list[RequestSpec]:
    gen = random.Random(seed)

    def prompt(n):
        return [gen.randrange(3, VOCAB) for _ in range(n)] + [7, 9, 7]
    return [RequestSpec(0, prompt(5), max_tokens, temperature=0.0, ignore_eos=True),
            RequestSpec(1, prompt(30), max_tokens, temperature=0.9, seed=11, num_logprobs=5, ignore_eos=True),
            RequestSpec(2, prompt(12), max_tokens, temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7,
                        presence_penalty=0.4, num_logprobs=20, ignore_eos=True),
            RequestSpec(3, prompt(50), max_tokens, temperature=1.2, top_k=40, seed=5, repetition_penalty=0.6,
                        logit_bias=((9, 4.0), (VOCAB + 3, 50.0)), ignore_eos=True),
            RequestSpec(4, prompt(8), max_tokens, temperature=0.7, top_p=0.9, seed=23, presence_penalty=-1.5,
                        logit_bias=((7, -3.0),), num_logprobs=0, ignore_eos=True),
            RequestSpec(5, prompt(20), max_tokens, temperature=1.0, seed=3, ignore_eos=True)]


@pytest.mark.parametrize("seed", [0, 1])
def test_extensions_give_the_host_engines_tokens_and_logprobs_bit_for_bit(runner_cfg, seed):
    runner, cfg = runner_cfg
    specs = _specs(seed)
    host_tokens, host_fin, loop = _host(runner, cfg, specs)
    got = _run(runner, cfg, specs)
    assert got.finishes == host_fin == [FinishReason.LENGTH] * len(specs)
    assert got.tokens == host_tokens
    for spec, lps, want in zip(specs, got.logprobs, loop.final_logprobs):
        if spec.num_logprobs is None:
            assert lps == [] and want == []
            continue
        assert len(lps) == len(want) == spec.max_tokens
        assert _lp(lps) == _lp(want)
        assert all(len(e.top) == spec.num_logprobs for e in lps)
    assert got.ctl["spec_hits"] >= got.ctl["steps"] // 2  # decode steps with extended rows take the speculation


def test_the_extensions_change_what_they_should(runner_cfg):
    """Against the same requests without extensions: penalized and biased rows differ, plain rows do not."""
    runner, cfg = runner_cfg
    specs = _specs(2)
    plain_specs = [dataclasses.replace(x, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                       logit_bias=(), num_logprobs=None) for x in specs]
    got, plain = _run(runner, cfg, specs).tokens, _run(runner, cfg, plain_specs).tokens
    assert got[0] == plain[0] and got[5] == plain[5]  # plain rows of mixed steps: the plain path's tokens
    assert got[1] == plain[1]  # a seeded row with logprobs only: its logits are left as they are
    assert got[2] != plain[2] and got[3] != plain[3]


def test_logit_bias_forces_and_bans_tokens(runner_cfg):
    runner, cfg = runner_cfg
    base = RequestSpec(0, [5, 6, 7, 8], 12, temperature=0.0, ignore_eos=True)
    banned = _run(runner, cfg, [base]).tokens[0][0]
    specs = [dataclasses.replace(base, request_id=1, logit_bias=((42, 100.0),)),
             dataclasses.replace(base, request_id=2, logit_bias=((banned, -100.0),)),
             dataclasses.replace(base, request_id=3, temperature=1.0, seed=9, logit_bias=((17, 100.0),))]
    got = _run(runner, cfg, specs).tokens
    assert got[0] == [42] * 12
    assert banned not in got[1] and len(got[1]) == 12
    assert got[2] == [17] * 12


def test_a_finished_slot_leaves_nothing_behind(served, runner_cfg):
    """A ring of one slot: a penalized, biased, logprobs request, then a plain one in the same slot."""
    runner, cfg = runner_cfg
    plain = RequestSpec(1, [11, 12, 13, 14, 15], 16, temperature=0.8, seed=4, ignore_eos=True)
    want = _run(runner, cfg, [plain], RingGeometry(1, 256, 256)).tokens[0]
    s = served(runner, cfg, RingGeometry(1, 256, 256))
    s.engine.start()
    assert s.engine.take_linked == 12 * len(runner.buckets)  # plain and both extended sets: take after the logits
    first, = s.submit([RequestSpec(0, [11, 12, 13, 14, 15], 16, temperature=0.0, repetition_penalty=1.5,
                                   frequency_penalty=1.0, logit_bias=((3, 5.0),), num_logprobs=3, ignore_eos=True)])
    s.wait(lambda: first in s.finishes)
    assert len(s.logprobs[first]) == 16
    del s.tokens[first], s.finishes[first], s.logprobs[first]
    s.prod.release(first)
    second, = s.submit([plain])
    assert second == first
    s.wait(lambda: second in s.finishes)
    assert s.tokens[second] == want and s.logprobs[second] == []
    s.engine.shutdown()
    torch.cuda.synchronize()
    assert int(runner.ext_scratch.count_nonzero()) == 0  # every mark the adjust kernel set, it cleared
    assert int(s.engine._ext["flags"][0]) == 0  # the plain request's admission reset the slot's flags


def test_logprobs_requests_run_within_the_logprob_window(runner_cfg):
    """A logprobs request may run only logprob_window tokens ahead of the reads (RingConsumer's capacity):
    with a window of 8 and 40 tokens, a loop that ran ahead would overwrite logprobs before they were read."""
    runner, cfg = runner_cfg
    spec = RequestSpec(0, [5, 6, 7], 40, temperature=0.0, num_logprobs=2, ignore_eos=True)
    host_tokens, _, loop = _host(runner, cfg, [spec])
    got = _run(runner, cfg, [spec], RingGeometry(4, 256, 256, logprob_window=8))
    assert got.tokens == host_tokens
    assert _lp(got.logprobs[0]) == _lp(loop.final_logprobs[0])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_stop_tokens_beside_logprob_rows_keep_each_tokens_logprobs(runner_cfg, asynchronous, monkeypatch):
    """Steps where some rows sample a stop token (not published: the full step, whose token list skips them;
    or, with the asynchronous take, the next step's dropped row) while others publish tokens with logprobs:
    each published token gets its own row's logprobs."""
    monkeypatch.setenv("BLINK_LOOP_ASYNC", "1" if asynchronous else "0")
    runner, cfg = runner_cfg
    specs = _specs(3)
    plain, _, _ = _host(runner, cfg, specs)
    # the even requests stop on a token they make mid-way; the odd ones run on beside them
    specs = [dataclasses.replace(x, stop_ids=(tokens[5 + 3 * i],)) if i % 2 == 0 else x
             for i, (x, tokens) in enumerate(zip(specs, plain))]
    host_tokens, host_fin, loop = _host(runner, cfg, specs)
    got = _run(runner, cfg, specs)
    assert got.finishes == host_fin and FinishReason.STOP in host_fin
    assert got.tokens == host_tokens
    assert [_lp(x) for x in got.logprobs] == [_lp(x) for x in loop.final_logprobs]
    assert got.ctl["tokens"] == sum(map(len, host_tokens))
    if not asynchronous:
        assert got.ctl["spec_misses"] >= 1
    torch.cuda.synchronize()
    assert int(runner.ext_scratch.count_nonzero()) == 0  # a dropped row's marks too


def test_a_slot_freed_by_the_asynchronous_take_serves_its_next_request_cleanly(served, runner_cfg, monkeypatch):
    """A ring of one slot and BLINK_LOOP_ASYNC=1: a penalized request stops on a stop token, and the next
    request is queued in its slot as soon as the finish is read, while the step that holds the stopped
    sequence's dropped row may still run. The next request gets the tokens it gets alone."""
    monkeypatch.setenv("BLINK_LOOP_ASYNC", "1")
    runner, cfg = runner_cfg
    first = RequestSpec(0, [11, 12, 13, 14, 15], 16, temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                        logit_bias=((3, 5.0),), num_logprobs=3, ignore_eos=True)
    made = _run(runner, cfg, [first], RingGeometry(1, 256, 256)).tokens[0]
    first = dataclasses.replace(first, stop_ids=(made[5],))
    plain = RequestSpec(1, [11, 12, 13, 14, 15], 16, temperature=0.8, seed=4, repetition_penalty=1.3, ignore_eos=True)
    want = _run(runner, cfg, [plain], RingGeometry(1, 256, 256)).tokens[0]
    s = served(runner, cfg, RingGeometry(1, 256, 256))
    s.engine.start()
    for _ in range(3):
        slot, = s.submit([first])
        while slot not in s.finishes:
            s.poll()
        assert s.finishes[slot][0] is FinishReason.STOP and s.tokens[slot] == made[:made.index(made[5])]
        del s.tokens[slot], s.finishes[slot], s.logprobs[slot]
        s.prod.release(slot)
        second, = s.submit([plain])  # at once: no sleep between the finish and the reuse
        s.wait(lambda: second in s.finishes)
        assert s.tokens[second] == want
        del s.tokens[second], s.finishes[second], s.logprobs[second]
        s.prod.release(second)
    s.engine.shutdown()
    torch.cuda.synchronize()
    assert int(runner.ext_scratch.count_nonzero()) == 0
    header = s.engine.scheduler_header()
    assert header.num_free == runner.num_blocks and header.num_running == 0


def test_the_loop_runner_has_extended_graphs_over_both_step_buffers(runner_cfg):
    from gpu_backend.engine.graph_variant import GraphVariant

    runner, _ = runner_cfg
    for graphs in runner.set_graphs:
        assert set(graphs) == {(b, g) for b in runner.buckets for g in GraphVariant}
