"""How the gateway uses Python's cyclic garbage collector: kept out of the streaming path.

Refcounting frees what a request makes the moment the request ends, as long as the request makes no
reference cycle (a test holds the gateway to that: `test_requests_leave_no_cyclic_garbage`). The cyclic
collector is then only a safety net, but left to itself it is the gateway's longest stall: a young
collection walks every tracked object made since the last one, and with hundreds of streams open those
are mostly the open requests' own (~110 each: coroutines, aiohttp's request and parser, formats...). At 512
streams that was 40,000-60,000 objects, a 7-52 ms stop of every stream every few seconds (bench/RESULTS.md,
"The cyclic GC out of the streaming path").

So, once the gateway is up:
- every `gc_freeze_s` it moves every tracked object out of the collector's sight (`gc.freeze()`, a few
  microseconds: two list splices). Objects frozen while alive are still freed by refcounting when their
  request ends. Automatic young collections come after `THRESHOLDS[0]` allocations net of frees since the
  last one or the last freeze: one tick of 512 streams makes a few thousand, so in practice none come (at
  Python's 700 they came every ~0.5 s and took ~1 ms each, walking what the tick had made).
- A full collection (unfreeze, collect, freeze) bounds what cycles that slip through can hold: it runs
  once the process has `gc_full_growth_blocks` more small-object blocks (`sys.getallocatedblocks()`, ~25 us)
  than its lowest count since the last full collection. A steady load that makes no cycles never reaches it;
  a live set that grows by that much costs one collection that finds nothing.
- `POST /admin/gc` runs a full collection now and says what it found, by type.

`gc_freeze_s: 0` leaves Python's own collector running (young threshold 20,000 as well).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import sys
import time

log = logging.getLogger("blink.gateway.gc")

# Young collections every 20,000 net allocations instead of 700: streamed tokens allocate a few tracked
# objects each that die within one poll round (without freezing: 400 ms of GC in a 512-stream run at 700,
# 60 ms at 20,000).
THRESHOLDS = (20_000, 20, 10)


class GcPolicy:
    """Started once the gateway is up (`start`), in its event loop; `stop` before the loop ends."""

    def __init__(self, freeze_s: float = 0.1, full_growth_blocks: int = 1_000_000):
        if freeze_s < 0 or full_growth_blocks < 1:
            raise ValueError("gc_freeze_s must be >= 0 and gc_full_growth_blocks >= 1")
        self.freeze_s, self.full_growth_blocks = freeze_s, full_growth_blocks
        self.full_collections = 0  # how many full collections have run (by growth or asked for)
        self.last_full: dict | None = None  # what the last one found (see `full_collection`)
        self._floor_blocks = sys.getallocatedblocks()  # the lowest block count since the last full collection
        self._timer: asyncio.TimerHandle | None = None
        self._started = False  # whether `start` froze the process (a gateway inside tests is never frozen)

    @property
    def active(self) -> bool:
        return self.freeze_s > 0

    def start(self) -> None:
        """What start-up built lives as long as the process: collected once, then frozen."""
        gc.collect()
        gc.freeze()
        self._started = True
        self._floor_blocks = sys.getallocatedblocks()
        gc.set_threshold(*THRESHOLDS)
        if self.active:
            self._timer = asyncio.get_running_loop().call_later(self.freeze_s, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        try:
            self.tick()
        finally:
            self._timer = asyncio.get_running_loop().call_later(self.freeze_s, self._tick)

    def tick(self) -> None:
        """Freeze what survived the last tick; a full collection once the process has grown enough."""
        gc.freeze()
        blocks = sys.getallocatedblocks()
        if blocks < self._floor_blocks:
            self._floor_blocks = blocks
        elif blocks - self._floor_blocks >= self.full_growth_blocks:
            self.full_collection(reason="growth")

    def full_collection(self, reason: str = "asked", by_type: bool = False) -> dict:
        """Every object back in the collector's sight, one collection of all generations, frozen again.
        Returns {"unreachable", "ms", "blocks_before", "blocks_after", "reason"} and, with `by_type`,
        the unreachable objects' counts by type (the most common 20; costs a second collection)."""
        t0, blocks_before = time.perf_counter(), sys.getallocatedblocks()
        gc.unfreeze()
        types = None
        if by_type:  # kept instead of freed to be counted, then freed by a second collection
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                unreachable = gc.collect()
                types = dict(collections.Counter(_type_name(o) for o in gc.garbage).most_common(20))
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
            gc.collect()
        else:
            unreachable = gc.collect()
        if self._started:
            gc.freeze()
        self._floor_blocks = sys.getallocatedblocks()
        self.full_collections += 1
        self.last_full = {"reason": reason, "unreachable": unreachable,
                          "ms": round((time.perf_counter() - t0) * 1e3, 2),
                          "blocks_before": blocks_before, "blocks_after": self._floor_blocks}
        if types is not None:
            self.last_full["by_type"] = types
        log.info("full GC collection (%s): %d unreachable objects, %.1f ms, %d -> %d allocated blocks", reason,
                 unreachable, self.last_full["ms"], blocks_before, self._floor_blocks)
        return self.last_full

    def report(self) -> dict:
        """For /admin/status."""
        return {"policy": "freeze" if self.active else "python", "freeze_s": self.freeze_s,
                "full_growth_blocks": self.full_growth_blocks, "allocated_blocks": sys.getallocatedblocks(),
                "floor_blocks": self._floor_blocks, "full_collections": self.full_collections,
                "last_full": self.last_full}


def _type_name(obj: object) -> str:
    """A type's qualified name; a function's or coroutine's own name after it (what made the cycle)."""
    name = type(obj).__qualname__
    code = getattr(obj, "__code__", None) or getattr(obj, "cr_code", None)
    return f"{name} {code.co_qualname}" if code is not None and hasattr(code, "co_qualname") else name
