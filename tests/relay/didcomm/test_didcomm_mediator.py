"""The DIDComm mediator end to end over real sockets and a real redis-server, with the PyNaCl
test agent of tests/support/didcomm_test_agent.py: invitation → DID Exchange → mediation → keylist →
forward from an anonymous sender → Pickup 2.0, over HTTP and the WebSocket."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.didcomm import keys as dk
from relay.didcomm.envelope import pack
from tests.support.didcomm_test_agent import Agent, attached, forward_envelope, inner_message, msg
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.waiting import until

PUBLIC = "https://relay.example.test"


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str) -> RunningRelay:
    return await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC, didcomm_redeliver_s=0.5
    )


@pytest.fixture
async def agent(relay: RunningRelay, http: aiohttp.ClientSession) -> Agent:
    a = Agent(relay.base_url, http)
    return a


def routing_key(agent: Agent) -> bytes:
    return dk.verkey_from(agent.grant["routing_keys"][0])


async def mediated(agent: Agent) -> bytes:
    """Connect, get mediation, register one fresh recipient key; returns that key."""
    await agent.connect()
    await agent.mediate()
    key = dk.KeyPair.from_seed(os.urandom(32)).verkey
    reply = await agent.register(key)
    assert reply["updated"][0]["result"] == "success"
    return key


async def test_invitation_is_out_of_band_1_1_with_the_public_endpoint(relay: RunningRelay, http: Any) -> None:
    async with http.get(relay.base_url + "/v1/didcomm/invitation") as r:
        assert r.status == 200
        body = await r.json()
    inv = body["invitation"]
    assert inv["@type"] == "https://didcomm.org/out-of-band/1.1/invitation"
    assert "https://didcomm.org/didexchange/1.1" in inv["handshake_protocols"]
    endpoints = [s["serviceEndpoint"] for s in inv["services"]]
    assert endpoints == [PUBLIC + "/v1/didcomm", "wss://relay.example.test/v1/didcomm/ws"]
    assert inv["services"][0]["recipientKeys"][0].startswith("did:key:z6Mk")
    assert [s["id"] for s in inv["services"]] == ["#inline-0", "#inline-1"]  # unique ids
    url = body["invitation_url"]
    assert url.startswith(PUBLIC + "/v1/didcomm?oob=")
    assert json.loads(dk.b64decode_any(url.split("oob=", 1)[1])) == inv


async def test_did_exchange_response_is_signed_and_names_a_resolvable_did(agent: Agent) -> None:
    response = await agent.connect()
    assert response["@type"] == "https://didcomm.org/didexchange/1.1/response"
    did = response["did"]
    assert did.startswith("did:peer:2.Vz6Mk")
    assert dk.keys_of_did(did) == [agent.mediator_key]
    attach = response["did_rotate~attach"]
    payload = attach["data"]["base64"]
    assert dk.b64decode_any(payload).decode() == did
    jws = attach["data"]["jws"]
    signer = dk.verkey_from(jws["header"]["kid"])
    assert signer == agent.mediator_key  # the invitation key signs the rotation
    sig = dk.b64decode_any(jws["signature"])
    assert dk.verify(signer, f"{jws['protected']}.{payload}".encode(), sig)
    assert not dk.verify(signer, f"{jws['protected']}.{payload}x".encode(), sig)


async def test_whole_flow_forward_then_pickup_over_http(agent: Agent, http: Any) -> None:
    key = await mediated(agent)
    assert agent.grant["endpoint"] == PUBLIC + "/v1/didcomm"
    keylist = await agent.send(msg("coordinate-mediation/1.0/keylist-query"))
    assert keylist is not None
    assert keylist["keys"] == [{"recipient_key": dk.did_key(key)}]

    inners = [inner_message(key, f"hello {i}") for i in range(3)]
    for inner in inners:  # an anonymous sender: no connection, anoncrypt to the routing key
        status, body = await agent.post(forward_envelope(routing_key(agent), key, inner))
        assert (status, body) == (202, b"")

    summary = await agent.send(msg("messagepickup/2.0/status-request"))
    assert summary is not None
    assert summary["message_count"] == 3
    assert summary["live_delivery"] is False
    delivery = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
    assert delivery is not None
    assert delivery["@type"].endswith("/delivery")
    got = attached(delivery)
    assert got == inners  # in order, and exactly the packed messages the senders forwarded
    # handed out, not acknowledged: not offered again to the next poll (leased) ...
    again = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
    assert again is not None
    assert again["@type"].endswith("/status")
    assert again["message_count"] == 0
    # ... but not deleted either
    ids = [a["@id"] for a in delivery["~attach"][:2]]
    after = await agent.send(msg("messagepickup/2.0/messages-received", message_id_list=ids))
    assert after is not None
    assert after["message_count"] == 0  # the third is still leased
    fresh = inner_message(key, "fresh")
    assert (await agent.post(forward_envelope(routing_key(agent), key, fresh)))[0] == 202
    new = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
    assert new is not None
    assert attached(new) == [fresh]  # only what was not handed out
    await asyncio.sleep(0.6)  # the lease (RELAY_DIDCOMM_REDELIVER_S=0.5 here) runs out
    last = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
    assert last is not None
    assert attached(last) == [inners[2], fresh]  # again, in order


async def test_an_unpackable_message_in_the_mediators_space_is_removed_counted_and_logged(
    agent: Agent, relay: RunningRelay, http: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Only forwards write the mediator's queues and they store packed messages only; what
    Redis holds otherwise (written behind the relay's back) is removed at delivery, with
    relayfleet_didcomm_messages_total{result="dropped"} and a log line saying how many."""
    from relay.api.context import CTX
    from relay.storage.keys import MEDIATOR_CHANNEL
    from relay.storage.store import EnqueueRequest

    key = await mediated(agent)
    service = relay.app[CTX].service
    stored = await service.enqueue(EnqueueRequest(key, MEDIATOR_CHANNEL, b"[[[ not an envelope", ""))
    assert stored.kind == "stored"
    inner = inner_message(key, "good")
    assert (await agent.post(forward_envelope(routing_key(agent), key, inner)))[0] == 202
    with caplog.at_level(logging.WARNING, "relay.didcomm"):
        delivery = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
    assert delivery is not None
    assert attached(delivery) == [inner]
    assert "removed 1 stored messages that are not packed messages" in caplog.text
    async with http.get(relay.base_url + "/metrics") as r:
        text = await r.text()
    assert 'relayfleet_didcomm_messages_total{result="dropped",type="messagepickup/2.0/delivery"}' in text


