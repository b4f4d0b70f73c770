"""Prefix-caching workloads: shared-prefix and multi-turn shapes, the reuse they allow, a later turn sent only
after the turn before it, and the measured hit rate from usage.prompt_tokens_details.cached_tokens."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from blink.bench.cli import build_workload, prefix_reuse_line
from blink.bench.loadgen import ArrivalConfig, ClientConfig, build_payload, run_requests
from blink.bench.metrics import summarize
from blink.bench.workloads import BenchRequest, multi_turn, reusable_prompt_tokens, scaled, shared_prefix
from blink.cli import build_parser


def test_shared_prefix_shares_the_system_prompt_and_nothing_else():
    w = shared_prefix(num_requests=6, system_len=40, question_len=5, output_len=3, seed=1)
    system = w.requests[0].prompt_ids[:40]
    assert all(r.prompt_ids[:40] == system and r.prompt_len == 45 and r.output_len == 3 for r in w.requests)
    assert len({r.prompt_ids[40:] for r in w.requests}) == 6
    assert w == shared_prefix(num_requests=6, system_len=40, question_len=5, output_len=3, seed=1)
    d = w.describe()
    assert d["total_prompt_len"] == 270 and 5 * 40 <= d["reusable_prompt_tokens"] <= 5 * 40 + 5  # a chance match


def test_multi_turn_resends_the_history_and_waits_for_the_turn_before():
    w = multi_turn(num_conversations=3, num_turns=4, user_len=6, output_len=5, seed=2)
    assert len(w.requests) == 12
    for i, r in enumerate(w.requests):
        turn, conversation = divmod(i, 3)
        assert r.prompt_len == 6 + turn * 11
        assert r.after == (None if turn == 0 else i - 3)
        if r.after is not None:
            previous = w.requests[r.after]
            assert r.prompt_ids[:previous.prompt_len] == previous.prompt_ids  # the history, resent
        assert [n for _, n in r.messages] == [6] + [5, 6] * turn
        assert [role for role, _ in r.messages][-1] == "user"
    assert w.describe()["reusable_prompt_tokens"] == sum(w.requests[r.after].prompt_len for r in w.requests if r.after is not None)


def test_reusable_prompt_tokens_counts_each_longest_earlier_prefix():
    reqs = [BenchRequest((1, 2, 3), 1), BenchRequest((1, 2, 4), 1), BenchRequest((1, 2, 4, 5), 1), BenchRequest((9,), 1)]
    assert reusable_prompt_tokens(reqs) == 0 + 2 + 3 + 0


def test_the_cli_builds_them_from_its_flags():
    args = build_parser().parse_args(["bench", "--workload", "multi-turn", "--conversations", "2", "--turns", "3",
                                      "--user-len", "4", "--answer-len", "7"])
    w = build_workload(args)
    assert w.name == "multi-turn" and len(w.requests) == 6 and w.requests[-1].prompt_len == 4 + 2 * 11
    args = build_parser().parse_args(["bench", "--workload", "shared-prefix", "--num-requests", "5", "--system-len",
                                      "30", "--question-len", "4", "--answer-len", "2"])
    w = build_workload(args)
    assert (len(w.requests), w.requests[0].prompt_len, w.requests[0].output_len) == (5, 34, 2)
    assert "scaled" not in w.params


def test_chat_payloads_keep_the_roles_and_cut_prompts_become_one_message():
    w = multi_turn(num_conversations=1, num_turns=2, user_len=2, output_len=3)
    body = build_payload(ClientConfig("http://x/v1", "m", endpoint="chat"), w.requests[1], 0.0)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"].split() == [f"w{i}" for i in w.requests[1].prompt_ids[2:5]]
    cut = scaled(w, max_input=4).requests[1]
    assert cut.messages == () and cut.after == 0
    assert len(build_payload(ClientConfig("http://x/v1", "m", endpoint="chat"), cut, 0.0)["messages"]) == 1


async def _fake_server(delay_s: float, seen: list):
    """A streamed /v1/completions that reports half of every prompt as cached."""
    async def completions(request: web.Request):
        body = await request.json()
        seen.append((time.perf_counter(), len(body["prompt"]), "start"))
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.sleep(delay_s)
        n = len(body["prompt"])
        chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        usage = {"usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                           "prompt_tokens_details": {"cached_tokens": n // 2}}, "choices": []}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        seen.append((time.perf_counter(), n, "end"))
        return resp
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_later_turns_are_sent_after_the_turn_before_and_hits_are_measured():
    w = multi_turn(num_conversations=2, num_turns=3, user_len=4, output_len=1)
    seen: list = []

    async def main():
        runner, port = await _fake_server(0.05, seen)
        try:
            return await run_requests(ClientConfig(f"http://127.0.0.1:{port}/v1", "m"), w, ArrivalConfig())
        finally:
            await runner.cleanup()
    records, duration_s = asyncio.run(main())
    assert all(r.ok for r in records)
    for r, req in zip(records, w.requests):
        if req.after is not None:
            before = records[req.after]
            assert r.sent_s >= before.sent_s + before.e2el_s - 1e-3  # sent once the turn before had ended
            assert r.scheduled_s >= before.sent_s
    assert duration_s >= 3 * 0.05  # three turns one after the other
    metrics = summarize(records, duration_s)
    prompt_tokens = sum(r.prompt_len for r in w.requests)
    assert metrics["prefix_cache"] == {"prompt_tokens": prompt_tokens, "cached_tokens": sum(r.prompt_len // 2 for r in w.requests),
                                       "hit_rate": sum(r.prompt_len // 2 for r in w.requests) / prompt_tokens}
    line = prefix_reuse_line({"workload": w.describe(), "arrivals": {"rate": "inf"}, "metrics": metrics})
    assert f"allows {w.describe()['reusable_prompt_tokens']}/{prompt_tokens}" in line and "measured hit rate" in line
