"""Byte budgets an anonymous client cannot exceed: the fan-out budget and the memory guard.

- Fan-out: recipients x payload size above RELAY_MAX_FANOUT_BYTES (32 MiB) is 413
  `fanout_too_large` and nothing is stored (Redis holds no new key).
- Memory guard: with RELAY_MAX_RSS_MB set, the relay answers 503 `overloaded` with
  Retry-After before its RSS passes the ceiling; /healthz, /readyz and /metrics still
  answer, and the rejections are counted.
"""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import pytest
import redis

from tests.hostile.harness import SECRET_PAYLOAD, Relay, RelayWith, http, recipient, request_answer
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(180)


def _fanout_body(recipients: int, size: int) -> bytes:
    payload = base64.urlsafe_b64encode(SECRET_PAYLOAD * (size // len(SECRET_PAYLOAD))).rstrip(b"=")
    keys = ",".join(f'"{recipient(5000 + i)}"' for i in range(recipients))
    return b'{"recipients":[' + keys.encode() + b'],"payload":"' + payload + b'"}'


async def test_fanout_over_budget_is_413_and_stores_nothing(hostile_relay: Relay) -> None:
    db = redis.Redis.from_url(hostile_relay.redis.url)
    keys_before = db.dbsize()
    # 10 recipients x 4 MiB = 40 MiB > 32 MiB
    answer = await request_answer(
        hostile_relay, http("POST", "/v1/messages", _fanout_body(10, 4 << 20)), timeout=30
    )
    assert answer.status == 413, answer
    assert answer.json()["code"] == "fanout_too_large"
    # 1000 recipients x 40 KiB = 40 MiB: also refused, before any recipient is parsed
    answer = await request_answer(
        hostile_relay, http("POST", "/v1/messages", _fanout_body(1000, 40 << 10)), timeout=30
    )
    assert answer.status == 413, answer
    assert db.dbsize() == keys_before
    # within the budget: 7 x 4 MiB = 28 MiB is queued for every recipient
    answer = await request_answer(
        hostile_relay, http("POST", "/v1/messages", _fanout_body(7, 4 << 20)), timeout=60
    )
    assert answer.status == 200, answer
    assert [r["status"] for r in answer.json()["results"]] == [201] * 7
    db.close()
    hostile_relay.assert_log_clean()


async def _metric(session: aiohttp.ClientSession, relay: Relay, line_start: str) -> float:
    async with session.get(f"{relay.url}/metrics") as resp:
        assert resp.status == 200
        for line in (await resp.text()).splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_memory_guard_refuses_work_when_over_the_ceiling(relay_with: RelayWith) -> None:
    relay = relay_with({"RELAY_MAX_RSS_MB": "30"})  # below a relay's ~50 MiB at rest: over at once
    await asyncio.sleep(0.5)
    answer = await request_answer(relay, http("POST", f"/v1/queues/{recipient(41)}/messages", b"x"))
    assert answer.status == 503, answer
    assert answer.json()["code"] == "overloaded"
    assert answer.headers["retry-after"] == "1"
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await request_answer(relay, http("GET", path))).status == 200, path
    async with aiohttp.ClientSession() as session:
        assert await _metric(session, relay, 'relayfleet_rejected_total{code="overloaded"}') >= 1
        assert await _metric(session, relay, "relayfleet_overloaded ") == 1


async def test_memory_guard_holds_the_ceiling_under_big_bodies(relay_with: RelayWith) -> None:
    """60 clients sending 4 MiB bodies at once, repeatedly: RSS stays under the ceiling;
    what is refused is refused 503 overloaded; small enqueues work again afterwards."""
    ceiling_mb = 160
    # one client sends 720 MiB here: the per-client quota (tests/hostile/test_client_quota_flood.py)
    # is off, so what is measured is the memory guard's answer alone
    relay = relay_with(
        {"RELAY_MAX_RSS_MB": str(ceiling_mb), "RELAY_RATE_LIMIT": "100000", "RELAY_CLIENT_RATE_BYTES": "0"}
    )
    body = SECRET_PAYLOAD * ((4 << 20) // len(SECRET_PAYLOAD))
    peak = relay.rss_bytes()
    statuses: list[int] = []
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, relay.rss_bytes())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(i: int) -> None:
            url = f"{relay.url}/v1/queues/{recipient(6000 + i)}/messages"
            for _ in range(3):
                try:
                    async with session.post(url, data=io.BytesIO(body)) as resp:
                        statuses.append(resp.status)
                        if resp.status == 503:
                            assert (await resp.json())["code"] == "overloaded"
                except aiohttp.ClientError:
                    statuses.append(0)

        await asyncio.gather(*(send(i) for i in range(60)))
    stop.set()
    await sampler

    async def served() -> bool:  # the storm over, its claims end with it
        answer = await request_answer(relay, http("POST", f"/v1/queues/{recipient(42)}/messages", b"small"))
        return answer.status == 201

    await until("a small enqueue stored again after the storm", served)
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(f"HOSTILE memory-guard: ceiling={ceiling_mb}MiB peak_rss={peak >> 20}MiB statuses={counts}")
    assert peak < ceiling_mb << 20, f"RSS peaked at {peak >> 20} MiB"
    assert set(statuses) <= {201, 503}, counts
    assert counts.get(503, 0) > 0, counts
    relay.assert_log_clean()


async def test_memory_claims_of_abandoned_bodies_are_released(relay_with: RelayWith) -> None:
    """Clients that send half of a 4 MiB body and hang up: their claims end with them,
    so the guard does not slowly close itself to honest big bodies."""
    relay = relay_with({"RELAY_MAX_RSS_MB": "400", "RELAY_RATE_LIMIT": "100000"})
    half = SECRET_PAYLOAD * ((2 << 20) // len(SECRET_PAYLOAD))
    for i in range(60):  # 60 x 4 MiB x 5 would be claimed forever if a claim leaked
        _, writer = await asyncio.open_connection(relay.host, relay.port)
        path = f"/v1/queues/{recipient(7000 + i)}/messages"
        writer.write(http("POST", path, headers={"Content-Length": str(4 << 20)}) + half)
        await writer.drain()
        writer.close()
    body = b"y" * (4 << 20)

    async def honest_big_body_stored() -> bool:  # once the hung-up clients' claims have ended
        path = f"/v1/queues/{recipient(7999)}/messages"
        return (await request_answer(relay, http("POST", path, body), timeout=30)).status == 201

    await until("a 4 MiB body stored once the abandoned claims ended", honest_big_body_stored, timeout=30)
    relay.assert_log_clean()
