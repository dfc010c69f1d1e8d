"""A poisoned queue: messages no parser should meet (a 100,000-deep JSON array, bytes that are
not UTF-8, half a JSON object) stored ahead of good ones, then every delivery path reads the
queue: read, drain, inbox, the live WebSocket, Pickup 2.0 over HTTP and over live, the
mediator's Pickup over POST /v1/didcomm and its live mode on /v1/didcomm/ws, and push.

Each path must answer 2xx, hand out every message in order (the poison as the bytes stored),
and keep delivering what comes after. The mediator's queues live in its own key space: poison
the plain API puts on a mediated key's queue stays in that HTTP API queue, never reaching (nor
being removed by) the mediator's Pickup; only packed messages are forwarded into the
mediator's space. Before the fix one anonymous forward whose `msg` was 3,000 nested `[` made every
later mediator delivery-request answer 500 and live mode close 1011 (the mediator parsed
stored payloads to embed them as `data.json`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from relayfleet_testing.localredis import free_port

from relay.didcomm import keys as dk
from relay.protocol import b64decode, b64encode
from tests.hostile.didcomm_attacker import Mediated, mediated, nested, post, serving
from tests.hostile.harness import Relay, RelayWith, recipient, report
from tests.support.didcomm_test_agent import msg

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("poisoned-queues")]  # one relay per module

POISONS = (b"[" * 100_000, b"\xff\xfe\x00 not utf-8", b'{"protected": ')
GOOD = (b'{"ok": 1}', b'{"ok": 2}')
PICKUP = "https://didcomm.org/messagepickup/2.0/"


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    yield from serving(tmp_path_factory.mktemp("poison"))


async def _enqueue(http: aiohttp.ClientSession, relay: Relay, key: str, payloads: tuple[bytes, ...]) -> None:
    for payload in payloads:
        async with http.post(f"{relay.url}/v1/queues/{key}/messages", data=payload) as resp:
            assert resp.status == 201, await resp.text()


def _payloads(doc: dict[str, Any]) -> list[bytes]:
    return [b64decode(m["payload"]) for m in doc["messages"]]


def _attached(doc: dict[str, Any]) -> list[bytes]:
    return [dk.b64decode_any(a["data"]["base64"]) for a in doc["~attach"]]


async def test_read_and_drain_hand_out_poison_and_what_follows(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    for n, route in ((101, "read"), (102, "drain")):
        key = recipient(n)
        await _enqueue(http, relay, key, (*POISONS, *GOOD))
        url = f"{relay.url}/v1/queues/{key}/" + (
            "messages?limit=100" if route == "read" else "drain?limit=100"
        )
        method = http.get if route == "read" else http.post
        async with method(url) as resp:
            assert resp.status == 200
            assert _payloads(await resp.json()) == [*POISONS, *GOOD]
    report("poisoned read/drain", statuses="200/200", delivered=len(POISONS) + len(GOOD))


async def test_inbox_hands_out_poison_and_what_follows(http: aiohttp.ClientSession, relay: Relay) -> None:
    headers = {"X-Inbox-ID": "poisoned-inbox-1"}
    for i, payload in enumerate((*POISONS, *GOOD)):
        body = {"messageId": f"m{i}", "ciphertext": b64encode(payload)}
        async with http.post(relay.url + "/v1/inbox/append", json=body, headers=headers) as resp:
            assert resp.status == 201
    async with http.get(relay.url + "/v1/inbox/messages", headers=headers) as resp:
        assert resp.status == 200
        got = [b64decode(m["ciphertext"]) for m in (await resp.json())["messages"]]
    assert got == [*POISONS, *GOOD]


async def test_live_socket_and_pickup_over_live_hand_out_poison(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    key = recipient(103)
    await _enqueue(http, relay, key, (*POISONS, *GOOD))
    ws_url = relay.url.replace("http://", "ws://") + f"/v1/queues/{key}/live"
    async with http.ws_connect(ws_url) as ws:
        frames = []
        while True:
            frame = await ws.receive_json(timeout=5)
            if frame["type"] == "empty":
                break
            frames.append(b64decode(frame["payload"]))
        assert frames == [*POISONS, *GOOD]
        await ws.send_json({"@type": PICKUP + "delivery-request", "@id": "d1", "limit": 10})
        delivery = await ws.receive_json(timeout=5)
        assert delivery["@type"] == PICKUP + "delivery", delivery
        assert _attached(delivery) == [*POISONS, *GOOD]
        assert not ws.closed
    await _enqueue(http, relay, key, (b'{"ok": 3}',))  # the queue still takes and gives
    async with http.get(f"{relay.url}/v1/queues/{key}/messages?limit=100") as resp:
        assert _payloads(await resp.json())[-1] == b'{"ok": 3}'


async def test_pickup_over_http_hands_out_poison_and_acks_it(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    key = recipient(104)
    await _enqueue(http, relay, key, (*POISONS, *GOOD))
    request = {"@type": PICKUP + "delivery-request", "recipient_key": key, "limit": 10}
    async with http.post(relay.url + "/v1/didcomm/pickup", json=request) as resp:
        assert resp.status == 200
        delivery = await resp.json()
    assert _attached(delivery) == [*POISONS, *GOOD]
    ids = [a["@id"] for a in delivery["~attach"]]
    ack = {"@type": PICKUP + "messages-received", "recipient_key": key, "message_id_list": ids}
    async with http.post(relay.url + "/v1/didcomm/pickup", json=ack) as resp:
        assert resp.status == 200
        assert (await resp.json())["message_count"] == 0


async def _poison_mediated(http: aiohttp.ClientSession, relay: Relay, m: Mediated) -> dict[str, int]:
    """Every bad forward an anonymous sender can post, plus raw poison on the key's queue.
    Returns each bad forward's status by name."""
    statuses = {}
    bad: dict[str, Any] = {
        "string_3000": "[" * 3000,  # the forward: refused now, stored before
        "list": json.loads(nested(30)),  # a list where a packed message belongs
        "not_envelope": {"x": 1},
    }
    for name, inner in bad.items():
        statuses[name], _ = await post(http, relay, m.forward(inner))
    statuses["object_3000"], _ = await post(
        http, relay, m.forward_raw(b'{"a": ' * 3000 + b"{}" + b"}" * 3000)
    )
    # shaped like an envelope, opens for nobody: stored, delivered, the agent discards it
    shaped = {"protected": "e30", "iv": "AAAA", "ciphertext": "AAAA", "tag": "AAAA"}
    statuses["shaped_garbage"], _ = await post(http, relay, m.forward(shaped))
    # the plain API takes anything, on the key's HTTP API queue: not the mediator's
    await _enqueue(http, relay, dk.b64url(m.key), POISONS)
    return statuses


