"""Issue 6's conformance suite: the official `openai` client against `blink serve` (CPU engine, demo model).

Every parameter of the OpenAI surface we serve, streamed and not, with the response checked field by
field against the API reference: choices and their indices, finish_reason, usage, logprobs (chat's
content entries with token/logprob/bytes/top_logprobs, completions' parallel lists), error objects.
Penalties and logit_bias are checked by their effect on greedy decoding, which the engine must show.
"""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_slot_leaks")]

USER = [{"role": "user", "content": "Name three colors."}]
REPEAT = "one two one two one two one two one two"
FINISH_REASONS = {"stop", "length"}


@pytest.fixture(scope="module")
def client(live_client):
    return live_client


@pytest.fixture(scope="module")
def tokenizer(live_tokenizer) -> Tokenizer:
    return live_tokenizer


@pytest.fixture(scope="module")
def m(live_server) -> str:
    return live_server.model


def greedy_chat(client, m, **kw):
    return client.chat.completions.create(model=m, messages=USER, temperature=0, **{"max_tokens": 6, **kw})


def stream_chat(client, m, **kw) -> list:
    return list(client.chat.completions.create(model=m, messages=USER, temperature=0, max_tokens=6, stream=True,
                                               stream_options={"include_usage": True}, **kw))


def check_usage(usage, completion_tokens: int | None = None) -> None:
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens


def check_chat_entry(entry, num_top: int) -> None:
    """One `logprobs.content` item: token, logprob <= 0, its UTF-8 bytes, `num_top` alternatives descending."""
    assert isinstance(entry.token, str) and entry.logprob <= 0
    assert isinstance(entry.bytes, list) and all(isinstance(b, int) and 0 <= b < 256 for b in entry.bytes)
    if "\\x" not in entry.token:
        assert bytes(entry.bytes).decode() == entry.token
    assert len(entry.top_logprobs) == num_top
    values = [t.logprob for t in entry.top_logprobs]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert all(isinstance(t.token, str) and isinstance(t.bytes, list) for t in entry.top_logprobs)
    if num_top:
        assert entry.logprob >= min(values) - 1e-4  # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(values[0], abs=1e-4)


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_chat_logprobs(client, m, top):
    resp = greedy_chat(client, m, logprobs=True, top_logprobs=top)
    [choice] = resp.choices
    assert choice.finish_reason in FINISH_REASONS and choice.index == 0
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens and choice.logprobs.refusal is None
    for entry in content:
        check_chat_entry(entry, top)
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    check_usage(resp.usage)


def test_chat_without_logprobs_has_none(client, m):
    for kw in ({}, {"logprobs": False}):
        resp = greedy_chat(client, m, **kw)
        assert resp.choices[0].logprobs is None
    for chunk in stream_chat(client, m):
        assert all(c.logprobs is None for c in chunk.choices)


