"""Parsing and validating what clients send: identifiers, query parameters, bodies."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import hdrs, web

from relay import boundedjson
from relay.api import quota
from relay.api.context import CTX
from relay.api.errors import ApiError, bad_request, overloaded
from relay.http.memguard import CLAIM, CLAIM_FROM
from relay.protocol import b64decode as b64decode  # the API's base64url, re-exported
from relay.protocol import b64decode_alphabet
from relay.protocol import b64encode as b64encode
from relay.settings import Settings

RECIPIENT_BYTES = 32
MAX_CHANNEL_BYTES = 64
MAX_SEQ = 2**63 - 1  # a stream id's first part: no seq is ever above it
B64 = "[A-Za-z0-9_-]"  # one base64url character


def b64url_pattern(min_bytes: int, max_bytes: int) -> str:
    """The texts b64decode turns into min_bytes..max_bytes bytes (both equal, or 0..max): 4
    characters per 3 bytes, the last group 2 or 3 characters (never 1)."""
    if min_bytes == max_bytes:
        return f"^{B64}{{{-(-4 * max_bytes // 3)}}}$"
    if min_bytes != 0:
        raise ValueError("a byte range starts at 0 or is one length")
    groups, rest = divmod(max_bytes, 3)
    last = {0: "", 1: f"(?:{B64}{{2}})?", 2: f"(?:{B64}{{2,3}})?"}[rest]
    return f"^(?:(?:{B64}{{4}}){{0,{groups - 1}}}(?:{B64}{{2,3}})?|(?:{B64}{{4}}){{{groups}}}{last})$"


@dataclass(frozen=True, slots=True)
class Param:
    """One request parameter, declared once. `pattern` is the value's whole grammar as sent (in
    the regex syntax Python and JSON Schema share); its parser below accepts exactly what it
    matches (with the regex, or on the hot path a cheaper test tests/relay/api/test_params.py
    proves equal) and refuses the rest with 400 `code` and `error`. relay/api/openapi.py
    describes the parameter from these same fields, so the two cannot disagree."""

    name: str
    where: str  # "path", "query" or "header"
    pattern: str
    error: str
    code: str = "bad_request"
    description: str = ""
    required: bool = False
    minimum: int = 0  # an integer's least value (its pattern says the same)
    # matched with fullmatch: Python's `$` also matches before a final newline, JSON Schema's does not
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(self.pattern))

    def openapi(self) -> dict[str, Any]:
        refused = f"; otherwise 400 {self.code}: {self.error}"
        return {
            "name": self.name,
            "in": self.where,
            "required": self.required,
            "description": self.description + refused,
            "schema": {"type": "string", "pattern": self.pattern},
        }


def _integer(name: str, minimum: int, description: str) -> Param:
    """A query integer: `[0-9]+` of a value >= minimum (0 or 1), or empty (the default)."""
    pattern = {0: "^[0-9]*$", 1: "^(?:0*[1-9][0-9]*)?$"}[minimum]
    error = f"{name} must be an integer >= {minimum} (digits only)"
    return Param(name, "query", pattern, error, description=description, minimum=minimum)


def printable(least: int, most: int, first: int = 0x20) -> str:
    """least..most ASCII characters from `first` (space: printable; 0x21: visible) to `~`."""
    return f"^[\\x{first:02x}-\\x7e]{{{least},{most}}}$"


PRINTABLE_128 = printable(1, 128)  # Idempotency-Key; a fan-out's or inbox append's messageId
B64URL = f"^(?:{B64}{{4}})*(?:{B64}{{2,3}})?$"  # what b64decode takes, of any length
RECIPIENT = Param(
    "recipient",
    "path",
    b64url_pattern(RECIPIENT_BYTES, RECIPIENT_BYTES),
    "recipientKey must be base64url (no padding) of exactly 32 bytes",
    "bad_recipient",
    "the queue owner's Ed25519 public key, base64url without padding (32 bytes)",
    required=True,
)
CHANNEL = Param(
    "channel",
    "query",
    b64url_pattern(0, MAX_CHANNEL_BYTES),
    "channel must be base64url (no padding) of at most 64 bytes",
    "bad_channel",
    "base64url of 0-64 bytes; absent or empty is the default channel",
)
FROM_SEQ = _integer(
    "fromSeq",
    0,
    f"first seq wanted, an integer (absent or empty: the oldest held); above {MAX_SEQ} is clamped",
)
LIMIT = _integer(
    "limit",
    1,
    f"at most this many messages, an integer (absent or empty: {Settings.default_limit});"
    f" above {Settings.max_limit} is clamped to {Settings.max_limit}",
)
WAIT = Param(
    "wait",
    "query",
    r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)?$",
    "wait must be a number of seconds >= 0 (digits and a decimal point only)",
    description="long-poll seconds when nothing is there (fractions allowed; absent or empty: 0);"
    f" above {Settings.max_wait_s:g} is clamped to {Settings.max_wait_s:g}",
)
IDEMPOTENCY_KEY = Param(
    "Idempotency-Key",
    "header",
    PRINTABLE_128,
    "Idempotency-Key must be 1-128 printable ASCII characters",
    "bad_idempotency_key",
    "the same key with the same payload again answers the first seq (200, duplicate)",
)
INBOX_ID = Param(
    "X-Inbox-ID",
    "header",
    printable(1, 512, 0x21),
    "X-Inbox-ID must be 1-512 visible ASCII characters",
    "bad_inbox_id",
    "opaque inbox capability (never logged; hashed before use)",
    required=True,
)
# the parsers below run on the hot path: the bound methods, looked up once
PARAMS = (RECIPIENT, CHANNEL, FROM_SEQ, LIMIT, WAIT, IDEMPOTENCY_KEY, INBOX_ID)  # every one declared
_IDEMPOTENCY_KEY = IDEMPOTENCY_KEY.regex.fullmatch


def recipient_key(text: str) -> bytes:
    try:
        raw = b64decode(text)
    except ValueError:
        raise _bad_recipient() from None
    return _recipient_of(raw)


def recipient_key_matched(segment: bytes) -> bytes:
    """recipient_key for a path segment a parser already matched as base64url characters
    (the fast path's request line): same key, same refusal."""
    try:
        raw = b64decode_alphabet(segment)
    except ValueError:
        raise _bad_recipient() from None
    return _recipient_of(raw)


def _bad_recipient() -> ApiError:
    return bad_request(RECIPIENT.error, RECIPIENT.code)


def _recipient_of(raw: bytes) -> bytes:
    if len(raw) != RECIPIENT_BYTES:
        raise bad_request(f"recipientKey must be exactly 32 bytes, got {len(raw)}", RECIPIENT.code)
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
        raise bad_request(CHANNEL.error, CHANNEL.code) from None
    if len(raw) > MAX_CHANNEL_BYTES:
        raise bad_request(f"channel must be at most 64 bytes, got {len(raw)}", CHANNEL.code)
    return raw


def _int_value(raw: str, param: Param, maximum: int) -> int:
    """A query integer (its pattern: digits only, no sign, space or underscore, at least
    param.minimum), clamped to `maximum`. Checked with isascii() and isdigit(), which is what
    the pattern says (test_params.py) at a third of a regex's cost on the hot path. Digits
    past 19 are clamped without int(), which refuses over 4300 digits (a 500)."""
    if not (raw.isascii() and raw.isdigit()):
        raise bad_request(param.error, param.code)
    digits = raw.lstrip("0") or "0"
    value = maximum if len(digits) > 19 else min(int(digits), maximum)
    if value < param.minimum:
        raise bad_request(param.error, param.code)
    return value


def from_seq(request: web.Request) -> int | None:
    return from_seq_value(request.query.get("fromSeq"))


def from_seq_value(raw: str | None) -> int | None:
    return _int_value(raw, FROM_SEQ, MAX_SEQ) if raw else None


def limit(request: web.Request, settings: Settings) -> int:
    return limit_value(request.query.get("limit"), settings)


def limit_value(raw: str | None, settings: Settings) -> int:
    return _int_value(raw, LIMIT, settings.max_limit) if raw else settings.default_limit


def wait(request: web.Request, settings: Settings) -> float:
    return wait_value(request.query.get("wait"), settings)


def wait_value(raw: str | None, settings: Settings) -> float:
    """Seconds, fractions allowed, clamped to the maximum wait (docs/api.md: 60 s)."""
    if not raw:
        return 0.0
    digits = raw.replace(".", "", 1)  # WAIT's pattern, without a regex (test_params.py)
    if not (digits.isascii() and digits.isdigit()):
        raise bad_request(WAIT.error, WAIT.code)
    return min(float(raw), settings.max_wait_s)  # a huge value is inf, clamped like any other


def idempotency_key(request: web.Request) -> str:
    return idempotency_value(request.headers.get("Idempotency-Key"))


def idempotency_value(raw: str | None) -> str:
    """The Idempotency-Key header's value checked (absent: ""), whatever the transport."""
    if raw is None:
        return ""
    if not _IDEMPOTENCY_KEY(raw):
        raise bad_request(IDEMPOTENCY_KEY.error, IDEMPOTENCY_KEY.code)
    return raw


def json_int(value: Any) -> int | None:
    """A JSON body's integer, or None: 5 and 5.0 are the same JSON number (and both integers to
    JSON Schema, so to the OpenAPI document); true and 5.5 are not integers."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


async def payload(request: web.Request, cap: int) -> bytes:
    """The raw message body, refused with 413 before it is read past `cap`."""
    try:
        body = await raw_body(request, cap)
    except ApiError as exc:
        if exc.status != 413:
            raise
        raise _payload_too_large(cap) from exc
    return non_empty(body)


def non_empty(body: bytes) -> bytes:
    """A message body as the contract wants it: 400 empty_payload when empty."""
    if not body:
        raise bad_request("payload must not be empty", "empty_payload")
    return body


def payload_within(data: bytes, cap: int) -> bytes:
    """A payload decoded from a JSON body (fan-out, inbox append) as the contract wants it:
    400 empty_payload when empty, 413 past `cap` bytes."""
    if len(data) > cap:
        raise _payload_too_large(cap)
    return non_empty(data)


def _payload_too_large(cap: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"payload exceeds max size ({cap} bytes)")


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


async def storing_json_body(request: web.Request, route: str, cap: int) -> Any:
    """A storing route's decoded JSON body (fan-out, inbox append): the enqueue token checked
    when those are on, a client whose quota is spent refused before the body is read (nothing
    charged: its cost is known once parsed), then the body read within `cap` bytes."""
    c = request.app[CTX]
    c.auth.verify_enqueue(request, route)
    if c.quota is not None:
        quota.admit_ready(c.quota, request, route)
    doc, _ = await json_body(request, cap)
    return doc


_SECONDS: dict[int, str] = {}  # formatted "YYYY-MM-DDTHH:MM:SS." per second; bounded


def rfc3339_ms(ms: int) -> str:
    second, milli = divmod(ms, 1000)
    head = _SECONDS.get(second)
    if head is None:
        if len(_SECONDS) >= 4096:
            _SECONDS.clear()
        head = _SECONDS[second] = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
    return f"{head}{milli:03d}Z"
