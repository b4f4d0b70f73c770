"""API keys: `Authorization: Bearer <key>` on every route but the open ones.

Client keys call the inference API (/v1, gRPC); admin keys call /admin/. A key is one, the other or
both (`gateway/policy/keys.py`). A client key on /admin gets a 403, an admin-only key on /v1 too.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from ..errors import ApiError, forbidden
from .keys import KeyStore, Principal

OPEN_PATHS = frozenset({"/health", "/metrics"})  # for load balancers and Prometheus scrapers
METRICS_PATH = "/metrics"  # open, or behind its own key (`GatewayConfig.metrics_key`)
ADMIN_PREFIX = "/admin/"
PRINCIPAL = web.RequestKey("principal", object)  # the Principal of an authenticated request (None: auth off)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="authentication_error", code="invalid_api_key")


def _bearer(header: str | None) -> str:
    if not header:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        raise _unauthorized("incorrect API key provided")
    return key.strip()


def check_key(header: str | None, api_keys: Iterable[str]) -> None:
    """Raise a 401 ApiError unless `header` is `Bearer <one of api_keys>`."""
    key = _bearer(header)
    # Compare with every key, in constant time per key, so timing does not reveal which one nearly matched.
    matched = [hmac.compare_digest(key.encode(), k.encode()) for k in api_keys]
    if not any(matched):
        raise _unauthorized("incorrect API key provided")


def identify(header: str | None, keys: KeyStore) -> Principal:
    principal = keys.identify(_bearer(header))
    if principal is None:
        raise _unauthorized("incorrect API key provided")
    return principal


def client_principal(header: str | None, keys: KeyStore) -> Principal | None:
    """Who calls the inference API; None when no client key is configured (open). Raises 401/403."""
    if not keys.auth_enabled:
        return None
    principal = identify(header, keys)
    if not principal.client:
        raise forbidden("this is an admin key: the inference API needs a client key")
    return principal


def admin_principal(header: str | None, keys: KeyStore) -> Principal:
    if not keys.admin_enabled:
        raise forbidden("the admin API is off: start the gateway with an admin key (`blink serve --admin-key KEY`, "
                        "`blink gateway --admin-key KEY`, or BLINK_ADMIN_KEY=KEY for either), or with an admin "
                        "key in its --keys file")
    principal = identify(header, keys)
    if not principal.admin:
        raise forbidden("this key may not call the admin API; use the admin key")
    return principal


def check_metrics_key(header: str | None, metrics_key: str) -> None:
    """Raise a 401 ApiError unless `header` is `Bearer <metrics_key>` (API and admin keys do not open it)."""
    if not header:
        raise _unauthorized("/metrics needs the metrics key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(_bearer(header).encode(), metrics_key.encode()):
        raise _unauthorized("incorrect metrics key provided")


def auth_middleware(keys: KeyStore | frozenset[str], metrics_key: str | None = None) -> Callable:
    """Client keys on the API, admin keys on /admin/, `metrics_key` (when set) on /metrics."""
    if not isinstance(keys, KeyStore):  # a set of plain keys, as before the keys file
        keys = KeyStore(plain_client_keys=keys)

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable]):
        if request.match_info.http_exception is not None:  # no such route (or method): its 404/405, key or not
            return await handler(request)
        header = request.headers.get("Authorization")
        if request.path.startswith(ADMIN_PREFIX):
            request[PRINCIPAL] = admin_principal(header, keys)
        elif request.path == METRICS_PATH and metrics_key is not None:
            check_metrics_key(header, metrics_key)
        elif request.path not in OPEN_PATHS:
            request[PRINCIPAL] = client_principal(header, keys)
        return await handler(request)

    return middleware