def test_chat_logprobs_stream_match_the_full_response(client, m):
    full = greedy_chat(client, m, logprobs=True, top_logprobs=3)
    chunks = stream_chat(client, m, logprobs=True, top_logprobs=3)
    entries, text = [], ""
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        text += choice.delta.content or ""
        if choice.finish_reason:
            assert choice.finish_reason in FINISH_REASONS and choice.logprobs is None
        elif choice.logprobs is not None:
            entries += choice.logprobs.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(entries)
    assert text == full.choices[0].message.content
    want = full.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in want]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in want], abs=1e-3)
    for entry in entries:
        check_chat_entry(entry, 3)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(client, m, stream):
    kw = dict(model=m, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert all(c.choices[0].logprobs is None for c in chunks if c.choices and c.choices[0].finish_reason)
        tokens = [t for p in parts for t in p.tokens]
        token_logprobs = [x for p in parts for x in p.token_logprobs]
        tops = [x for p in parts for x in p.top_logprobs]
        offsets = [x for p in parts for x in p.text_offset]
        usage = chunks[-1].usage
    else:
        resp = client.completions.create(**kw)
        [choice] = resp.choices
        assert choice.finish_reason in FINISH_REASONS
        text, lp, usage = choice.text, choice.logprobs, resp.usage
        tokens, token_logprobs, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    check_usage(usage)
    assert len(tokens) == len(token_logprobs) == len(tops) == len(offsets) == usage.completion_tokens
    assert "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for token, logprob, top in zip(tokens, token_logprobs, tops):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        assert logprob >= min(top.values()) - 1e-4 and max(top.values()) == pytest.approx(logprob, abs=1e-4)


def test_completion_logprobs_zero_gives_the_chosen_token_only(client, m):
    resp = client.completions.create(model=m, prompt="Hello", max_tokens=4, temperature=0, logprobs=0)
    lp = resp.choices[0].logprobs
    assert all(list(top) == [token] for token, top in zip(lp.tokens, lp.top_logprobs))


def test_sampled_tokens_have_their_logprob_among_the_alternatives(client, m):
    resp = client.chat.completions.create(model=m, messages=USER, max_tokens=8, temperature=0.8, seed=5,
                                          logprobs=True, top_logprobs=20)
    for entry in resp.choices[0].logprobs.content:
        check_top = {t.token: t.logprob for t in entry.top_logprobs}
        assert entry.logprob <= 0 and len(check_top) <= 20
        if entry.token in check_top:
            assert check_top[entry.token] == pytest.approx(entry.logprob, abs=1e-4)


# ---------------------------------------------------------------- n


@pytest.mark.parametrize("stream", [False, True])
def test_n_chat_choices(client, m, stream):
    kw = dict(model=m, messages=USER, max_tokens=6, temperature=1.0, seed=11, n=3)
    if not stream:
        resp = client.chat.completions.create(**kw)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert all(c.finish_reason in FINISH_REASONS and c.message.role == "assistant" for c in resp.choices)
        check_usage(resp.usage)
        again = client.chat.completions.create(**kw)  # seeds seed, seed+1, seed+2: reproducible
        assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]
        assert len({c.message.content for c in resp.choices}) > 1
        return
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    finishes = {}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        if chunk.choices[0].finish_reason:
            finishes[chunk.choices[0].index] = chunk.choices[0].finish_reason
    assert sorted(finishes) == [0, 1, 2] and set(finishes.values()) <= FINISH_REASONS
    check_usage(chunks[-1].usage)


def test_n_completion_usage_counts_the_prompt_once(client, m):
    one = client.completions.create(model=m, prompt="Hello there", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    many = client.completions.create(model=m, prompt="Hello there", max_tokens=5, temperature=0, n=4,
                                     extra_body={"ignore_eos": True})
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 4 * one.usage.completion_tokens == 20
    assert [c.text for c in many.choices] == [one.choices[0].text] * 4  # greedy: the same text each


# ---------------------------------------------------------------- penalties and logit_bias


def _id_of(tokenizer, token: str) -> str:
    [token_id] = tokenizer.encode(token, add_special_tokens=False).ids
    return str(token_id)


def test_logit_bias_bans_the_greedy_token_and_forces_another(client, m, tokenizer):
    base = greedy_chat(client, m, logprobs=True, top_logprobs=2)
    first = base.choices[0].logprobs.content[0]
    resp = greedy_chat(client, m, logprobs=True, logit_bias={_id_of(tokenizer, first.token): -100})
    assert resp.choices[0].logprobs.content[0].token != first.token
    assert resp.choices[0].logprobs.content[0].token == first.top_logprobs[1].token  # the runner-up
    resp = greedy_chat(client, m, logit_bias={_id_of(tokenizer, "blue"): 100}, max_tokens=3)
    assert resp.choices[0].message.content == "blue" * 3 and resp.choices[0].finish_reason == "length"


def test_logit_bias_shifts_the_reported_logprobs(client, m, tokenizer):
    """Logprobs are taken after the bias (processed logprobs): biasing the runner-up past the gap makes it
    the greedy choice, with a logprob higher than it had."""
    base = greedy_chat(client, m, logprobs=True, top_logprobs=2, max_tokens=1).choices[0].logprobs.content[0]
    runner_up, gap = base.top_logprobs[1], base.logprob - base.top_logprobs[1].logprob
    biased = greedy_chat(client, m, logprobs=True, top_logprobs=2, max_tokens=1,
                         logit_bias={_id_of(tokenizer, runner_up.token): gap + 1.0})
    entry = biased.choices[0].logprobs.content[0]
    assert entry.token == runner_up.token and entry.logprob > runner_up.logprob


def _repeat(client, m, stream=False, **kw) -> str:
    args = dict(model=m, prompt=REPEAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, **kw)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
    return client.completions.create(**args).choices[0].text


def _distinct_ratio(tokenizer, text: str) -> float:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return len(set(ids)) / len(ids)


@pytest.mark.parametrize("kw", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                {"extra_body": {"ignore_eos": True, "repetition_penalty": 1.8}}],
                         ids=["frequency", "presence", "repetition"])
