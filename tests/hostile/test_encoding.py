"""Compressed request bodies: refused 415 `unsupported_encoding`, never inflated.

The bomb: 300 recipients x a 5 MiB payload of zeros, gzip'd to ~18 KB, used to grow
the relay by ~3 GB. Now it is refused before anything is decompressed: RSS stays
flat, and other clients' enqueues keep succeeding meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import time
import zlib

import pytest

from tests.hostile.harness import (
    SECRET_HEADER,
    SECRET_PAYLOAD,
    Relay,
    http,
    recipient,
    request_answer,
)

pytestmark = pytest.mark.timeout(120)


def _bomb() -> bytes:
    """A fan-out of 300 recipients x 5 MiB of zeros, as gzip (~18 KB on the wire)."""
    zeros = b"\0" * (5 << 20)
    recipients = ",".join(f'"{recipient(i)}"' for i in range(300))
    payload = base64.urlsafe_b64encode(zeros).rstrip(b"=")
    doc = b'{"recipients":[' + recipients.encode() + b'],"payload":"' + payload + b'"}'
    return gzip.compress(doc, 9)


ENCODED_BODIES = {
    "gzip": gzip.compress(SECRET_PAYLOAD * 64),
    "deflate": zlib.compress(SECRET_PAYLOAD * 64),
    "br": b"\x8b\x03\x80" + SECRET_PAYLOAD,  # not valid brotli either: must not matter
    "x-unknown": SECRET_PAYLOAD,
    "gzip, identity": gzip.compress(SECRET_PAYLOAD),
}


@pytest.mark.parametrize("encoding", sorted(ENCODED_BODIES))
@pytest.mark.parametrize("path", ["/v1/queues/{r}/messages", "/v1/messages", "/v1/inbox/append"])
async def test_compressed_bodies_are_refused_415(hostile_relay: Relay, encoding: str, path: str) -> None:
    body = ENCODED_BODIES[encoding]
    answer = await request_answer(
        hostile_relay,
        http(
            "POST",
            path.format(r=recipient(7)),
            body,
            {"Content-Encoding": encoding, "X-Inbox-ID": "inbox-enc", "X-Planted": SECRET_HEADER},
        ),
    )
    assert answer.status == 415, answer
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json()["code"] == "unsupported_encoding"


async def test_mismatched_encoding_plain_body_deflate_header(hostile_relay: Relay) -> None:
    """`deflate` announced, plain bytes sent: used to reset the connection."""
    answer = await request_answer(
        hostile_relay,
        http("POST", f"/v1/queues/{recipient(8)}/messages", SECRET_PAYLOAD, {"Content-Encoding": "deflate"}),
    )
    assert answer.status == 415
    assert answer.json()["code"] == "unsupported_encoding"


async def test_identity_encoding_is_accepted(hostile_relay: Relay) -> None:
    answer = await request_answer(
        hostile_relay,
        http("POST", f"/v1/queues/{recipient(9)}/messages", b"plain", {"Content-Encoding": "identity"}),
    )
    assert answer.status == 201, answer


async def _victim(relay: Relay, stop: asyncio.Event, statuses: list[int], latencies: list[float]) -> None:
    n = 0
    while not stop.is_set():
        t0 = time.monotonic()
        answer = await request_answer(
            relay, http("POST", f"/v1/queues/{recipient(10_000 + n % 50)}/messages", b"victim-message")
        )
        latencies.append(time.monotonic() - t0)
        statuses.append(answer.status)
        n += 1
        await asyncio.sleep(0.01)


async def test_gzip_bomb_does_not_grow_the_relay(hostile_relay: Relay) -> None:
    bomb = _bomb()
    assert len(bomb) < 64 << 10
    before = hostile_relay.rss_bytes()
    stop = asyncio.Event()
    statuses: list[int] = []
    latencies: list[float] = []
    victim = asyncio.create_task(_victim(hostile_relay, stop, statuses, latencies))
    peak = before
    answers = []
    for _ in range(5):  # five bombs, each on its own connection, while the victim enqueues
        answers.append(
            await request_answer(
                hostile_relay,
                http(
                    "POST",
                    "/v1/messages",
                    bomb,
                    {"Content-Encoding": "gzip", "Content-Type": "application/json"},
                ),
            )
        )
        peak = max(peak, hostile_relay.rss_bytes())
    await asyncio.sleep(0.3)
    stop.set()
    await victim
    peak = max(peak, hostile_relay.rss_bytes())
    growth = peak - before
    print(f"HOSTILE gzip-bomb: rss_before={before >> 20}MiB growth={growth >> 10}KiB "
          f"victim_enqueues={len(statuses)} victim_max_ms={max(latencies) * 1000:.1f}")  # fmt: skip
    assert all(a.status == 415 and a.json()["code"] == "unsupported_encoding" for a in answers)
    assert growth < 16 << 20, f"RSS grew {growth >> 20} MiB"
    assert statuses, "the victim sent nothing"
    assert set(statuses) == {201}, statuses