async def test_forward_with_the_same_id_is_stored_once(agent: Agent) -> None:
    key = await mediated(agent)
    inner = inner_message(key, "once")
    for _ in range(2):
        status, _ = await agent.post(forward_envelope(routing_key(agent), key, inner, fid="fwd-1"))
        assert status == 202
    status_doc = await agent.send(msg("messagepickup/2.0/status-request"))
    assert status_doc is not None
    assert status_doc["message_count"] == 1


async def test_forward_obeys_the_queue_rate_limit(
    redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str, http: Any
) -> None:
    from relay.storage.store import QueueLimits

    relay = await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC, limits=QueueLimits(rate_count=2)
    )
    agent = Agent(relay.base_url, http)
    key = await mediated(agent)
    codes = []
    for i in range(3):
        status, body = await agent.post(forward_envelope(routing_key(agent), key, inner_message(key, str(i))))
        codes.append(status)
    assert codes == [202, 202, 429]
    assert json.loads(body)["code"] == "rate_limited"


async def test_live_mode_on_the_websocket_delivers_and_waits_for_the_ack(
    agent: Agent, relay: RunningRelay, http: Any
) -> None:
    key = await mediated(agent)
    async with http.ws_connect(relay.base_url + "/v1/didcomm/ws") as ws:
        change = msg("messagepickup/2.0/live-delivery-change", live_delivery=True)
        change["~transport"] = {"return_route": "all"}
        await ws.send_bytes(agent.packed(change))
        status, _ = agent.open(await ws.receive_bytes(timeout=5))
        assert status["live_delivery"] is True
        assert status["message_count"] == 0

        inner = inner_message(key, "live")
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        assert (await agent.post(forward_envelope(routing_key(agent), key, inner)))[0] == 202
        delivery, _ = agent.open(await ws.receive_bytes(timeout=5))
        assert loop.time() - sent_at < 1.0
        assert delivery["@type"] == "https://didcomm.org/messagepickup/2.0/delivery"
        assert attached(delivery) == [inner]

        # delivered but not acknowledged: still held
        st = await agent.send(msg("messagepickup/2.0/status-request"))
        assert st is not None
        assert st["message_count"] == 1
        assert st["live_delivery"] is True  # asked over HTTP: the socket in live mode holds the lease
        # ...but not offered again on the live socket: a status there counts it as in flight
        ask = msg("messagepickup/2.0/status-request")
        ask["~transport"] = {"return_route": "all"}
        await ws.send_bytes(agent.packed(ask))
        live_status, _ = agent.open(await ws.receive_bytes(timeout=5))
        assert live_status["message_count"] == 0
        assert live_status["live_delivery"] is True
        ack = msg("messagepickup/2.0/messages-received", message_id_list=[delivery["~attach"][0]["@id"]])
        ack["~transport"] = {"return_route": "all"}
        await ws.send_bytes(agent.packed(ack))
        after, _ = agent.open(await ws.receive_bytes(timeout=5))
        assert after["message_count"] == 0

    async def not_live() -> bool:
        st = await agent.send(msg("messagepickup/2.0/status-request"))
        return st is not None and st["live_delivery"] is False

    await until("live_delivery false once the live socket closed", not_live, 5)