async def _http_api_queue(http: aiohttp.ClientSession, relay: Relay, m: Mediated) -> list[bytes]:
    async with http.get(f"{relay.url}/v1/queues/{dk.b64url(m.key)}/messages?limit=100") as resp:
        assert resp.status == 200
        return _payloads(await resp.json())


async def test_mediator_pickup_over_http_survives_a_poisoned_inbox(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    m = await mediated(relay, http)
    statuses = await _poison_mediated(http, relay, m)
    assert statuses == {
        "string_3000": 400,
        "list": 400,
        "not_envelope": 400,
        "object_3000": 400,
        "shaped_garbage": 202,
    }
    goods = [m.good(f"after the poison {i}") for i in range(3)]
    for inner in goods:
        assert (await post(http, relay, m.forward(inner)))[0] == 202
    answers = []
    started = time.perf_counter()
    delivery = await m.agent.send(msg("messagepickup/2.0/delivery-request", limit=20))
    answers.append(200)
    assert delivery is not None
    assert delivery["@type"].endswith("/delivery")
    got = _attached(delivery)
    assert got[-3:] == [json.dumps(g).encode() for g in goods]  # in order, as forwarded
    assert len(got) == 1 + 3  # the shaped garbage too; the raw poison is not the mediator's
    assert not set(got) & set(POISONS)
    assert await _http_api_queue(http, relay, m) == list(POISONS)  # neither taken nor dropped
    ids = [a["@id"] for a in delivery["~attach"]]
    after = await m.agent.send(msg("messagepickup/2.0/messages-received", message_id_list=ids))
    assert after is not None
    assert after["message_count"] == 0
    for _ in range(5):  # later polls keep answering (before: 500 every time)
        status = await m.agent.send(msg("messagepickup/2.0/status-request"))
        assert status is not None
        answers.append(200)
    report(
        "poisoned mediator inbox, Pickup over HTTP",
        bad_forwards=statuses,
        delivery_requests=answers,
        delivered=len(got),
        ms=round((time.perf_counter() - started) * 1000),
    )


async def test_mediator_live_mode_survives_a_poisoned_inbox(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    m = await mediated(relay, http)
    await _poison_mediated(http, relay, m)
    goods = [m.good(f"live after the poison {i}") for i in range(3)]
    want = {json.dumps(g).encode() for g in goods}
    ws_url = relay.url.replace("http://", "ws://") + "/v1/didcomm/ws"
    got: list[bytes] = []
    async with http.ws_connect(ws_url) as ws:
        change = msg("messagepickup/2.0/live-delivery-change", live_delivery=True)
        await ws.send_bytes(m.agent.packed({**change, "~transport": {"return_route": "all"}}))
        for inner in goods:
            assert (await post(http, relay, m.forward(inner)))[0] == 202
        deadline = time.monotonic() + 10
        while not want <= set(got) and time.monotonic() < deadline:
            frame = await ws.receive(timeout=5)
            assert frame.type == aiohttp.WSMsgType.BINARY, (frame.type, frame.data, frame.extra)
            doc, _ = m.agent.open(frame.data)
            if doc["@type"].endswith("/delivery"):
                got += _attached(doc)
                ack = msg(
                    "messagepickup/2.0/messages-received", message_id_list=[a["@id"] for a in doc["~attach"]]
                )
                await ws.send_bytes(m.agent.packed(ack))
        assert not ws.closed, ws.close_code
    assert want <= set(got)
    assert not set(got) & set(POISONS)  # never handed to the agent
    assert await _http_api_queue(http, relay, m) == list(POISONS)
    report("poisoned mediator inbox, live mode", delivered=len(got), close_code=None)


async def test_push_notifies_every_message_after_poison(
    relay_with: RelayWith, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    seen: list[dict[str, Any]] = []
    last_seq = 0
    all_seen = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if seen[-1]["seq"] == last_seq:
            all_seen.set()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        target = relay_with({"RELAY_PUSH_WEBHOOK": f"http://127.0.0.1:{port}/hook"})
        key = recipient(105)
        seqs = []
        for payload in (*POISONS, *GOOD):
            async with http.post(f"{target.url}/v1/queues/{key}/messages", data=payload) as resp:
                assert resp.status == 201
                seqs.append((await resp.json())["seq"])
            await asyncio.sleep(0.3)  # one notification per message (a burst coalesces)
        last_seq = seqs[-1]
        if seen and seen[-1]["seq"] == last_seq:
            all_seen.set()
        await asyncio.wait_for(all_seen.wait(), 10)
        assert [n["seq"] for n in seen] == seqs
    finally:
        await runner.cleanup()
