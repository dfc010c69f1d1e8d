"""DIDComm v2 through a fleet: two relay processes on two real redis-servers, the v2 test agent
mediated through one relay, senders forwarding through both, Pickup 3.0 polling through both,
while the slots of the agent's records and of its recipients' queues move back and forth
between the shards (tests/support/fleet_harness.Migrator). The history checker
(tests/support/history.py) judges it: none lost, none delivered twice, none after its ack,
none skipped, FIFO per recipient.

A forward's answer (202) names no seq: the enqueue's seq is the one its message is delivered
with (the attachment id is `<queue>.<seq>`), and one never delivered gets a seq of its own, so
the checker counts it lost."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from relay.didcomm import jwm
from relay.didcomm import keys as dk
from relay.didcomm.mediator2 import did_key
from relay.didcomm.mediator_pickup import parse_message_id
from relay.fleet.sharding import slot_of
from relay.storage import keys as K
from tests.support.didcomm2_test_agent import Agent2, forward, inner, new_recipient
from tests.support.fleet_harness import FleetProcs, Migrator, final_placement_problems
from tests.support.history import History

PUBLIC = "http://mediator.example.test"
RECIPIENTS = 3
SENDS_PER_RECIPIENT = 30


def _holding(key: jwm.AgreementKey) -> Callable[[str], jwm.AgreementKey]:
    """The recipient's key lookup: it holds one key."""
    return lambda _kid: key


async def test_v2_across_two_relays_during_slot_migration_history_holds(tmp_path: Path) -> None:
    seed = tmp_path / "seed"
    seed.write_text(os.urandom(32).hex())
    env = {
        "RELAY_DIDCOMM_SEED_FILE": str(seed),
        "RELAY_PUBLIC_URL": PUBLIC,
        "RELAY_DIDCOMM_REDELIVER_S": "60",  # prompt acks: nothing goes out twice by the lease
    }
    fleet = FleetProcs(tmp_path, shards=2, relays=2, all_on_first=True).start(env)
    try:
        async with aiohttp.ClientSession() as http:
            await _run(fleet, http)
    finally:
        fleet.stop()


