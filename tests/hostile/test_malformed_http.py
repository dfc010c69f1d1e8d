"""Malformed HTTP, as only a raw socket sends it: every answer is a 400 JSON
{"error","code"} (never text/plain), and none of the offending bytes reach the log.

Each attack plants a secret (payload bytes, an inbox id, a header value, an
idempotency key, a recipient key) where aiohttp's parser chokes on it; the
suite's relay logs at DEBUG and is grepped for every secret when it stops.
"""

from __future__ import annotations

import pytest

from tests.hostile.harness import (
    SECRET_HEADER,
    SECRET_INBOX_ID,
    SECRET_KEY,
    SECRET_PAYLOAD,
    SECRET_RECIPIENT,
    Relay,
    request_answer,
)

pytestmark = pytest.mark.timeout(60)

P = SECRET_PAYLOAD
H = SECRET_HEADER.encode()
I = SECRET_INBOX_ID.encode()  # noqa: E741
K = SECRET_KEY.encode()
Q = f"/v1/queues/{SECRET_RECIPIENT}/messages".encode()
POST = b"POST " + Q + b" HTTP/1.1\r\nHost: x\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"
GET = b"GET / HTTP/1.1\r\nHost: x\r\n"

ATTACKS: dict[str, bytes] = {
    "bad chunk size": CHUNKED + b"zz" + P + b"\r\n" + P + b"\r\n0\r\n\r\n",
    "chunk size overflow": CHUNKED + b"fffffffffffffffffffff\r\n" + P + b"\r\n0\r\n\r\n",
    "chunk without CRLF": CHUNKED + b"5\r\n" + P + b"0\r\n\r\n",
    "bare LF in chunk": CHUNKED + b"5\n" + P[:5] + b"\n0\n\n",
    "control character in header value": POST
    + b"X-Inbox-ID: "
    + I
    + b"\x01\x7f"
    + H
    + b"\r\nContent-Length: 3\r\n\r\nabc",
    "control character in header name": GET + b"X-" + H + b"\x00: v\r\n\r\n",
    "NUL in request line": b"GET /v1/inbox/messages?x=" + I + b"\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    "malformed request line": b"\x16\x03\x01" + P + b" " + K + b"\r\n\r\n",
    "bad HTTP version": b"GET " + Q + b" HTTP/9." + P + b"\r\nHost: x\r\n\r\n",
    "bad method": b"G(T " + Q + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "oversized request line": b"GET /" + P * 600 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "oversized header": GET + b"Idempotency-Key: " + K * 500 + b"\r\n\r\n",
    "too many headers": GET + b"".join(b"X-%d: %b\r\n" % (i, H) for i in range(200)) + b"\r\n",
    "two content lengths": POST + b"Content-Length: 3\r\nContent-Length: 5\r\n\r\n" + P,
    "content length and chunked": POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\n" + P[:5] + b"\r\n0\r\n\r\n",
    "negative content length": POST + b"Content-Length: -5\r\n\r\n" + P,
    "bad transfer encoding": POST + b"Transfer-Encoding: " + H + b"\r\n\r\n" + P,
    "space before colon": GET + b"X-Inbox-ID : " + I + b"\r\n\r\n",
    "obsolete line folding": GET + b"X-A: a\r\n " + H + b"\r\n\r\n",
}


# the code for the attacks whose kind the answer should name
CODES = {
    "bad chunk size": "bad_chunk",
    "chunk size overflow": "bad_chunk",
    "control character in header value": "bad_header",
    "oversized header": "headers_too_large",
    "oversized request line": "headers_too_large",
    "two content lengths": "bad_length",
    "bad transfer encoding": "bad_transfer_encoding",
    "bad method": "bad_request_line",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_malformed_http_is_400_json(hostile_relay: Relay, name: str) -> None:
    answer = await request_answer(hostile_relay, ATTACKS[name])
    assert answer.status == 400, (name, answer)
    assert answer.headers["content-type"].startswith("application/json"), (name, answer)
    doc = answer.json()
    assert set(doc) == {"error", "code"}, doc
    print(f"HOSTILE malformed {name!r}: {doc['code']}")
    assert doc["code"] == CODES.get(name, doc["code"]), doc
    assert SECRET_PAYLOAD not in answer.body
    hostile_relay.assert_log_clean()


async def test_http10_post_without_length(hostile_relay: Relay) -> None:
    """HTTP/1.0 POST with a body but no Content-Length: read to close, or refused; never text/plain."""
    answer = await request_answer(hostile_relay, b"POST " + Q + b" HTTP/1.0\r\nHost: x\r\n\r\n" + P)
    print(f"HOSTILE http10-post-no-length: status={answer.status} body={answer.body[:80]!r}")
    assert answer.status == 400, answer
    assert answer.json()["code"] == "bad_length", answer
    assert answer.headers["content-type"].startswith("application/json"), answer
    hostile_relay.assert_log_clean()
