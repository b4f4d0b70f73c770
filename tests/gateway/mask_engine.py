"""An in-process stand-in for the engine's side of structured outputs, to run the gateway's whole path (HTTP,
compile, first mask, the poller's mask loop, put_mask, tool formats) before the engine takes masks.

`MaskEngine` samples each token of a constrained request at random among those its mask allows, and waits
(that row only) until the mask of the token it is about to sample has arrived, as the engine must. An
unconstrained request answers the text after the last "SAY:" in its prompt (or echoes the prompt). The
ring's mask area is modelled by `MaskProducer.put_mask` (a dict), the first mask by `first_masks` (filled
in place of RequestSpec.token_mask, which the engine's branch adds).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from protocols.ring import EngineState, FinishReason, RingGeometry
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

from .structured_helpers import RandomSampler

BREAK_SEED = 666  # a request with this seed gets a token its mask bans (the gateway must end it clearly)


@dataclasses.dataclass(frozen=True)
class MaskGeometry:
    """A ring geometry with a mask area (`mask_words`), as the engine's branch declares it."""

    base: RingGeometry
    mask_words: int

    def __getattr__(self, name):
        return getattr(self.base, name)


class MaskProducer(ShmProducer):
    """The shm producer with a mask area: `put_mask` as the engine's branch adds it."""

    masks: dict[int, tuple[int, np.ndarray]]
    num_masks = 0

    def put_mask(self, slot: int, token_index: int, words: np.ndarray) -> None:
        assert words.dtype == np.uint32
        self.masks[slot] = (token_index, words.copy())
        MaskProducer.num_masks += 1


class MaskEngine:
    def __init__(self, ring, producer: MaskProducer, tokenizer, eos_id: int, step_s: float = 0.001):
        self.consumer, self.producer, self.tokenizer = RingConsumer(ring), producer, tokenizer
        producer.masks = {}
        self.eos_id, self.step_s = eos_id, step_s
        self.first_masks: dict[int, np.ndarray] = {}  # request id -> mask of token 0
        self.running: dict[int, list] = {}  # slot -> [seq, spec, produced, script or sampler]
        self.num_waits = 0  # steps a constrained row waited for its mask
        self.failure: BaseException | None = None

    async def run(self) -> None:
        try:
            while True:
                self.step()
                await asyncio.sleep(self.step_s)
        except Exception as exc:
            self.failure = exc
            raise

    def step(self) -> None:
        self.consumer.beat()
        self.consumer.set_state(EngineState.SERVING)
        for taken in self.consumer.take_new():
            self.producer.masks.pop(taken.slot, None)
            self.running[taken.slot] = [taken.seq, taken.spec, 0, self._plan(taken.spec)]
        for slot in list(self.running):
            self._advance(slot)

    def _plan(self, spec):
        if spec.request_id in self.first_masks:
            return RandomSampler(self.tokenizer, self.eos_id, seed=spec.seed or 0, soft_budget=6)
        text = self.tokenizer.decode(list(spec.prompt_ids), skip_special_tokens=False)
        said = text.rsplit("SAY:", 1)[1].split("<|im_end|>")[0] if "SAY:" in text else None
        return self.tokenizer.encode(said).ids + [self.eos_id] if said is not None else list(spec.prompt_ids)

    def _advance(self, slot: int) -> None:
        seq, spec, produced, plan = self.running[slot]
        if self.consumer.cancelled(slot, seq):
            return self._finish(slot, FinishReason.CANCELLED)
        if self.consumer.room(slot) == 0:
            return
        if isinstance(plan, RandomSampler):
            token = self._sample(slot, spec, produced, plan)
            if token is None:
                self.num_waits += 1
                return  # this row waits for its mask; the others go on
        else:
            token = plan[produced % len(plan)]
        self.consumer.publish(slot, [token])
        self.running[slot][2] = produced + 1
        if token == self.eos_id:
            self._finish(slot, FinishReason.STOP)
        elif produced + 1 >= spec.max_tokens:
            self._finish(slot, FinishReason.LENGTH)

    def _sample(self, slot: int, spec, produced: int, sampler: RandomSampler) -> int | None:
        if produced == 0:
            words = self.first_masks[spec.request_id]
        else:
            index, words = self.producer.masks.get(slot, (-1, None))
            if index != produced:
                return None
        if spec.seed == BREAK_SEED and produced == 2:
            banned = np.flatnonzero(np.unpackbits((~words).view(np.uint8), bitorder="little")[:sampler.vocab_size])
            return int(banned[0])
        return sampler.sample(words, produced)

    def _finish(self, slot: int, reason: FinishReason) -> None:
        self.consumer.finish(slot, reason)
        del self.running[slot]
