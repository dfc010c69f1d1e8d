"""The API's error shape: every 4xx/5xx body is {"error": text, "code": snake_case, ...}."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        text: str,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(text)
        self.status = status
        self.code = code
        self.text = text
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def response(self) -> web.Response:
        return error_response(self.status, self.code, self.text, self.headers, self.extra)


def error_response(
    status: int,
    code: str,
    text: str,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> web.Response:
    body = {"error": text, "code": code, **(extra or {})}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def bad_request(text: str, code: str = "bad_request") -> ApiError:
    return ApiError(400, code, text)


def unauthorized(text: str, scheme: str = "Relay-Ed25519") -> ApiError:
    return ApiError(401, "unauthorized", text, {"WWW-Authenticate": scheme})


def overloaded() -> ApiError:
    """503 from the memory guard (RELAY_MAX_RSS_MB): new work refused, retry soon."""
    return ApiError(
        503,
        "overloaded",
        "the relay is near its memory ceiling; retry later",
        {"Retry-After": "1"},
        {"retryAfterMs": 1000},
    )
