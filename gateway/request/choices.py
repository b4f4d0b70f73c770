"""A request's n choices: one `Generation` (one ring request) each, read as one stream of pieces.

`n` is fanned out here, in the gateway, so it works in every engine mode: the engine sees n ordinary
requests (seeds seed, seed+1, ... when the client gave one). The prompt is tokenized and charged once.
A /v1/completions batch of prompts has n choices per prompt, in index order prompt_i * n + j.
A choice that fails fails the request; `close` cancels every choice still running in the engine and
their slots come back as usual (the poller releases each once the engine confirms).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..api.formats import ChoiceOutput
from .generate import Generation, Piece
from .tokenize import TokenizerService


class Choices:
    def __init__(self, gens: list[Generation], tokenizer: TokenizerService,
                 on_close: Callable[[int], None] | None = None, prompt_len: int | None = None, n: int = 1):
        self.gens = gens
        self.n = n  # choices per prompt: gens[i * n] is prompt i's first
        self._prompt_len = prompt_len  # every prompt's tokens, once each (a batch has several); None: gens[0]'s
        self.tokenizer = tokenizer  # the model's: token texts for logprobs, the echoed prompt
        self.on_close = on_close  # called once with the completion tokens of every choice (quotas)
        self._remaining = len(gens)
        self._queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._closed = False

    @property
    def request_id(self) -> int:
        return self.gens[0].request_id

    @property
    def prompt_len(self) -> int:
        """The prompt tokens usage counts: each prompt once, whatever n."""
        return self.gens[0].prompt_len if self._prompt_len is None else self._prompt_len

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine reused from its prefix cache, counted as `prompt_len` counts: each prompt
        once (its first choice's)."""
        return sum(g.cached_tokens for g in self.gens[::self.n])

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.gens)

    @property
    def finished(self) -> bool:
        """Every choice has sent its last piece."""
        return self._remaining == 0

    @property
    def in_order(self) -> bool:
        """No piece waits for the reader: a piece of any choice written now comes after every one before it."""
        return self._queue.empty()

    async def next_piece(self) -> tuple[int, Piece] | None:
        """(choice index, piece) in arrival order; None once every choice has finished. Raises ApiError."""
        if self._remaining == 0:
            return None
        if len(self.gens) == 1:  # no task and no queue on the common path
            index, piece = 0, await self.gens[0].next_piece()
        else:
            if not self._pumps:
                self._pumps = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self.gens)]
            index, piece, error = await self._queue.get()
            if error is not None:
                raise error
        if piece.finish_reason:
            self._remaining -= 1
        return index, piece

    async def _pump(self, index: int, gen: Generation) -> None:
        try:
            while not (piece := await gen.next_piece()).finish_reason:
                self._queue.put_nowait((index, piece, None))
            self._queue.put_nowait((index, piece, None))
        except Exception as exc:  # ApiError mostly; anything else must not leave the reader waiting
            self._queue.put_nowait((index, None, exc))

    async def collect(self) -> list[ChoiceOutput]:
        """Every choice to its end."""
        outputs = [ChoiceOutput() for _ in self.gens]
        while (item := await self.next_piece()) is not None:
            index, piece = item
            out = outputs[index]
            out.text += piece.text
            out.logprobs += zip(piece.token_ids, piece.logprobs)
            if piece.finish_reason:
                out.finish_reason = piece.finish_reason
        return outputs

    def close(self) -> None:
        """Stop reading; cancel what still runs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._pumps:
            task.cancel()
        for gen in self.gens:
            gen.close()
        if self.on_close is not None:
            self.on_close(self.completion_tokens)