async def _run(fleet: FleetProcs, http: aiohttp.ClientSession) -> None:
    urls = fleet.urls
    agent = Agent2(urls[0], http)
    await agent.mediate()
    invitations = set()
    for url in urls:  # every relay is the same mediator
        async with http.get(url + "/v1/didcomm/v2/invitation") as r:
            invitations.add((await r.json())["did"])
    assert invitations == {agent.mediator_did}
    recipients = [new_recipient() for _ in range(RECIPIENTS)]
    reply = await agent.register(*(d for d, _ in recipients))
    assert [u["result"] for u in reply["body"]["updated"]] == ["success"] * RECIPIENTS
    queue_of = {did: dk.b64url(did_key(did)) for did, _ in recipients}
    key_of = {queue_of[did]: key for did, key in recipients}
    conn = did_key(agent.did)
    slots = sorted(
        {slot_of(conn, b"")}
        | {slot_of(did_key(d), b"") for d, _ in recipients}
        | {slot_of(did_key(d), K.MEDIATOR_CHANNEL) for d, _ in recipients}
    )
    history = History()
    answered: dict[str, tuple[str, float, float, int, bool]] = {}  # id -> its storing answer

    async def produce(did: str) -> None:
        for n in range(SENDS_PER_RECIPIENT):
            mid = f"{queue_of[did][:8]}-{n}"
            packed = inner(did, mid)
            for attempt in itertools.count():
                url = urls[(n + attempt) % 2]
                body = forward(agent.mediator_did, did, packed, fid=mid)
                t0 = time.monotonic()
                async with http.post(
                    url + "/v1/didcomm", data=body, headers={"Content-Type": jwm.ENCRYPTED}
                ) as r:
                    status, retry = r.status, "Retry-After" in r.headers
                    await r.read()
                t1 = time.monotonic()
                if status == 202:  # stored: its seq is known once delivered (below)
                    answered[mid] = (queue_of[did], t0, t1, 201, retry)
                    break
                history.enqueue(queue_of[did], mid, t0, t1, status, None, mid, retry)
                assert status == 503, (status, mid)
                assert retry
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.02)

    delivered_seq: dict[str, int] = {}
    stop = asyncio.Event()

    async def consume() -> None:
        for n in itertools.count():
            url = urls[n % 2]
            request = agent.message("messagepickup/3.0/delivery-request", limit=10)
            t0 = time.monotonic()
            async with http.post(
                url + "/v1/didcomm", data=agent.packed(request), headers={"Content-Type": jwm.ENCRYPTED}
            ) as r:
                status, retry, raw = r.status, "Retry-After" in r.headers, await r.read()
            t1 = time.monotonic()
            if status != 200:
                assert status == 503, (status, raw[:200])
                assert retry
                continue
            doc = agent.open(raw).message
            per_queue: dict[str, list[tuple[int, str]]] = {q: [] for q in key_of}
            ids = []
            for a in doc.get("attachments", []):
                parsed = parse_message_id(a["id"])
                assert parsed is not None
                queue, seq = dk.b64url(parsed[0]), parsed[1]
                opened = jwm.unpack(json.dumps(a["data"]["json"]).encode(), _holding(key_of[queue]))
                content = opened.message["body"]["content"]
                per_queue[queue].append((seq, content))
                delivered_seq.setdefault(content, seq)
                ids.append(a["id"])
            for queue, items in per_queue.items():
                history.deliver(queue, "read", t0, t1, 200, items)
            if ids:
                ack = agent.message("messagepickup/3.0/messages-received", message_id_list=ids)
                a0 = time.monotonic()
                async with http.post(
                    urls[(n + 1) % 2] + "/v1/didcomm",
                    data=agent.packed(ack),
                    headers={"Content-Type": jwm.ENCRYPTED},
                ) as r:
                    ack_status = r.status
                    await r.read()
                a1 = time.monotonic()
                assert ack_status == 200
                for queue, items in per_queue.items():
                    if items:
                        history.ack(queue, a0, a1, 200, seqs=[s for s, _ in items])
            elif stop.is_set() and doc["body"].get("message_count") == 0:
                return
            else:
                await asyncio.sleep(0.05)

    migrator = Migrator(fleet, slots, seed=11, pause_s=(0.1, 0.3))
    moving = asyncio.get_running_loop().create_task(migrator.run())
    consuming = asyncio.get_running_loop().create_task(consume())
    try:
        await asyncio.gather(*(produce(d) for d, _ in recipients))
    finally:
        migrator.stop()
        await moving
    stop.set()
    await asyncio.wait_for(consuming, 60)

    # the forwards' enqueue events, with the seq each was delivered as (a message never
    # delivered gets a seq past every real one: the checker then counts it lost)
    unseen = itertools.count(1 << 40)
    for mid, (queue, t0, t1, status, retry) in answered.items():
        if status == 201:
            history.enqueue(queue, mid, t0, t1, 201, delivered_seq.get(mid, next(unseen)), mid, retry)
    verdict = history.check(exactly_once=True)
    print(verdict.render(), f"migrations: {len(migrator.reports)} runs, {migrator.moved} slot moves")
    assert verdict.ok, f"{verdict.render()}\n{fleet.relay_logs()}"
    assert verdict.counts["messages_acknowledged"] == RECIPIENTS * SENDS_PER_RECIPIENT
    assert verdict.counts["messages_delivered"] == RECIPIENTS * SENDS_PER_RECIPIENT
    assert migrator.moved >= 2, "the slots hardly moved"
    assert not await final_placement_problems(fleet, slots)
    # the records went with their slots: the keylist is still there, through either relay
    for url in urls:
        other = agent.on(url)
        listed = await other.send(other.message("coordinate-mediation/2.0/keylist-query"))
        assert listed is not None
        assert sorted(k["recipient_did"] for k in listed["body"]["keys"]) == sorted(d for d, _ in recipients)
