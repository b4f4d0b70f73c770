"""A random model under a grammar, for tests of the mask mechanism without an engine: it samples uniformly
among the tokens a mask allows (then, past a soft budget, prefers EOS and closing characters so that an
unbounded string or array ends). Any output it can produce must match the grammar: that is the test."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from gateway.structured.grammar import Compiled, Grammars

CLOSERS = {'"': 0, "@": 1, "]": 2, "}": 3}  # in this order: a string, an email, an array, an object


def allowed_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in mask `words` ([mask_words] uint32, bit t % 32 of word t // 32)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class RandomSampler:
    def __init__(self, tokenizer: Tokenizer, eos_id: int, seed: int = 0, soft_budget: int = 48):
        self.vocab_size, self.eos_id, self.soft_budget = tokenizer.get_vocab_size(), eos_id, soft_budget
        self.texts = [tokenizer.decode([i]) for i in range(self.vocab_size)]
        self.rng = np.random.default_rng(seed)

    def sample(self, words: np.ndarray, step: int) -> int:
        ids = allowed_ids(words, self.vocab_size)
        assert len(ids), "a mask that allows no token"
        if step < self.soft_budget:
            return int(self.rng.choice(ids))
        if self.eos_id in ids:
            return self.eos_id
        closing = [i for i in ids if self.texts[i] in CLOSERS]
        if closing and self.rng.random() < 0.6:
            return int(min(closing, key=lambda i: CLOSERS[self.texts[i]]))
        short = [i for i in ids if len(self.texts[i]) == 1] or list(ids)
        return int(self.rng.choice(short))


def generate(grammars: Grammars, compiled: Compiled, sampler: RandomSampler, max_tokens: int = 600) -> list[int]:
    """Tokens sampled under the grammar's masks, as the engine would with the gateway's masks (EOS not included).
    Fails if the grammar has not finished within `max_tokens`."""
    matcher, words, out = compiled.new_matcher(), compiled.first_mask, []
    for step in range(max_tokens):
        token = sampler.sample(words, step)
        if token == sampler.eos_id:
            return out
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
        words = grammars.mask_of(matcher)
    raise AssertionError(f"no EOS within {max_tokens} tokens")
