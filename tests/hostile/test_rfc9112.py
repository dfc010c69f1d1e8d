"""RFC 9112 rules on both paths: the fast path (the suite's relay; llhttp through httptools, anything
it does not serve handed to aiohttp) and aiohttp's protocol alone (RELAY_HTTP_FASTPATH=0) answer the
same, as JSON {"error","code"}, without echoing what the client sent, and without waiting for a
timeout.

Bounds: the head limit is aiohttp's 8190 bytes a line (the fast path serves heads of at
most that much in all); an HTTP/1.1 request needs Host; a bare LF is answered 400 at once;
HTTP/1.0 with Transfer-Encoding is answered 400 and the connection closed (section 6.1);
an Expect other than 100-continue is 417. Figures printed (HOSTILE ...): the time to answer.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.hostile.harness import (
    SECRET_HEADER,
    SECRET_PAYLOAD,
    SECRET_RECIPIENT,
    Answer,
    Relay,
    read_response,
    report,
    request_answer,
)

pytestmark = pytest.mark.timeout(60)

ENQUEUE = f"POST /v1/queues/{SECRET_RECIPIENT}/messages".encode()
BODY = SECRET_PAYLOAD


@pytest.fixture(params=["fast path", "aiohttp"])
def relay(request: pytest.FixtureRequest, hostile_relay: Relay) -> Relay:
    if request.param == "fast path":
        return hostile_relay
    return request.getfixturevalue("aiohttp_relay")  # type: ignore[no-any-return]


async def _answers(relay: Relay, data: bytes, timeout: float = 5.0) -> tuple[list[Answer], bool, float]:
    """Send `data` on one connection: every answer, whether the relay then closed it, and
    the seconds until the first answer."""
    reader, writer = await asyncio.open_connection(relay.host, relay.port)
    started = time.monotonic()
    first = 0.0
    answers: list[Answer] = []
    closed = False
    try:
        writer.write(data)
        await writer.drain()
        while True:
            try:
                answer = await asyncio.wait_for(read_response(reader), timeout)
            except TimeoutError:
                break
            if answer.status == 0:
                closed = True
                break
            first = first or time.monotonic() - started
            answers.append(answer)
    finally:
        writer.close()
    return answers, closed, first


def _refused_as_json(answer: Answer, status: int, code: str) -> None:
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json"), answer
    doc = answer.json()
    assert set(doc) == {"error", "code"}, doc
    assert doc["code"] == code, doc
    assert SECRET_HEADER.encode() not in answer.body
    assert SECRET_PAYLOAD not in answer.body


async def test_a_header_line_past_the_head_limit_is_400(relay: Relay) -> None:
    long_line = b"X-Long: " + SECRET_HEADER.encode() * 2400  # ~60 KB
    data = ENQUEUE + b" HTTP/1.1\r\nHost: x\r\n" + long_line + b"\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    answers, closed, seconds = await _answers(relay, data + BODY)
    report("60KB-header-line", status=answers[0].status if answers else 0, ms=round(seconds * 1000))
    _refused_as_json(answers[0], 400, "headers_too_large")
    assert closed
    assert len(answers) == 1
    # a head just under the limit in all is still an enqueue (the fast path serves it)
    filler = b"X-Filler: " + b"a" * 7900
    data = ENQUEUE + b" HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    assert (await request_answer(relay, data + BODY)).status == 201


async def test_http11_without_host_is_400(relay: Relay) -> None:
    data = ENQUEUE + b" HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
    answers, closed, _ = await _answers(relay, data)
    _refused_as_json(answers[0], 400, "missing_host")
    assert closed
    assert len(answers) == 1


async def test_a_complete_bare_lf_request_is_answered_at_once(relay: Relay) -> None:
    data = ENQUEUE + b" HTTP/1.1\nHost: x\nContent-Length: %d\n\n" % len(BODY) + BODY
    answers, _closed, seconds = await _answers(relay, data)
    report("bare-LF-request", status=answers[0].status if answers else 0, ms=round(seconds * 1000))
    assert answers, "no answer"
    assert answers[0].status == 400, answers
    assert answers[0].headers["content-type"].startswith("application/json")
    assert seconds < 1.0, f"answered after {seconds:.1f} s (the header timeout?)"


async def test_http10_with_transfer_encoding_is_400_and_closed(relay: Relay) -> None:
    """RFC 9112 section 6.1: two pipelined HTTP/1.0 + chunked + keep-alive enqueues: one 400,
    the connection closed, the second never served."""
    one = (
        ENQUEUE + b" HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)
    )
    answers, closed, _ = await _answers(relay, one + one)
    _refused_as_json(answers[0], 400, "bad_transfer_encoding")
    assert closed, answers
    assert len(answers) == 1, answers


async def test_an_unknown_expectation_is_417_json_without_echo(relay: Relay) -> None:
    data = (
        ENQUEUE + b" HTTP/1.1\r\nHost: x\r\nExpect: " + SECRET_HEADER.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
    )
    answers, closed, _ = await _answers(relay, data)
    _refused_as_json(answers[0], 417, "expectation_failed")
    assert closed
    assert len(answers) == 1
    # 100-continue is the one expectation served
    reader, writer = await asyncio.open_connection(relay.host, relay.port)
    try:
        writer.write(
            ENQUEUE
            + b" HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        writer.write(BODY)
        assert (await asyncio.wait_for(read_response(reader), 5)).status == 201
    finally:
        writer.close()