async def test_trust_ping_and_discover_features(agent: Agent) -> None:
    await agent.connect()
    ping = msg("trust_ping/1.0/ping", response_requested=True)
    pong = await agent.send(ping)
    assert pong is not None
    assert pong["@type"].endswith("trust_ping/1.0/ping_response")
    assert pong["~thread"]["thid"] == ping["@id"]
    disclose = await agent.send(
        msg("discover-features/1.0/query", query="https://didcomm.org/messagepickup/*")
    )
    assert disclose is not None
    assert [p["pid"] for p in disclose["protocols"]] == ["https://didcomm.org/messagepickup/2.0"]


async def test_bad_inputs_are_4xx_json_and_store_nothing(
    agent: Agent, relay: RunningRelay, redis_server: LocalRedis
) -> None:
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=False)
    before = {k for k in r.keys("*") if isinstance(k, bytes)}
    stranger = dk.KeyPair.from_seed(os.urandom(32))
    cases: list[tuple[bytes, int, str]] = [
        (b"not json", 400, "bad_envelope"),
        (
            json.dumps({"protected": "x", "iv": "x", "ciphertext": "x", "tag": "x"}).encode(),
            400,
            "bad_envelope",
        ),
        # packed for somebody else
        (pack(b"{}", [stranger.verkey], None), 400, "bad_envelope"),
    ]
    invitation_key = dk.verkey_from(
        (await (await agent.http.get(relay.base_url + "/v1/didcomm/invitation")).json())["invitation"][
            "services"
        ][0]["recipientKeys"][0]
    )
    # a tampered envelope
    good = json.loads(
        pack(b'{"@type": "https://didcomm.org/trust_ping/1.0/ping"}', [invitation_key], stranger)
    )
    good["ciphertext"] = "A" + good["ciphertext"][1:]
    cases.append((json.dumps(good).encode(), 400, "bad_envelope"))
    # an unknown connection
    cases.append(
        (
            pack(json.dumps(msg("trust_ping/1.0/ping")).encode(), [invitation_key], stranger),
            403,
            "unknown_connection",
        )
    )
    # a forward to a key nobody registered
    stray = inner_message(stranger.verkey, "x")
    cases.append((forward_envelope(invitation_key, stranger.verkey, stray), 404, "unknown_recipient"))
    # a forward whose msg is not a packed message: refused, never queued
    cases.append((forward_envelope(invitation_key, stranger.verkey, {"x": 1}), 400, "bad_forward"))
    # not a DIDComm message inside
    cases.append((pack(b"[1, 2]", [invitation_key], None), 400, "bad_didcomm_message"))
    for body, status, code in cases:
        got_status, got_body = await agent.post(body)
        assert got_status == status, (code, got_body)
        assert json.loads(got_body)["code"] == code
    # a malformed protocol message on a real connection
    await agent.connect()
    status, body = await agent.post(agent.packed(msg("messagepickup/2.0/delivery-request", limit="ten")))
    assert status == 400
    assert json.loads(body)["code"] == "bad_didcomm_message"
    # nothing but the agent's own connection record (and its idle expiry) was written: no
    # queue, no other record (fleet-level keys such as the boot marker are the relay's own)
    new = {k for k in r.keys("rf:{*") if isinstance(k, bytes)} - before
    assert sorted(k.rsplit(b":", 1)[1] for k in new) == [b"didcomm", b"didcomm-idle"]


