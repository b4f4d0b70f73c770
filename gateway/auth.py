"""API keys: `Authorization: Bearer <key>` on every route but the open ones."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from .errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # for load balancers and Prometheus scrapers


def check_key(header: str | None, api_keys: Iterable[str]) -> None:
    """Raise a 401 ApiError unless `header` is `Bearer <one of api_keys>`."""
    if not header:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    # Compare with every key, in constant time per key, so timing does not reveal which one nearly matched.
    matched = [hmac.compare_digest(key.encode(), k.encode()) for k in api_keys]
    if scheme.lower() != "bearer" or not any(matched):
        raise ApiError(401, "incorrect API key provided", type="authentication_error",
                       code="invalid_api_key")


def auth_middleware(api_keys: frozenset[str]) -> Callable:
    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable]):
        if request.path not in OPEN_PATHS:
            check_key(request.headers.get("Authorization"), api_keys)
        return await handler(request)

    return middleware
