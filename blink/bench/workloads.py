"""Benchmark workloads: lists of requests given as token lengths, generated from a fixed seed.

Every request is a prompt of token ids and an output length; the load generator sends the ids as
`/v1/completions` `prompt` (exact lengths with any tokenizer) with `max_tokens` = output length and
`ignore_eos`, so every system does the same work.

`sharegpt` (chat-like lengths; the dataset cannot be downloaded here, so its shape is modelled):
    prompt_len ~ lognormal(mu=4.583, sigma=1.0), output_len ~ lognormal(mu=5.418, sigma=0.9),
    rounded to integers. The mus put the means (before the filter) at 161 prompt and 338 output tokens,
    the ShareGPT averages the vLLM paper reports (Kwon et al. 2023, Fig. 11); the sigmas give the long
    right tail of that dataset. Pairs are redrawn (not clipped) until they pass the filter `vllm bench serve`
    applies to ShareGPT: prompt_len in 4..1024, output_len >= 4, prompt_len + output_len <= 2048.
`nano_vllm` (nano-vllm's bench.py, reproduced draw for draw): `random.seed(0)`; 256 prompts, each of
    `randint(100, 1024)` ids drawn `randint(0, 10000)`; then 256 output lengths `randint(100, 1024)`.
`batch1` (batch-1 decode against the roofline): N identical requests, a fixed prompt of
    `prompt_len` ids (seeded) and a fixed output length; the load generator sends them one at a time.
`shared-prefix` (prefix caching): N users share one system prompt of S ids; each asks one question of Q ids
    and gets an answer of A tokens. A cache may reuse S of every prompt but the first.
`multi-turn` (prefix caching): C conversations of T turns; turn 1 is a user message of U ids, turn t+1's
    prompt is turn t's prompt + an answer of A ids + a new user message of U ids, sent when turn t has
    finished (`BenchRequest.after`). The answer appended is the workload's own A ids standing for the
    model's (exact lengths on every server; a cache of decode blocks cannot hit it).
`reusable_prompt_tokens` (in `describe`): the prompt tokens a perfect cache could skip, each request's longest
    common prefix with an earlier request's prompt (the prefix reuse the workload allows).

Scale-down (`scaled`): the first `num_requests`, prompts truncated to `max_input`, outputs capped at
`max_output`; `vocab_size` folds ids into a small vocabulary (id % vocab_size), for random-weight
WordLevel tokenizers.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

SHAREGPT_PROMPT_MU, SHAREGPT_PROMPT_SIGMA = math.log(161.31) - 1.0 ** 2 / 2, 1.0
SHAREGPT_OUTPUT_MU, SHAREGPT_OUTPUT_SIGMA = math.log(337.99) - 0.9 ** 2 / 2, 0.9
SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN, SHAREGPT_MIN_LEN = 1024, 2048, 4
TOKEN_ID_HIGH = 10000  # nano-vllm draws ids in 0..10000; the other workloads use the same range


@dataclass(frozen=True)
class BenchRequest:
    """One request: prompt token ids and the number of tokens to generate."""

    prompt_ids: tuple[int, ...]
    output_len: int
    after: int | None = None  # index of the request that must finish before this one is sent
    messages: tuple[tuple[str, int], ...] = ()  # (role, ids) splitting the prompt into chat messages; (): one user

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    """A named request list and the parameters that produced it (written into the result JSON)."""

    name: str
    requests: tuple[BenchRequest, ...]
    params: dict = field(default_factory=dict)
    temperature: float = 0.0
    max_concurrency: int | None = None  # batch1 forces 1

    def describe(self) -> dict:
        prompt_lens = [r.prompt_len for r in self.requests]
        output_lens = [r.output_len for r in self.requests]
        return {"name": self.name, "params": self.params, "temperature": self.temperature,
                "num_requests": len(self.requests), "total_prompt_len": sum(prompt_lens),
                "reusable_prompt_tokens": reusable_prompt_tokens(self.requests),
                "total_output_len": sum(output_lens), "max_prompt_len": max(prompt_lens, default=0),
                "max_output_len": max(output_lens, default=0)}


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randint(0, TOKEN_ID_HIGH) for _ in range(n))


def _sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    while True:
        prompt_len = round(rng.lognormvariate(SHAREGPT_PROMPT_MU, SHAREGPT_PROMPT_SIGMA))
        output_len = round(rng.lognormvariate(SHAREGPT_OUTPUT_MU, SHAREGPT_OUTPUT_SIGMA))
        if (SHAREGPT_MIN_LEN <= prompt_len <= SHAREGPT_MAX_PROMPT_LEN and output_len >= SHAREGPT_MIN_LEN
                and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN):
            return prompt_len, output_len


def sharegpt(num_requests: int = 1000, seed: int = 0) -> Workload:
    """Chat-like lengths with the ShareGPT shape (see the module docstring for the parameters)."""
    rng = random.Random(seed)
    lengths = [_sharegpt_lengths(rng) for _ in range(num_requests)]
    requests = tuple(BenchRequest(_ids(rng, p), o) for p, o in lengths)
    params = {"seed": seed, "num_requests": num_requests,
              "prompt_lognormal": [SHAREGPT_PROMPT_MU, SHAREGPT_PROMPT_SIGMA],
              "output_lognormal": [SHAREGPT_OUTPUT_MU, SHAREGPT_OUTPUT_SIGMA],
              "max_prompt_len": SHAREGPT_MAX_PROMPT_LEN, "max_total_len": SHAREGPT_MAX_TOTAL_LEN}
    return Workload("sharegpt", requests, params)


def nano_vllm(num_requests: int = 256, seed: int = 0, min_len: int = 100, max_len: int = 1024) -> Workload:
    """nano-vllm's bench.py workload: same draws in the same order, so the same token ids."""
    rng = random.Random(seed)
    prompts = [_ids(rng, rng.randint(min_len, max_len)) for _ in range(num_requests)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    requests = tuple(BenchRequest(p, o) for p, o in zip(prompts, output_lens))
    params = {"seed": seed, "num_requests": num_requests, "input_len": [min_len, max_len],
              "output_len": [min_len, max_len]}
    return Workload("nano-vllm", requests, params, temperature=0.6)


def batch1(num_requests: int = 4, prompt_len: int = 128, output_len: int = 256, seed: int = 0) -> Workload:
    """One stream at a time: the same prompt and output length, for decode latency against the roofline."""
    request = BenchRequest(_ids(random.Random(seed), prompt_len), output_len)
    params = {"seed": seed, "num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len}
    return Workload("batch1", (request,) * num_requests, params, max_concurrency=1)


def shared_prefix(num_requests: int = 64, system_len: int = 2000, question_len: int = 50, output_len: int = 100,
                  seed: int = 0) -> Workload:
    """N users, one shared system prompt, a short question each."""
    rng = random.Random(seed)
    system = _ids(rng, system_len)
    roles = (("system", system_len), ("user", question_len))
    requests = tuple(BenchRequest(system + _ids(rng, question_len), output_len, messages=roles)
                     for _ in range(num_requests))
    params = {"seed": seed, "num_requests": num_requests, "system_len": system_len, "question_len": question_len,
              "output_len": output_len}
    return Workload("shared-prefix", requests, params)


def multi_turn(num_conversations: int = 16, num_turns: int = 4, user_len: int = 64, output_len: int = 128,
               seed: int = 0) -> Workload:
    """Conversations whose every turn resends the whole history (see the module docstring)."""
    rng = random.Random(seed)
    turns = [_conversation(rng, num_turns, user_len, output_len) for _ in range(num_conversations)]
    # turn-major order (every conversation's turn 1 first): request t * C + c is turn t of conversation c
    requests = tuple(replace(turns[c][t], after=(t - 1) * num_conversations + c if t else None)
                     for t in range(num_turns) for c in range(num_conversations))
    params = {"seed": seed, "num_conversations": num_conversations, "num_turns": num_turns, "user_len": user_len,
              "output_len": output_len}
    return Workload("multi-turn", requests, params)


def _conversation(rng: random.Random, num_turns: int, user_len: int, output_len: int) -> list[BenchRequest]:
    prompt, roles, out = _ids(rng, user_len), (("user", user_len),), []
    for _ in range(num_turns):
        out.append(BenchRequest(prompt, output_len, None, roles))
        prompt = prompt + _ids(rng, output_len) + _ids(rng, user_len)
        roles = roles + (("assistant", output_len), ("user", user_len))
    return out


def reusable_prompt_tokens(requests) -> int:
    """Sum over requests of the longest common prefix with an earlier request's prompt (a token trie)."""
    root: dict = {}
    total = 0
    for r in requests:
        node, shared, matching = root, 0, True
        for token in r.prompt_ids:
            child = node.get(token)
            if child is None:
                child, matching = node.setdefault(token, {}), False
            elif matching:
                shared += 1
            node = child
        total += shared
    return total


WORKLOADS = {"sharegpt": sharegpt, "nano-vllm": nano_vllm, "batch1": batch1, "shared-prefix": shared_prefix,
             "multi-turn": multi_turn}


def scaled(workload: Workload, num_requests: int | None = None, max_input: int | None = None,
           max_output: int | None = None, vocab_size: int | None = None) -> Workload:
    """A smaller version for tests and the CPU engine; the cuts are recorded in `params['scaled']`."""
    requests = workload.requests[:num_requests] if num_requests else workload.requests
    requests = tuple(_cut(r, max_input, max_output, vocab_size) for r in requests)
    cuts = {"num_requests": num_requests, "max_input": max_input, "max_output": max_output,
            "vocab_size": vocab_size}
    cuts = {k: v for k, v in cuts.items() if v}
    if not cuts:
        return workload
    return replace(workload, requests=requests, params={**workload.params, "scaled": cuts})


def _cut(r: BenchRequest, max_input: int | None, max_output: int | None, vocab_size: int | None) -> BenchRequest:
    ids = r.prompt_ids[:max_input] if max_input else r.prompt_ids
    if vocab_size:
        ids = tuple(i % vocab_size for i in ids)
    messages = r.messages if len(ids) == r.prompt_len else ()  # a cut prompt is one user message
    return BenchRequest(ids, min(r.output_len, max_output) if max_output else r.output_len, r.after, messages)