def test_penalties_break_greedy_repetition(client, m, tokenizer, kw):
    plain = _repeat(client, m)
    if "extra_body" in kw:
        penalized = client.completions.create(model=m, prompt=REPEAT, max_tokens=12, temperature=0,
                                              extra_body=kw["extra_body"]).choices[0].text
    else:
        penalized = _repeat(client, m, **kw)
    assert penalized != plain
    assert _distinct_ratio(tokenizer, penalized) > _distinct_ratio(tokenizer, plain)


def test_penalties_stream_like_they_complete(client, m):
    kw = {"frequency_penalty": 1.0, "presence_penalty": 0.5}
    assert _repeat(client, m, stream=True, **kw) == _repeat(client, m, **kw)


def test_negative_frequency_penalty_encourages_repeats(client, m, tokenizer):
    text = greedy_chat(client, m, max_tokens=12, frequency_penalty=-2.0).choices[0].message.content
    plain = greedy_chat(client, m, max_tokens=12).choices[0].message.content
    assert _distinct_ratio(tokenizer, text) < _distinct_ratio(tokenizer, plain)


# ---------------------------------------------------------------- echo, stop, limits, extensions


@pytest.mark.parametrize("stream", [False, True])
def test_echo(client, m, stream):
    prompt = "Roses are red,"
    kw = dict(model=m, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=m, prompt=prompt, max_tokens=4, temperature=0)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        assert chunks[0].choices[0].text.startswith(prompt)
        text = "".join(c.choices[0].text for c in chunks)
    else:
        resp = client.completions.create(**kw)
        text = resp.choices[0].text
        assert resp.usage.completion_tokens == plain.usage.completion_tokens
    assert text == prompt + plain.choices[0].text


def test_echo_with_logprobs_is_refused_clearly(client, m):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=m, prompt="hi", echo=True, logprobs=1)
    assert exc.value.param == "echo" and "prompt tokens' logprobs" in exc.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_stop_list(client, m, stream):
    kw = dict(model=m, prompt="1, 2, 3, 4, 5, 6, 7,", max_tokens=30, temperature=0, stop=[" 9", " 10"])
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kw).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert finish == "stop" and " 8," in text and " 9" not in text


@pytest.mark.parametrize("stream", [False, True])
def test_max_completion_tokens_and_include_usage(client, m, stream):
    kw = dict(model=m, messages=USER, max_completion_tokens=3, temperature=0, user="user-42",
              extra_body={"priority": 1})
    if not stream:
        resp = client.chat.completions.create(**kw)
        assert resp.choices[0].finish_reason == "length"
        check_usage(resp.usage, 3)
        return
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    check_usage(chunks[-1].usage, 3)
    no_usage = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in no_usage) and all(c.choices for c in no_usage)


def test_priority_classes_are_accepted(client, m):
    for priority in (0, 1, 255):
        resp = client.completions.create(model=m, prompt="Hi", max_tokens=2, extra_body={"priority": priority})
        assert resp.choices[0].finish_reason in FINISH_REASONS


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("endpoint, kw, param", [
    ("chat", {"n": 0}, "n"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 150}}, "logit_bias.5"),
    ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("chat", {"extra_body": {"priority": 256}}, "priority"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"n": 200}, "n"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_invalid_values_are_openai_errors(client, m, endpoint, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            client.chat.completions.create(model=m, messages=USER, max_tokens=2, **kw)
        else:
            client.completions.create(model=m, prompt="hi", max_tokens=2, **kw)
    err = exc.value
    assert err.status_code == 400 and err.param == param and err.type == "invalid_request_error"
    assert param.split(".")[0] in err.message
    assert set(err.body) >= {"message", "type", "param", "code"}