async def test_without_a_seed_the_mediator_is_off(
    redis_server: LocalRedis, relay_factory: RelayFactory, http: Any
) -> None:
    relay = await relay_factory(redis_server.url)
    async with http.get(relay.base_url + "/v1/didcomm/invitation") as r:
        assert r.status == 404
        assert (await r.json())["code"] == "didcomm_disabled"


async def test_slot_migration_moves_connections_keylists_and_queues(
    tmp_path: Path, seed_file: str, http: Any
) -> None:
    """The connection's records and the registered key's records and queue move with their
    slots to another shard; the agent carries on through the same relay without noticing."""
    from aiohttp.test_utils import TestServer

    from relay.app import build_app
    from relay.fleet.migration import file_publisher, migrate_slots, write_map_file
    from relay.fleet.routing import ShardRouter, file_source, load_file
    from relay.fleet.sharding import SLOT_COUNT, ShardMap, SlotRange, slot_of
    from relay.settings import Settings
    from relay.storage import keys as K

    servers = {n: LocalRedis(binary="/usr/bin/redis-server", dir=str(tmp_path / n)) for n in ("a", "b")}
    for s in servers.values():
        s.start()
    path = str(tmp_path / "map.json")
    urls = {n: s.url for n, s in servers.items()}
    write_map_file(path, ShardMap("t", 1, urls, (SlotRange(0, SLOT_COUNT - 1, "a"),)))
    settings = Settings(auth="none", didcomm_seed_file=seed_file, public_url=PUBLIC)
    fleet = ShardRouter(load_file(path), settings.limits)
    await fleet.start(file_source(path), poll_s=3600)  # only a MOVED reply makes it reload
    server = TestServer(build_app(settings, fleet), host="127.0.0.1")
    await server.start_server()
    try:
        agent = Agent(str(server.make_url("")).rstrip("/"), http)
        key = await mediated(agent)
        inners = [inner_message(key, f"before {i}") for i in range(2)]
        for inner in inners:
            assert (await agent.post(forward_envelope(routing_key(agent), key, inner)))[0] == 202
        # the records' slots and the queue's, in the mediator's own key space
        slots = sorted({slot_of(agent.kp.verkey, b""), slot_of(key, b""), slot_of(key, K.MEDIATOR_CHANNEL)})
        report = await migrate_slots(load_file(path), slots, "b", file_publisher(path))
        assert report.slots_moved == len(slots)
        ra, rb = (redis.Redis.from_url(servers[n].url) for n in ("a", "b"))
        record_slots = {slot_of(agent.kp.verkey, b""), slot_of(key, b"")}
        for slot in record_slots:
            assert not ra.exists(K.slot_didcomm(slot))
            assert rb.exists(K.slot_didcomm(slot))
        queue = K.queue_keys(key, K.MEDIATOR_CHANNEL)
        assert not ra.exists(queue.msgs)
        assert rb.xlen(queue.msgs) == 2
        keylist = await agent.send(msg("coordinate-mediation/1.0/keylist-query"))
        assert keylist is not None
        assert keylist["keys"] == [{"recipient_key": dk.did_key(key)}]
        after = inner_message(key, "after")
        assert (await agent.post(forward_envelope(routing_key(agent), key, after)))[0] == 202
        delivery = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
        assert delivery is not None
        assert attached(delivery) == [*inners, after]
    finally:
        await server.close()
        await fleet.close()
        for s in servers.values():
            s.stop()


async def test_a_did_peer_4_requester_connects(agent: Agent) -> None:
    """Credo 0.6's default request DID: did:peer:4 long form, its document in the DID."""
    agent.did = peer4_did(agent.kp)
    response = await agent.connect()
    assert response["did"].startswith("did:peer:2")
    pong = await agent.send(msg("trust_ping/1.0/ping"))
    assert pong is not None


async def test_a_tampered_did_peer_4_is_refused(agent: Agent) -> None:
    did = peer4_did(agent.kp)
    agent.did = did[:-3] + ("abc" if not did.endswith("abc") else "abd")
    with pytest.raises(AssertionError):
        await agent.connect()


