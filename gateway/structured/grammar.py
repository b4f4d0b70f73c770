"""One model's grammars: llguidance's tokenizer for it (built once), constraints compiled off the event loop
with a size and a time limit, cached by their text, and a fresh matcher per request.

Why llguidance (README): it computes a mask in tens of microseconds on a CPU core with the GIL released, needs
no torch (the gateway runs without it), and takes JSON schemas, regexes, choices and Lark/GBNF grammars.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np
from tokenizers import Tokenizer

from ..errors import bad_request
from .constraint import MAX_GRAMMAR_BYTES, Constraint

COMPILE_TIMEOUT_S = 10.0  # a grammar whose compilation takes longer is refused (400)
COMPILE_THREADS = 2
CACHE_SIZE = 256  # compiled grammars kept per model (least recently used first out)
# JSON as compact as the schema lets it be: a model (a random one too) cannot spin on whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own work limits (fuel per mask, lexer states, grammar size): a pathological schema errors
# instead of taking a core for seconds per token.
PARSER_LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=250_000,
                     max_grammar_size=500_000)

# llguidance's slicer: token sets whose regex a lexer state accepts whole are added to the mask without walking
# their tries. Its default (`general_slices`: string content of 1-10, 1-30 or any length) walks nearly the whole
# vocabulary near the end of a bounded string (`maxLength`: 10 characters or fewer left); finer bounds let it
# skip the tokens that still fit. Measured with bench/mask_cost.py (bench/RESULTS.md).
_STRING_CHARS = r'[^"\\\x00-\x1F\x7F]'  # a JSON string's plain characters (llguidance's own slices use it)
MASK_SLICES = [r"[\x20\x0A\x0D\x09]+",
               *(f"{_STRING_CHARS}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 30, 40, 60, 100)),
               f"{_STRING_CHARS}+"]


_compile_pool: ThreadPoolExecutor | None = None


def compile_pool() -> ThreadPoolExecutor:
    """Compilation's own threads: a slow grammar never holds up the mask steps of streams (`mask_loop.py`)."""
    global _compile_pool
    if _compile_pool is None:
        _compile_pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar-compile")
    return _compile_pool


def mask_words(vocab_size: int) -> int:
    """uint32 words of a token mask: bit t % 32 of word t // 32 is token t."""
    return (vocab_size + 31) // 32


class Compiled:
    """A compiled grammar: a matcher in its start state to copy per request, and its first mask."""

    __slots__ = ("matcher", "first_mask")

    def __init__(self, matcher: llguidance.LLMatcher, first_mask: np.ndarray):
        self.matcher, self.first_mask = matcher, first_mask  # first_mask: [mask_words] uint32

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.matcher.deep_copy()


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked: `Grammars.compile` does). ValueError if the
    text does not parse as its kind says."""
    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, overrides=JSON_OPTIONS)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if constraint.kind == "choice":
        return llguidance.grammar_from("choice", constraint.text)
    return llguidance.grammar_from("grammar", constraint.text)


def check_sync(constraint: Constraint) -> None:
    """A 400 naming the constraint's field unless it compiles (no tokenizer needed). Blocking."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint),
                                                      limits=llguidance.LLParserLimits(**PARSER_LIMITS))
    except ValueError as exc:
        error = str(exc)
    if error:
        raise bad_request(f"'{constraint.param}' does not compile: {_first_line(error)}", constraint.param)


async def check(constraints: Sequence[Constraint]) -> None:
    """`check_sync` of each, off the event loop, within COMPILE_TIMEOUT_S."""
    for constraint in constraints:
        if len(constraint.text.encode()) > MAX_GRAMMAR_BYTES:
            raise bad_request(f"'{constraint.param}' is over this server's limit of {MAX_GRAMMAR_BYTES} bytes",
                              constraint.param)
    if not constraints:
        return
    work = asyncio.get_running_loop().run_in_executor(compile_pool(), lambda: [check_sync(c) for c in constraints])
    try:
        await asyncio.wait_for(work, COMPILE_TIMEOUT_S)
    except TimeoutError:
        raise bad_request(f"'{constraints[0].param}': checking the schemas took over {COMPILE_TIMEOUT_S:g} s",
                          constraints[0].param) from None


class Grammars:
    """One model's compiled grammars. `compile` is async (the work runs in `executor`); the rest is cheap."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int], num_words: int | None = None):
        """`num_words`: the ring's mask words (geometry.mask_words); by default those of `vocab_size`."""
        self._hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.num_words = num_words or mask_words(vocab_size)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._build_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], Compiled] = collections.OrderedDict()
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about 0.5 s for a 50k vocabulary): call it off the event loop."""
        with self._build_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=list(self.eos_ids), slices=MASK_SLICES)
            return self._ll_tokenizer

    async def compile(self, constraint: Constraint) -> Compiled:
        """The constraint's grammar, from the cache or compiled now off the event loop. A 400 naming
        `constraint.param` when it is too large, does not compile, or takes over COMPILE_TIMEOUT_S."""
        cached = self._cache.get(constraint.key)
        if cached is not None:
            self._cache.move_to_end(constraint.key)
            return cached
        size = len(constraint.text.encode())
        if size > MAX_GRAMMAR_BYTES:
            raise bad_request(f"'{constraint.param}' is {size} bytes, over this server's limit of "
                              f"{MAX_GRAMMAR_BYTES}", constraint.param)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(compile_pool(), self.compile_sync, constraint)
        try:
            compiled = await asyncio.wait_for(work, COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise bad_request(f"'{constraint.param}': compiling it took over {COMPILE_TIMEOUT_S:g} s, this "
                              f"server's limit", constraint.param) from None
        self._cache[constraint.key] = compiled
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def compile_sync(self, constraint: Constraint) -> Compiled:
        """Blocking `compile` without the cache or the time limit (llguidance releases the GIL)."""
        try:
            grammar = grammar_text(constraint)
        except ValueError as exc:
            raise bad_request(f"'{constraint.param}' is not a valid {constraint.kind.replace('_', ' ')}: {exc}",
                              constraint.param) from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise bad_request(f"'{constraint.param}' does not compile: {_first_line(matcher.get_error())}",
                              constraint.param)
        first = self.mask_of(matcher)
        if matcher.is_error():
            raise bad_request(f"'{constraint.param}' does not compile: {_first_line(matcher.get_error())}",
                              constraint.param)
        return Compiled(matcher, first)

    def mask_of(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """The matcher's mask for the next token: [num_words] uint32, read-only. A stopped grammar's allows EOS
        only."""
        if matcher.is_stopped() and not matcher.is_error():
            return self.eos_mask()
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)  # llguidance's layout is ours
        if len(words) < self.num_words:  # a ring sized for more tokens than the model has: those stay banned
            return np.concatenate([words, np.zeros(self.num_words - len(words), dtype=np.uint32)])
        # a read-only view of the library's fresh bytes, no copy: numpy lets go of the GIL to copy 16 KB, and a
        # mask thread then waits for it again behind the event loop (bench/NOTES.md, structured outputs)
        return words[:self.num_words]

    def eos_mask(self) -> np.ndarray:
        words = np.zeros(self.num_words, dtype=np.uint32)
        for t in self.eos_ids:
            words[t // 32] |= np.uint32(1 << (t % 32))
        return words


def allows(words: np.ndarray, token_id: int) -> bool:
    """Whether mask `words` allows `token_id`."""
    return bool(int(words[token_id // 32]) >> (token_id % 32) & 1)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return "; ".join(lines[:3])[:500] or "unknown error"
