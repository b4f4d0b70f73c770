"""Per-key rate limits: requests/minute and tokens/minute (token buckets), streams in flight.

One `Quotas` per gateway worker: with `--workers N` each worker enforces a key's limits on its own,
so a key may reach N times its limits through N workers (the kernel spreads connections among them).
Tokens are charged as they are known: the prompt at admission, the completion when the request ends;
a bucket may go into debt, and the key waits until it is paid back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import rate_limited
from .keys import KeyLimits, Principal


class TokenBucket:
    """`per_minute` units, refilled continuously; `level` may go negative (debt)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self.rate_per_s = per_minute / 60.0
        self.level = float(per_minute)
        self._clock = clock
        self._t = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.per_minute, self.level + (now - self._t) * self.rate_per_s)
        self._t = now

    def wait_s(self, need: float = 1.0) -> float:
        """Seconds until `need` units are there (0: now)."""
        self._refill()
        return max(0.0, (need - self.level) / self.rate_per_s)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


@dataclass
class KeyUsage:
    """One key's buckets and in-flight count in this worker."""

    limits: KeyLimits
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    num_in_flight: int = 0
    num_rejected: int = 0

    def update(self, limits: KeyLimits, clock: Callable[[], float]) -> None:
        """New limits (a reloaded keys file): buckets whose size changed start full."""
        self.limits = limits
        self.requests = _bucket(self.requests, limits.requests_per_minute, clock)
        self.tokens = _bucket(self.tokens, limits.tokens_per_minute, clock)


def _bucket(old: TokenBucket | None, per_minute: int | None, clock) -> TokenBucket | None:
    if per_minute is None:
        return None
    return old if old is not None and old.per_minute == per_minute else TokenBucket(per_minute, clock)


@dataclass
class Admission:
    """One admitted generation: charge its tokens, and `close` it once (frees its stream)."""

    usage: KeyUsage | None = None
    closed: bool = False

    def charge(self, num_tokens: int) -> None:
        if self.usage is not None and self.usage.tokens is not None and num_tokens:
            self.usage.tokens.take(num_tokens)

    def close(self, num_completion_tokens: int = 0) -> None:
        if not self.closed and self.usage is not None:
            self.closed = True
            self.charge(num_completion_tokens)
            self.usage.num_in_flight -= 1


@dataclass
class Quotas:
    clock: Callable[[], float] = time.monotonic
    by_key: dict[str, KeyUsage] = field(default_factory=dict)

    def admit(self, principal: Principal | None) -> Admission:
        """Admit one generation for `principal`, or raise a 429 `rate_limit_exceeded` with Retry-After."""
        if principal is None:
            return Admission()
        usage = self._usage(principal)
        limits = usage.limits
        try:
            if limits.max_streams is not None and usage.num_in_flight >= limits.max_streams:
                raise rate_limited(f"key '{principal.name}' has {usage.num_in_flight} requests in flight, its "
                                   f"limit (max_streams) is {limits.max_streams}", 1.0, "requests")
            if usage.requests is not None and (wait_s := usage.requests.wait_s(1.0)) > 0:
                raise rate_limited(f"key '{principal.name}' is over its limit of {limits.requests_per_minute} "
                                   f"requests per minute", wait_s, "requests")
            if usage.tokens is not None and (wait_s := usage.tokens.wait_s(1.0)) > 0:
                raise rate_limited(f"key '{principal.name}' is over its limit of {limits.tokens_per_minute} "
                                   f"tokens per minute (prompt + completion)", wait_s, "tokens")
        except Exception:
            usage.num_rejected += 1
            raise
        if usage.requests is not None:
            usage.requests.take(1)
        usage.num_in_flight += 1
        return Admission(usage)

    def _usage(self, principal: Principal) -> KeyUsage:
        usage = self.by_key.get(principal.name)
        if usage is None:
            usage = self.by_key[principal.name] = KeyUsage(principal.limits)
            usage.update(principal.limits, self.clock)
        elif usage.limits != principal.limits:
            usage.update(principal.limits, self.clock)
        return usage

    def in_flight(self) -> dict[str, int]:
        return {name: u.num_in_flight for name, u in self.by_key.items()}
