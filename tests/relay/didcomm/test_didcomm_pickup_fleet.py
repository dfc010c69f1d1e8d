"""The v1 mediator's Pickup 2.0 across two relay processes on one redis-server, driven the way a
stock Credo-ts agent polls through a load-balanced Service: status-request, then (when it says
message_count > 0) delivery-request with that limit, then messages-received, each message of
that cycle to the other relay, several cycles in flight at once (Credo's poll timer does not
wait for the last cycle), while an anonymous sender forwards through both relays.

The lease (RELAY_DIDCOMM_REDELIVER_S) is far longer than the run: any message delivered twice was
handed out twice inside its lease (two relays both taking it), and a message that waits for the
lease to run out before going out (status counting it as handed out while it is not) stalls the
run past its deadline. The history checker judges the rest: none lost, none after its ack, FIFO.

The e2e failure this reproduces without the real node: e2e/test_didcomm_fleet.py::
test_ten_messages_in_order_with_polling (docs/protocols.md, Pickup 2.0's lease)."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
from relayfleet_testing.localredis import LocalRedis

from relay.didcomm import keys as dk
from relay.didcomm.mediator_pickup import parse_message_id
from tests.support.didcomm_test_agent import Agent, attached, forward_envelope, inner_message, msg
from tests.support.fleet_harness import RelayProc, relay_logs, spawn_relay, stop_relays, wait_ready
from tests.support.history import History, Verdict

PUBLIC = "http://mediator.example.test"
MESSAGES = 60
POLLERS = 4  # status → delivery → ack cycles in flight at once
DEADLINE_S = 40.0  # everything acknowledged by then; the lease below is longer


async def test_pickup_2_polling_alternating_between_two_relays_delivers_each_once(
    tmp_path: Path, redis_server: LocalRedis, http: aiohttp.ClientSession
) -> None:
    seed = tmp_path / "seed"
    seed.write_text(os.urandom(32).hex())
    env = {
        "RELAY_DIDCOMM_SEED_FILE": str(seed),
        "RELAY_PUBLIC_URL": PUBLIC,
        "RELAY_DIDCOMM_REDELIVER_S": "120",  # nothing goes out twice by running out of lease
    }
    relays: list[RelayProc] = [
        spawn_relay(["--redis-url", redis_server.url], tmp_path, env) for _ in range(2)
    ]
    try:
        for r in relays:
            wait_ready(r)
        await _run([r.url for r in relays], http, relays)
    finally:
        stop_relays(relays)


async def _run(urls: list[str], http: aiohttp.ClientSession, relays: list[RelayProc]) -> None:
    first = Agent(urls[0], http)
    await first.connect()
    await first.mediate()
    agents = [first, first.on(urls[1])]
    key = dk.KeyPair.from_seed(os.urandom(32)).verkey
    reply = await agents[1].register(key)
    assert reply["updated"][0]["result"] == "success"
    routing = dk.verkey_from(first.grant["routing_keys"][0])
    queue = dk.b64url(key)
    history = History()
    id_of: dict[str, str] = {}  # an inner message's ciphertext -> its id
    answered: dict[str, tuple[float, float]] = {}
    delivered_seq: dict[str, int] = {}
    acked: set[str] = set()
    rng = random.Random(7)

    async def produce() -> None:
        for n in range(MESSAGES):
            mid = f"m-{n:03d}"
            inner = inner_message(key, mid)
            id_of[inner["ciphertext"]] = mid
            t0 = time.monotonic()
            status, body = await agents[n % 2].post(forward_envelope(routing, key, inner, fid=mid))
            answered[mid] = (t0, time.monotonic())
            assert (status, body) == (202, b""), (status, body[:200])
            await asyncio.sleep(rng.uniform(0.0, 0.03))

    async def poll(p: int) -> None:
        for n in itertools.count(p):
            if len(acked) == MESSAGES:
                return
            status = await agents[n % 2].send(msg("messagepickup/2.0/status-request"))
            assert status is not None
            assert status["@type"].endswith("/status"), status
            count = status["message_count"]
            if count == 0:
                await asyncio.sleep(0.01)
                continue
            t0 = time.monotonic()
            got = await agents[(n + 1) % 2].send(msg("messagepickup/2.0/delivery-request", limit=count))
            t1 = time.monotonic()
            assert got is not None
            if not got["@type"].endswith("/delivery"):
                continue
            items = []
            for a, packed in zip(got["~attach"], attached(got), strict=True):
                parsed = parse_message_id(a["@id"])
                assert parsed is not None
                assert parsed[0] == key
                mid = id_of[packed["ciphertext"]]
                items.append((parsed[1], mid))
                delivered_seq.setdefault(mid, parsed[1])
            # Pickup names no fromSeq: a delivery starts past the lease of the ones before it,
            # which may not be acknowledged yet (another poller's). Gaps inside one delivery
            # still count as skipped, and a message never handed out fails the deadline.
            history.deliver(queue, "read", t0, t1, 200, items, from_seq=items[0][0])
            await asyncio.sleep(rng.uniform(0.0, 0.02))  # the agent handles them, then acks
            ids = [a["@id"] for a in got["~attach"]]
            a0 = time.monotonic()
            after = await agents[n % 2].send(msg("messagepickup/2.0/messages-received", message_id_list=ids))
            assert after is not None
            assert after["@type"].endswith("/status"), after
            history.ack(queue, a0, time.monotonic(), 200, seqs=[s for s, _ in items])
            acked.update(mid for _, mid in items)

    def verdict() -> Verdict:
        unseen = itertools.count(1 << 40)  # a message never delivered: a seq past every real one
        for mid, (t0, t1) in answered.items():
            history.enqueue(queue, mid, t0, t1, 201, delivered_seq.get(mid, next(unseen)), mid)
        return history.check(exactly_once=True)

    t_start = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(produce(), *(poll(p) for p in range(POLLERS))), DEADLINE_S)
    except TimeoutError:
        missing = sorted(set(id_of.values()) - acked)
        stuck: Any = await agents[0].send(msg("messagepickup/2.0/status-request"))
        raise AssertionError(
            f"{len(missing)} of {MESSAGES} never delivered and acknowledged in {DEADLINE_S} s: "
            f"{missing[:10]}; status then: {stuck}\n{verdict().render()}\n{relay_logs(relays)}"
        ) from None
    took = time.monotonic() - t_start
    judged = verdict()
    print(judged.render(), f"{MESSAGES} messages in {took:.1f} s")
    assert judged.ok, judged.render()
    assert judged.counts["messages_delivered"] == MESSAGES
    final: Any = await agents[0].send(msg("messagepickup/2.0/status-request"))
    assert (final["message_count"], final["total_bytes"]) == (0, 0)
