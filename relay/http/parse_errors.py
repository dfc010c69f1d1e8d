"""What aiohttp's parser refused, as a (code, text) pair of fixed texts: never the request's bytes.

A leaf (aiohttp only): the guarded protocol (relay/http/serving.py) answers a malformed head
with it, the route wrapper (relay/api/failures.py) a body the parser refused mid-read.
"""

from __future__ import annotations

from aiohttp import http_exceptions

# (status, code, text) per parser exception type; checked in order (subclasses first)
_PARSE_ERRORS: tuple[tuple[type[BaseException], str, str], ...] = (
    (http_exceptions.LineTooLong, "headers_too_large", "request line or header too long"),
    (http_exceptions.BadHttpMethod, "bad_request_line", "malformed request line"),
    (http_exceptions.BadStatusLine, "bad_request_line", "malformed request line"),
    (http_exceptions.InvalidURLError, "bad_request_line", "malformed request target"),
    (http_exceptions.InvalidHeader, "bad_header", "malformed header"),
    (http_exceptions.TransferEncodingError, "bad_chunk", "malformed chunked body"),
    (http_exceptions.ContentLengthError, "bad_length", "body length does not match the request"),
    (http_exceptions.PayloadEncodingError, "bad_body", "malformed request body"),
)


# aiohttp's C parser raises a bare BadHttpMessage whose message is llhttp's fixed reason, then
# the offending bytes: the code is picked from the reason's words (first match wins).
_PARSE_REASONS: tuple[tuple[str, str, str], ...] = (
    ("chunk", "bad_chunk", "malformed chunked body"),
    ("transfer-encoding", "bad_transfer_encoding", "unsupported or malformed Transfer-Encoding"),
    ("content-length", "bad_length", "malformed or conflicting Content-Length"),
    ("data after", "bad_length", "a request body needs a Content-Length or chunked encoding"),
    ("host", "missing_host", "an HTTP/1.1 request needs a Host header"),
    ("header", "bad_header", "malformed header"),
    ("method", "bad_request_line", "malformed request line"),
    ("version", "bad_request_line", "malformed request line"),
    ("url", "bad_request_line", "malformed request target"),
)


def describe_parse_error(exc: BaseException | None) -> tuple[str, str]:
    """(code, text) for a request aiohttp's parser refused; fixed texts, no request bytes."""
    for kind, code, text in _PARSE_ERRORS:
        if isinstance(exc, kind):
            return code, text
    if isinstance(exc, http_exceptions.HttpProcessingError):
        # only the reason before the first colon: what follows quotes the request's bytes
        reason = str(exc.message).strip().split(":", 1)[0].lower().replace("`", "")
        for word, code, text in _PARSE_REASONS:
            if word in reason:
                return code, text
    return "bad_request", "malformed HTTP request"
