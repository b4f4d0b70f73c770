"""The gRPC API's sampling surface against `blink serve` (CPU engine, demo model), checked against the HTTP
API on the same server: n choices put back together, logprobs, penalties and logit_bias by their effect."""

from __future__ import annotations

import grpc
import pytest

from grpc_helpers import generate, reassemble
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_slot_leaks")]

USER = [{"role": "user", "content": "Name three colors."}]
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in USER])
REPEAT = "one two one two one two one two one two"


@pytest.fixture(scope="module")
def rpc(live_server):
    with grpc.insecure_channel(live_server.grpc_addr) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        auth = (("authorization", f"Bearer {live_server.api_key}"),)
        yield lambda **fields: generate(stub, auth, timeout_s=120, model=live_server.model, **fields)


def token_id(tokenizer, token: str) -> int:
    [tid] = tokenizer.encode(token, add_special_tokens=False).ids
    return tid


def only_choice(replies):
    [choice] = reassemble(replies)
    return choice


# ---------------------------------------------------------------- n


def test_n_choices_are_the_http_choices(rpc, live_client, live_server):
    """Seeds seed, seed+1, ... per choice on both APIs: the reassembled choices are HTTP's, in order."""
    replies = rpc(messages=CHAT, max_tokens=6, temperature=1.0, seed=11, n=3)
    http = live_client.chat.completions.create(model=live_server.model, messages=USER, max_tokens=6, temperature=1.0,
                                          seed=11, n=3)
    choices = reassemble(replies)
    assert [c.text for c in choices] == [c.message.content for c in http.choices]
    assert len({c.text for c in choices}) > 1
    assert [c.finish_reason for c in choices] == [c.finish_reason for c in http.choices]
    usage = replies[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (http.usage.prompt_tokens, http.usage.completion_tokens)
    assert usage.completion_tokens == sum(len(c.token_ids) for c in choices)


# ---------------------------------------------------------------- logprobs


def check_entry(entry: pb.TokenLogprobs, num_top: int, greedy: bool) -> None:
    assert entry.chosen.logprob <= 0 and entry.chosen.token_bytes.decode("utf-8", "backslashreplace") == \
        entry.chosen.token
    values = [t.logprob for t in entry.top]
    assert len(entry.top) == num_top and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert len({t.token_id for t in entry.top}) == num_top
    if greedy and num_top:
        assert entry.top[0].token_id == entry.chosen.token_id
        assert entry.chosen.logprob == pytest.approx(values[0], abs=1e-4)


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_logprobs_structure(rpc, top):
    replies = rpc(messages=CHAT, max_tokens=6, temperature=0, logprobs=top)
    for reply in replies:
        assert [e.chosen.token_id for e in reply.logprobs] == list(reply.token_ids)
    choice = only_choice(replies)
    assert len(choice.logprobs) == len(choice.token_ids) == replies[-1].usage.completion_tokens
    for entry in choice.logprobs:
        check_entry(entry, top, greedy=True)
    assert b"".join(e.chosen.token_bytes for e in choice.logprobs).decode() == choice.text


def test_logprobs_are_the_http_logprobs(rpc, live_client, live_server):
    choice = only_choice(rpc(prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3))
    http = live_client.chat.completions.create(model=live_server.model, messages=USER, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    grpc_chat = only_choice(rpc(messages=CHAT, max_tokens=6, temperature=0, logprobs=3))
    want = http.choices[0].logprobs.content
    assert [e.chosen.token for e in grpc_chat.logprobs] == [e.token for e in want]
    assert [e.chosen.logprob for e in grpc_chat.logprobs] == pytest.approx([e.logprob for e in want], abs=1e-3)
    assert [[t.token for t in e.top] for e in grpc_chat.logprobs] == [[t.token for t in e.top_logprobs] for e in want]
    for entry in choice.logprobs:
        check_entry(entry, 3, greedy=True)


def test_sampled_tokens_and_logprobs_over_the_completions_limit(rpc):
    """A text prompt takes up to 20 alternatives here (HTTP completions: 5); sampled tokens may be outside them."""
    choice = only_choice(rpc(prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=5, logprobs=20))
    assert len(choice.logprobs) == len(choice.token_ids)
    for entry in choice.logprobs:
        check_entry(entry, 20, greedy=False)
        tops = {t.token_id: t.logprob for t in entry.top}
        if entry.chosen.token_id in tops:
            assert tops[entry.chosen.token_id] == pytest.approx(entry.chosen.logprob, abs=1e-4)


# ---------------------------------------------------------------- logit_bias and penalties


def test_logit_bias_bans_and_forces(rpc, live_tokenizer):
    base = only_choice(rpc(messages=CHAT, max_tokens=6, temperature=0, logprobs=2)).logprobs[0]
    banned = only_choice(rpc(messages=CHAT, max_tokens=6, temperature=0, logprobs=2,
                             logit_bias={base.chosen.token_id: -100.0})).logprobs[0]
    assert banned.chosen.token_id != base.chosen.token_id
    assert banned.chosen.token_id == base.top[1].token_id  # the runner-up
    blue = token_id(live_tokenizer, "blue")
    forced = only_choice(rpc(messages=CHAT, max_tokens=3, temperature=0, logit_bias={blue: 100.0}))
    assert forced.text == "blue" * 3 and forced.finish_reason == "length"


def distinct_ratio(tokenizer, text: str) -> float:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return len(set(ids)) / len(ids)


@pytest.mark.parametrize("fields", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                    {"repetition_penalty": 1.8}], ids=["frequency", "presence", "repetition"])
def test_penalties_break_greedy_repetition_as_on_http(rpc, live_client, live_server, live_tokenizer, fields):
    args = dict(prompt=REPEAT, max_tokens=12, temperature=0, ignore_eos=True)
    plain = only_choice(rpc(**args)).text
    penalized = only_choice(rpc(**args, **fields)).text
    assert penalized != plain and distinct_ratio(live_tokenizer, penalized) > distinct_ratio(live_tokenizer, plain)
    http = live_client.completions.create(model=live_server.model, prompt=REPEAT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, **fields})
    assert penalized == http.choices[0].text
