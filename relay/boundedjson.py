"""JSON from untrusted bytes, bounded before any parser sees it (docs/api.md, "Input limits").

Three bounds, each checked with C-speed passes over the bytes (replace, translate, one regex)
and a loop over at most `max_tokens` brackets: the size; the structural characters left once
escapes are cut out (`"` `,` `[` `]` `{` `}`: an upper bound on values and keys); and the
nesting depth, counted over the brackets outside strings. A nesting bomb is refused in
microseconds and never reaches a recursive parser (json's raised RecursionError, a 500);
what passes is parsed by orjson. Numbers as orjson reads them, which RFC 8259 (section 6)
allows: integers in [-2**63, 2**64 - 1] exactly, beyond that range the nearest float
(docs/api.md, "Input limits").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["MAX_DEPTH", "MAX_TOKENS", "JsonLimitError", "loads", "member_as_sent"]

MAX_DEPTH = 32  # DIDComm messages, DID documents and API bodies nest less than 10 deep
MAX_TOKENS = 100_000  # a 1,000-key keylist update or a 10,000-id ack list is ~40,000

_NOT_STRUCTURAL = bytes(sorted(set(range(256)) - set(b'",[]{}')))
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STRING = re.compile(rb'"[^"]*"')  # in the skeleton a string holds only structural characters
_OPEN = frozenset(b"[{")
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class JsonLimitError(ValueError):
    """JSON refused before or while parsing; `text` names the bound, never the input."""

    def __init__(self, text: str, code: str, status: int = 400) -> None:
        super().__init__(text)
        self.text = text
        self.code = code
        self.status = status


def loads(
    raw: bytes | str,
    max_bytes: int | None,
    what: str = "the JSON",
    max_depth: int = MAX_DEPTH,
    max_tokens: int = MAX_TOKENS,
) -> Any:
    """The parsed value of `raw`, or JsonLimitError: `json_too_large` (413), `json_too_complex`,
    `json_too_deep` or `bad_json` (400). `max_bytes` None: the caller capped the size."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if max_bytes is not None and len(data) > max_bytes:
        raise JsonLimitError(f"{what} exceeds {max_bytes} bytes", "json_too_large", 413)
    # escaped backslashes first, so the quote of a '\\"' pair stays a quote
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in data else data
    skeleton = unescaped.translate(None, _NOT_STRUCTURAL)
    if len(skeleton) > max_tokens:
        if _deeper_than(skeleton[:max_tokens], max_depth):  # a bomb is named as one
            raise JsonLimitError(f"{what} nests deeper than {max_depth} levels", "json_too_deep")
        raise JsonLimitError(f"{what} has more than {max_tokens} values", "json_too_complex")
    if _deeper_than(skeleton, max_depth):
        raise JsonLimitError(f"{what} nests deeper than {max_depth} levels", "json_too_deep")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise JsonLimitError(f"{what} is not valid JSON", "bad_json") from None


def loads_as(
    raw: bytes | str,
    max_bytes: int | None,
    what: str,
    error: Callable[[str, str, int], Exception],
    bad_json: str,
) -> Any:
    """`loads`, a refusal raised as `error(text, code, status)`, with the caller's own code
    `bad_json` for unparseable JSON (a DIDComm envelope's: "bad_envelope")."""
    try:
        return loads(raw, max_bytes, what)
    except JsonLimitError as exc:
        raise error(exc.text, bad_json if exc.code == "bad_json" else exc.code, exc.status) from None


def _deeper_than(skeleton: bytes, limit: int) -> bool:
    if skeleton.count(b"[") + skeleton.count(b"{") <= limit:  # the usual case: few containers
        return False
    brackets = _STRING.sub(b"", skeleton).translate(None, _NOT_BRACKET)
    depth = 0
    for byte in brackets:
        if byte in _OPEN:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def member_as_sent(data: bytes, name: str) -> bytes | None:
    """The bytes of the top-level object member `name`'s value exactly as they arrived (the
    last such member, as parsing keeps), for an object `loads` accepted: its depth is bounded,
    so json's recursive scanner is safe here; it only finds where each value ends."""
    text = data.decode("utf-8")
    pos = _skip(text, 0) + 1  # past "{"
    found = None
    while True:
        pos = _skip(text, pos)
        if text[pos] == "}":
            return found
        key, pos = _DECODER.raw_decode(text, pos)
        start = _skip(text, _skip(text, pos) + 1)  # past ":"
        _, end = _DECODER.raw_decode(text, start)
        if key == name:
            found = text[start:end].encode("utf-8")
        pos = _skip(text, end)
        if text[pos] == ",":
            pos += 1


def _skip(text: str, pos: int) -> int:
    """Past the JSON whitespace at `pos`."""
    space = _SPACE.match(text, pos)
    return space.end() if space else pos
