"""Every failure of a request as the JSON answer the contract gives it, whatever the transport.

Used by the aiohttp route wrapper (relay/app.py `observed`) and the fast path
(relay/http/fastpath.py), so both answer a failure with the same status, body and headers.
"""

from __future__ import annotations

import logging

from aiohttp import web

from relay.api.errors import ApiError, error_response
from relay.http import logsafe
from relay.http.parse_errors import describe_parse_error
from relay.service import TooManyWaiters, Unavailable
from relay.storage.store import StoreRejected

log = logging.getLogger("relay.app")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 400: "bad_request"}


def error_for(exc: BaseException) -> web.Response:
    if isinstance(exc, ApiError):
        return exc.response()
    if isinstance(exc, Unavailable):
        return error_response(
            503,
            exc.code,
            f"temporarily unavailable: {exc.reason}",
            {"Retry-After": str(exc.retry_after_s)},
            {"retryAfterMs": exc.retry_after_s * 1000},
        )
    if isinstance(exc, TooManyWaiters):
        return error_response(503, "too_many_waiters", "too many waiting requests", {"Retry-After": "1"})
    if isinstance(exc, StoreRejected):
        return error_response(507, "storage_full", "the shard is out of memory; nothing was stored")
    if isinstance(exc, web.RequestPayloadError):  # the parser refused the body mid-read (e.g. chunk size)
        code, text = describe_parse_error(exc.__cause__)
        return error_response(400, code, text, {"Connection": "close"})
    if isinstance(exc, web.HTTPException):
        code = _HTTP_CODES.get(exc.status, "http_error")
        return error_response(
            exc.status, code, exc.reason.lower(), {k: v for k, v in exc.headers.items() if k == "Allow"}
        )
    log.error("unhandled exception in a request handler: %s", logsafe.describe(exc))
    return error_response(500, "internal_error", "internal error")


def code_of(response: web.Response) -> str:
    """The "code" of a JSON error body (what relayfleet_rejected_total counts by)."""
    body = response.body
    if isinstance(body, bytes):
        marker = body.find(b'"code":"')
        if marker >= 0:
            end = body.find(b'"', marker + 8)
            return body[marker + 8 : end].decode("ascii", "replace")[:40]
    return str(response.status)