def peer4_did(kp: dk.KeyPair) -> str:
    """A did:peer:4 long form shaped as Credo builds one for a DIDComm v1 service."""
    import hashlib

    doc = {
        "@context": ["https://w3id.org/did/v1"],
        "verificationMethod": [
            {"id": "#key-1", "type": "Ed25519VerificationKey2018", "publicKeyBase58": kp.b58},
            {
                "id": "#key-2",
                "type": "X25519KeyAgreementKey2019",
                "publicKeyBase58": dk.b58encode(kp.x_public),
            },
        ],
        "service": [
            {
                "id": "#inline-0",
                "serviceEndpoint": "didcomm:transport/queue",
                "type": "did-communication",
                "priority": 0,
                "recipientKeys": ["#key-1"],
                "accept": ["didcomm/aip1"],
            }
        ],
        "authentication": ["#key-1"],
        "keyAgreement": ["#key-2"],
    }
    encoded = "z" + dk.b58encode(dk.JSON_CODEC + json.dumps(doc).encode())
    digest = "z" + dk.b58encode(dk.SHA256_MULTIHASH + hashlib.sha256(encoded.encode()).digest())
    return f"did:peer:4{digest}:{encoded}"


async def test_24_byte_nonces_metrics_and_websocket_errors(
    agent: Agent, relay: RunningRelay, http: Any
) -> None:
    await agent.connect()
    pong = await agent.send(msg("trust_ping/1.0/ping"), nonce_bytes=24)  # a libindy-era envelope
    assert pong is not None
    async with http.ws_connect(relay.base_url + "/v1/didcomm/ws") as ws:
        await ws.send_bytes(b"garbage")
        frame = await ws.receive_json(timeout=5)
        assert frame["code"] == "bad_envelope"
        ping = msg("trust_ping/1.0/ping")
        ping["~transport"] = {"return_route": "all"}
        await ws.send_str(agent.packed(ping).decode())  # text frames work too
        reply, _ = agent.open(await ws.receive_bytes(timeout=5))
        assert reply["~thread"]["thid"] == ping["@id"]
    async with http.get(relay.base_url + "/metrics") as r:
        text = await r.text()
    assert 'relayfleet_didcomm_messages_total{result="ok",type="trust_ping/1.0/ping"}' in text
    assert 'relayfleet_didcomm_messages_total{result="undecryptable",type="envelope"}' in text


async def test_shutdown_closes_didcomm_sockets(agent: Agent, relay: RunningRelay, http: Any) -> None:
    key = await mediated(agent)
    async with http.ws_connect(relay.base_url + "/v1/didcomm/ws") as ws:
        change = msg("messagepickup/2.0/live-delivery-change", live_delivery=True)
        change["~transport"] = {"return_route": "all"}
        await ws.send_bytes(agent.packed(change))
        agent.open(await ws.receive_bytes(timeout=5))
        assert key
        closing = asyncio.ensure_future(relay.server.close())
        frame = await ws.receive(timeout=10)
        assert frame.type == aiohttp.WSMsgType.CLOSE
        assert frame.data == 1001
        await asyncio.wait_for(closing, 10)


async def test_keylist_rules(agent: Agent, relay: RunningRelay, http: Any) -> None:
    await agent.connect()
    # keys only after a grant
    status, body = await agent.post(agent.packed(msg("coordinate-mediation/1.0/keylist-query")))
    assert status == 400
    assert json.loads(body)["code"] == "mediation_not_granted"
    key = await mediated(agent)
    # another connection cannot take a key this one registered
    other = Agent(relay.base_url, http)
    await other.connect()
    await other.mediate()
    taken = await other.register(key)
    assert taken["updated"][0]["result"] == "client_error"
    # removal: the key leaves the keylist and forwards to it are refused
    removed = await agent.register(key, action="remove")
    assert removed["updated"] == [{"recipient_key": dk.did_key(key), "action": "remove", "result": "success"}]
    keylist = await agent.send(msg("coordinate-mediation/1.0/keylist-query"))
    assert keylist is not None
    assert keylist["keys"] == []
    status, body = await agent.post(forward_envelope(routing_key(agent), key, inner_message(key, "late")))
    assert status == 404
    assert json.loads(body)["code"] == "unknown_recipient"
    # a resent DID Exchange request (same DID) keeps the connection's grant
    await agent.connect()
    again = await agent.send(msg("coordinate-mediation/1.0/keylist-query"))
    assert again is not None
    assert again["@type"].endswith("/keylist")
    # now free for the other connection, in base58 form too
    reply = await other.send(
        msg(
            "coordinate-mediation/1.0/keylist-update",
            updates=[{"recipient_key": dk.b58encode(key), "action": "add"}],
        )
    )
    assert reply is not None
    assert reply["updated"][0]["result"] == "success"


