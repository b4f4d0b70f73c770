"""OpenAI-style error values: what a client gets instead of a stack trace."""

from __future__ import annotations

import math

from aiohttp import web

from protocols.openai import ErrorBody, ErrorDetail


class ApiError(Exception):
    """An error the client can act on: HTTP status plus an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}  # e.g. Retry-After; gRPC sends them as trailing metadata
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)

    def body(self) -> ErrorBody:
        return ErrorBody(error=self.detail)

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.body().model_dump_json(),
                            content_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def server_error(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


def rate_limited(message: str, retry_after_s: float, type: str = "requests") -> ApiError:
    """A 429 as OpenAI sends it (type `requests` or `tokens`), with Retry-After in whole seconds."""
    retry_after = str(max(1, math.ceil(retry_after_s)))
    return ApiError(429, f"{message}; retry after {retry_after} s", type=type, code="rate_limit_exceeded",
                    headers={"Retry-After": retry_after})


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, type="permission_error", code="permission_denied")


def request_timeout(message: str) -> ApiError:
    """A 408: the client sent its request too slowly; the connection is closed after it."""
    return ApiError(408, message, code="request_timeout", headers={"Connection": "close"})


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="service_unavailable")


class Overloaded(ApiError):
    """A request shed under load: a 503 with Retry-After (gRPC: UNAVAILABLE with `retry-after` metadata),
    counted in `blink:num_requests_shed_total`."""


def overloaded(message: str, retry_after_s: float) -> Overloaded:
    """Every ring slot stayed busy: come back in `retry_after_s` (sent in whole seconds, at least 1)."""
    retry_after = str(max(1, math.ceil(retry_after_s)))
    return Overloaded(503, f"{message}; retry after {retry_after} s", type="server_error",
                      code="service_unavailable", headers={"Retry-After": retry_after})


_HTTP_TYPES = {401: "authentication_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error"}


def from_http_exception(exc: web.HTTPException, path: str) -> ApiError:
    """aiohttp's own errors (no route, wrong method, body too large) as OpenAI error objects."""
    messages = {404: f"no route for {path}", 405: f"method not allowed for {path}",
                413: "request body too large"}
    message = messages.get(exc.status, exc.reason or "request failed")
    if exc.status == 413 and exc.text:
        message = f"request body too large: {exc.text.strip()}"
    return ApiError(exc.status, message, type=_HTTP_TYPES.get(exc.status, "invalid_request_error"),
                    code="not_found" if exc.status == 404 else None)
