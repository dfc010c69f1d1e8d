"""Parsing and validating what clients send: identifiers, query parameters, bodies."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from typing import Any

from aiohttp import hdrs, web

from relay import boundedjson
from relay.api.context import CTX
from relay.api.errors import ApiError, bad_request, overloaded
from relay.http.memguard import CLAIM, CLAIM_FROM
from relay.protocol import b64decode as b64decode  # the API's base64url, re-exported
from relay.protocol import b64decode_alphabet
from relay.protocol import b64encode as b64encode
from relay.settings import Settings

_PRINTABLE = re.compile(r"^[\x20-\x7e]{1,128}$")
RECIPIENT_BYTES = 32
MAX_CHANNEL_BYTES = 64


def recipient_key(text: str) -> bytes:
    try:
        raw = b64decode(text)
    except ValueError:
        raise _bad_recipient() from None
    return _recipient_of(raw)


def recipient_key_matched(segment: bytes) -> bytes:
    """recipient_key for a path segment a parser already matched as base64url characters
    (the enqueue fast path's request line): same key, same refusal."""
    try:
        raw = b64decode_alphabet(segment)
    except ValueError:
        raise _bad_recipient() from None
    return _recipient_of(raw)


def _bad_recipient() -> ApiError:
    return bad_request("recipientKey must be base64url (no padding) of exactly 32 bytes", "bad_recipient")


def _recipient_of(raw: bytes) -> bytes:
    if len(raw) != RECIPIENT_BYTES:
        raise bad_request(f"recipientKey must be exactly 32 bytes, got {len(raw)}", "bad_recipient")
    return raw


def channel_of(request: web.Request) -> bytes:
    if not request.query_string:  # no query to parse: the default channel
        return b""
    return channel_value(request.query.get("channel", ""))


def channel_value(text: str) -> bytes:
    if not text:  # the default channel, on nearly every request
        return b""
    try:
        raw = b64decode(text)
    except ValueError:
        raise bad_request(
            "channel must be base64url (no padding) of at most 64 bytes", "bad_channel"
        ) from None
    if len(raw) > MAX_CHANNEL_BYTES:
        raise bad_request(f"channel must be at most 64 bytes, got {len(raw)}", "bad_channel")
    return raw


_DIGITS = re.compile(r"^[0-9]+$")
_SECONDS_TEXT = re.compile(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$")
MAX_SEQ = 2**63 - 1  # a stream id's first part: no seq is ever above it


def int_value(raw: str | None, name: str, minimum: int, maximum: int) -> int | None:
    """A query integer: `[0-9]+` only (no sign, space or underscore), clamped to `maximum`.

    Digits past 19 are clamped without int(), which refuses over 4300 digits (a 500)."""
    if raw is None or raw == "":
        return None
    if not _DIGITS.match(raw):
        raise bad_request(f"{name} must be an integer >= {minimum} (digits only)")
    digits = raw.lstrip("0") or "0"
    value = maximum if len(digits) > 19 else min(int(digits), maximum)
    if value < minimum:
        raise bad_request(f"{name} must be an integer >= {minimum} (digits only)")
    return value


def from_seq(request: web.Request) -> int | None:
    return from_seq_value(request.query.get("fromSeq"))


def from_seq_value(raw: str | None) -> int | None:
    return int_value(raw, "fromSeq", 0, MAX_SEQ)


def limit(request: web.Request, settings: Settings) -> int:
    return limit_value(request.query.get("limit"), settings)


def limit_value(raw: str | None, settings: Settings) -> int:
    value = int_value(raw, "limit", 1, settings.max_limit)
    return settings.default_limit if value is None else value


def wait(request: web.Request, settings: Settings) -> float:
    return wait_value(request.query.get("wait"), settings)


def wait_value(raw: str | None, settings: Settings) -> float:
    """Seconds, fractions allowed (`[0-9]+(.[0-9]*)?`), clamped to the maximum wait."""
    if raw is None or raw == "":
        return 0.0
    if not _SECONDS_TEXT.match(raw):
        raise bad_request("wait must be a number of seconds >= 0 (digits and a decimal point only)")
    return min(float(raw), settings.max_wait_s)  # a huge value is inf, clamped like any other


def idempotency_key(request: web.Request) -> str:
    return idempotency_value(request.headers.get("Idempotency-Key"))


def idempotency_value(raw: str | None) -> str:
    """The Idempotency-Key header's value checked (absent: ""), whatever the transport."""
    if raw is None:
        return ""
    if not _PRINTABLE.match(raw):
        raise bad_request("Idempotency-Key must be 1-128 printable ASCII characters", "bad_idempotency_key")
    return raw


async def payload(request: web.Request, cap: int) -> bytes:
    """The raw message body, refused with 413 before it is read past `cap`."""
    try:
        body = await raw_body(request, cap)
    except ApiError as exc:
        if exc.status != 413:
            raise
        raise ApiError(413, "payload_too_large", f"payload exceeds max size ({cap} bytes)") from exc
    return non_empty(body)


def non_empty(body: bytes) -> bytes:
    """A message body as the contract wants it: 400 empty_payload when empty."""
    if not body:
        raise bad_request("payload must not be empty", "empty_payload")
    return body


async def raw_body(request: web.Request, cap: int) -> bytes:
    """The whole body, refused with 413 once it is known to exceed `cap`."""
    if hdrs.CONTENT_ENCODING in request.headers:
        unsupported_encoding(request)
    declared = request.content_length
    if declared is not None and declared > cap:
        raise _too_large(cap)
    if declared is None or declared >= CLAIM_FROM:
        _claim_memory(request, cap if declared is None else declared)
    if request.content.is_eof():  # the whole body is already buffered: take it, no await
        body = request.content.read_nowait()
        if len(body) > cap:
            raise _too_large(cap)
        return body
    timeout_s = request.app[CTX].settings.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_capped(request, cap)
    except TimeoutError:
        raise ApiError(
            408,
            "body_timeout",
            f"request body not received within {timeout_s:g} s",
            {"Connection": "close"},
        ) from None


async def _read_capped(request: web.Request, cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > cap:
            raise _too_large(cap)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _claim_memory(request: web.Request, size: int) -> None:
    """A big (or unknown-length) body claims its bytes from the memory guard first."""
    guard = request.app[CTX].memory
    if guard.ceiling is None or CLAIM in request:
        return
    if not guard.claim(size):
        raise overloaded()
    request[CLAIM] = size  # released by the request wrapper once answered


def unsupported_encoding(request: web.Request) -> None:
    """415 for a body with any Content-Encoding but identity: ciphertext does not
    compress, and a compressed body is an amplification vector. aiohttp's parser runs
    with auto_decompress off (relay.http.serving), so nothing was ever inflated."""
    if request.headers.getall(hdrs.CONTENT_ENCODING) == ["identity"]:
        return
    raise ApiError(
        415,
        "unsupported_encoding",
        "request bodies must not be compressed (Content-Encoding other than identity)",
        {"Connection": "close"},
    )


def _too_large(cap: int) -> ApiError:
    # built only when refusing: building it on every request showed in profiles
    return ApiError(413, "payload_too_large", f"request body exceeds max size ({cap} bytes)")


async def json_body(request: web.Request, cap: int) -> tuple[Any, bytes]:
    """Decoded JSON body and its raw bytes (the signature covers the raw bytes)."""
    raw = await raw_body(request, cap)
    try:
        return boundedjson.loads(raw, cap, "the request body"), raw
    except boundedjson.JsonLimitError as exc:
        text = "request body must be valid JSON" if exc.code == "bad_json" else exc.text
        raise ApiError(exc.status, exc.code, text) from None


_SECONDS: dict[int, str] = {}  # formatted "YYYY-MM-DDTHH:MM:SS." per second; bounded


def rfc3339_ms(ms: int) -> str:
    second, milli = divmod(ms, 1000)
    head = _SECONDS.get(second)
    if head is None:
        if len(_SECONDS) >= 4096:
            _SECONDS.clear()
        head = _SECONDS[second] = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
    return f"{head}{milli:03d}Z"