async def test_a_wildcard_host_without_a_public_url_is_warned_about(
    redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="relay.didcomm"):
        relay = await relay_factory(redis_server.url, didcomm_seed_file=seed_file, host="0.0.0.0", port=8123)
    warnings = [r.getMessage() for r in caplog.records if r.name == "relay.didcomm"]
    assert warnings == [
        "the DIDComm mediator advertises http://0.0.0.0:8123, which agents cannot reach: --host 0.0.0.0 "
        "listens on every address; set --public-url (RELAY_PUBLIC_URL) to the URL agents use"
    ]
    # exactly that text: the address and the flags, never the seed or a key
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="relay.didcomm"):
        await relay_factory(redis_server.url, didcomm_seed_file=seed_file, host="0.0.0.0", public_url=PUBLIC)
    assert not [r for r in caplog.records if r.name == "relay.didcomm"]
    assert relay.base_url  # the relay itself still serves (the test server binds 127.0.0.1)


def test_the_mediators_channel_is_beyond_the_http_apis_reach() -> None:
    """The mediator's key space holds only while no HTTP API channel can be this long."""
    from relay.api.params import MAX_CHANNEL_BYTES
    from relay.didcomm.records import QUEUE_CHANNEL, RECORD_CHANNEL
    from relay.storage.keys import MEDIATOR_CHANNEL

    assert QUEUE_CHANNEL == MEDIATOR_CHANNEL
    assert len(MEDIATOR_CHANNEL) > MAX_CHANNEL_BYTES
    assert RECORD_CHANNEL == b""  # records stay where they were: keylists survive the upgrade


async def test_records_expire_when_idle_and_free_their_keys(
    redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str, http: Any
) -> None:
    """After RELAY_DIDCOMM_IDLE_EXPIRY_S without activity a connection is unknown and its key
    free; the next write to the connection's slot removes its records (counted)."""
    from relay.fleet.sharding import slot_of
    from relay.storage import keys as K

    relay = await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC, didcomm_idle_expiry_s=1.0
    )
    first = Agent(relay.base_url, http)
    key = await mediated(first)
    slot = slot_of(first.kp.verkey, b"")
    await asyncio.sleep(1.2)
    status, body = await first.post(first.packed(msg("coordinate-mediation/1.0/keylist-query")))
    assert (status, json.loads(body)["code"]) == (403, "unknown_connection")
    status, body = await first.post(forward_envelope(routing_key(first), key, inner_message(key, "late")))
    assert (status, json.loads(body)["code"]) == (404, "unknown_recipient")
    r = redis.Redis.from_url(redis_server.url)
    assert r.hexists(K.slot_didcomm(slot), "c:" + dk.b64url(first.kp.verkey))  # unreachable, still there
    second = Agent(relay.base_url, http)
    while slot_of(second.kp.verkey, b"") != slot:  # a connection whose record shares the slot
        second.kp = dk.KeyPair.from_seed(os.urandom(32))
    second.did = dk.peer2_did(second.kp, ["didcomm:transport/queue"])
    await second.connect()
    assert not r.hexists(K.slot_didcomm(slot), "c:" + dk.b64url(first.kp.verkey))
    assert not r.hexists(K.slot_didcomm(slot), "r:" + dk.b64url(first.kp.verkey))
    other = Agent(relay.base_url, http)
    await other.connect()
    await other.mediate()
    assert (await other.register(key))["updated"][0]["result"] == "success"  # free again
    async with http.get(relay.base_url + "/metrics") as resp:
        text = await resp.text()
    assert any(
        line.startswith("relayfleet_didcomm_records_expired_total ") and float(line.split()[1]) >= 1
        for line in text.splitlines()
    )
