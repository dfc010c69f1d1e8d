"""One anonymous client floods the store (issue 36, A3), driven as an outsider would: raw
aiohttp client requests, 1 MiB messages to ever new recipients from 127.0.0.1 over 8
connections, against `relayfleet relay` on a real redis-server. Meanwhile a second tenant
(its socket bound to 127.0.0.2: another source address, another client) enqueues 1 KiB
messages every 20 ms and must get only 201s, with a bounded latency.

Measured and printed (`HOSTILE client_quota_flood: ...`): Redis used_memory growth per second
over the flood, the attacker's answers, and the tenant's answers and latency. Run as a script
(`python tests/hostile/test_client_quota_flood.py`) it prints the same figures for whatever
relay the environment's PYTHONPATH holds (the BEFORE figures of the report: main before the
quota, in a worktree of its own).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import redis

from relay.protocol import b64encode
from tests.hostile.harness import Relay, RelayWith, report, start_redis, start_relay

MIB = 1 << 20
FLOOD_S = 4.0
ATTACK_CONNECTIONS = 8


async def _attacker(url: str, stop_at: float, answers: Counter[str], first: int) -> None:
    body = os.urandom(MIB)
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.1", 0), limit=ATTACK_CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one_connection(worker: int) -> None:
            n = first + worker * 1_000_000
            while time.monotonic() < stop_at:
                n += 1
                recipient = n.to_bytes(8, "big").hex() * 4  # 32 bytes: a new queue each time
                path = f"{url}/v1/queues/{b64encode(bytes.fromhex(recipient))}/messages"
                try:
                    async with http.post(path, data=body) as resp:
                        await resp.read()
                        answers[str(resp.status)] += 1
                        if resp.status == 429:  # an outsider does not wait: it sends again at once
                            continue
                except aiohttp.ClientError as exc:
                    answers[type(exc).__name__] += 1

        await asyncio.gather(*(one_connection(w) for w in range(ATTACK_CONNECTIONS)))


async def _tenant(url: str, stop_at: float, answers: Counter[int], latencies: list[float]) -> None:
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=1)
    path = f"{url}/v1/queues/{b64encode(b'tenant-queue-of-a-good-client-01')}/messages"
    async with aiohttp.ClientSession(connector=connector) as http:
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            async with http.post(path, data=os.urandom(1024)) as resp:
                await resp.read()
            latencies.append(time.perf_counter() - start)
            answers[resp.status] += 1
            await asyncio.sleep(0.02)


async def flood(relay_url: str, redis_url: str, seconds: float = FLOOD_S) -> dict[str, Any]:
    """The attack and the tenant, together for `seconds`; the figures."""
    direct = redis.Redis.from_url(redis_url)
    used_before = int(direct.info("memory")["used_memory"])
    attack: Counter[str] = Counter()
    tenant: Counter[int] = Counter()
    latencies: list[float] = []
    started = time.monotonic()
    stop_at = started + seconds
    samples: list[tuple[float, int]] = []

    async def sample() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(0.5)
            used = await asyncio.to_thread(lambda: int(direct.info("memory")["used_memory"]))
            samples.append((time.monotonic() - started, used))

    await asyncio.gather(
        _attacker(relay_url, stop_at, attack, int(time.time())),
        _tenant(relay_url, stop_at, tenant, latencies),
        sample(),
    )
    elapsed = time.monotonic() - started
    used_after = int(direct.info("memory")["used_memory"])
    direct.close()
    # the steady rate: growth between the first sample and the last (after the first burst)
    steady = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0.0
    ordered = sorted(latencies)
    return {
        "seconds": round(elapsed, 2),
        "redis_growth_mib": round((used_after - used_before) / MIB, 1),
        "redis_growth_mib_per_s": round((used_after - used_before) / MIB / elapsed, 1),
        "redis_steady_mib_per_s": round(steady / MIB, 1),
        "attacker_stored": attack.get("201", 0),
        "attacker_refused_429": attack.get("429", 0),
        "attacker_other": {k: v for k, v in attack.items() if k not in ("201", "429")},
        "tenant_answers": dict(tenant),
        "tenant_requests": len(latencies),
        "tenant_p50_ms": round(statistics.median(ordered) * 1000, 1) if ordered else None,
        "tenant_p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 1) if ordered else None,
        "tenant_max_ms": round(ordered[-1] * 1000, 1) if ordered else None,
    }


async def test_one_client_cannot_fill_the_store_and_the_other_tenant_is_served(
    relay_with: RelayWith,
) -> None:
    relay: Relay = relay_with()  # the relay's defaults: 10,000 messages / 32 MiB per 5 s per client
    figures = await flood(relay.url, relay.redis.url)
    report("client_quota_flood", **figures)
    # a burst of one bucket (32 MiB) plus the refill (6.4 MiB/s), and Redis's own overhead
    assert figures["attacker_stored"] <= 32 + 6.4 * figures["seconds"] + 8, figures
    assert figures["redis_growth_mib"] <= 32 + 6.4 * figures["seconds"] + 16, figures
    assert figures["attacker_refused_429"] > 0, figures
    assert figures["tenant_answers"] == {201: figures["tenant_requests"]}, figures
    assert figures["tenant_requests"] >= 20, figures
    assert figures["tenant_p99_ms"] < 1000, figures
    counted = await _quota_refusals(relay)  # relayfleet_quota_refusals_total, any reason
    assert counted == figures["attacker_refused_429"], counted
    relay.assert_log_clean()


async def _quota_refusals(relay: Relay) -> float:
    """The sum of the relay's relayfleet_quota_refusals_total series."""
    async with aiohttp.ClientSession() as http, http.get(relay.url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("relayfleet_quota_refusals_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> None:
    """The same flood against the relay this interpreter's PYTHONPATH holds (BEFORE figures)."""
    redis_server = start_redis()
    relay = start_relay(redis_server, Path(tempfile.mkdtemp(prefix="quota-flood-")), {})
    try:
        figures = asyncio.run(flood(relay.url, redis_server.url))
        report("client_quota_flood", **figures)
    finally:
        relay.stop()
        redis_server.stop()


if __name__ == "__main__":
    main()
