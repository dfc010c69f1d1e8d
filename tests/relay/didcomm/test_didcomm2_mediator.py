"""The DIDComm v2 mediator end to end over real sockets and a real redis-server, with the v2 test
agent of tests/support/didcomm2_test_agent.py (joserfc, the mediator's own library): the
out-of-band 2.0 invitation → Coordinate Mediation 2.0 / 3.0 → Routing 2.0 forwards → Pickup 3.0
over HTTP (return_route "all") and live over the WebSocket; authority, bounds and the v1
mediator beside it on the same front door."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import redis
from relayfleet_testing.localredis import LocalRedis

from relay.didcomm import jwm, peer2
from relay.didcomm import keys as dk
from tests.support.didcomm2_test_agent import Agent2, attached, forward, inner, new_recipient
from tests.support.in_process_relay import RelayFactory, RunningRelay
from tests.support.waiting import until

PUBLIC = "https://relay.example.test"
REDELIVER_S = 3.0  # the delivery lease: long enough for a loaded machine's next two requests
BASE = "https://didcomm.org/"


@pytest.fixture
async def relay(redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str) -> RunningRelay:
    return await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC, didcomm_redeliver_s=REDELIVER_S
    )


@pytest.fixture
def agent(relay: RunningRelay, http: aiohttp.ClientSession) -> Agent2:
    return Agent2(relay.base_url, http)


async def mediated(agent: Agent2, family: str = "coordinate-mediation/2.0") -> tuple[str, jwm.AgreementKey]:
    await agent.mediate(family)
    did, key = new_recipient()
    reply = await agent.register(did, family=family)
    assert reply["body"]["updated"][0]["result"] == "success"
    return did, key


def opened_by(key: jwm.AgreementKey, packed: Any) -> dict[str, Any]:
    """What the recipient reads out of a delivered message."""
    return jwm.unpack(json.dumps(packed).encode(), lambda kid: key).message


async def test_invitation_is_oob_2_0_from_a_peer_did_with_http_first_then_websocket(
    relay: RunningRelay, http: Any
) -> None:
    async with http.get(relay.base_url + "/v1/didcomm/v2/invitation") as r:
        assert r.status == 200
        body = await r.json()
    inv = body["invitation"]
    assert inv["type"] == BASE + "out-of-band/2.0/invitation"
    assert inv["body"]["goal_code"] == "request-mediate"
    did = inv["from"]
    assert did == body["did"]
    assert did.startswith("did:peer:2.Ez6LS")
    assert ".Vz6Mk" in did
    resolved = peer2.resolve(did)
    assert [s.uri for s in resolved.services] == [
        PUBLIC + "/v1/didcomm",
        "wss://relay.example.test/v1/didcomm/ws",
    ]
    assert all(s.accept == ("didcomm/v2",) for s in resolved.services)
    # the current service encoding, unpadded base64url
    service = json.loads(dk.b64decode_any(did.split(".S")[1]))
    assert service == {"t": "dm", "s": {"uri": PUBLIC + "/v1/didcomm", "a": ["didcomm/v2"], "r": []}}
    assert "=" not in did
    url = body["invitation_url"]
    assert url.startswith(PUBLIC + "/v1/didcomm?_oob=")
    assert json.loads(dk.b64decode_any(url.split("_oob=", 1)[1])) == inv
    # the same seed and URL: the same DID on every relay (and across restarts)
    async with http.get(relay.base_url + "/v1/didcomm/v2/invitation") as r:
        assert (await r.json())["did"] == did


async def test_whole_flow_over_http_mediate_register_forward_pickup_ack(agent: Agent2) -> None:
    did, key = await mediated(agent)
    assert agent.grant["body"] == {"routing_did": agent.mediator_did}  # ONE string (Identus)
    assert agent.grant["from"] == agent.mediator_did
    keylist = await agent.send(agent.message("coordinate-mediation/2.0/keylist-query"))
    assert keylist is not None
    assert keylist["body"]["keys"] == [{"recipient_did": did}]

    sent = [inner(did, f"hello {i}") for i in range(3)]
    for i, packed in enumerate(sent):  # anonymous senders; json and base64 attachments
        status, body = await agent.post(forward(agent.mediator_did, did, packed, base64=i == 1))
        assert (status, body) == (202, b"")

    status_doc = await agent.send(agent.message("messagepickup/3.0/status-request"))
    assert status_doc is not None
    assert status_doc["type"] == BASE + "messagepickup/3.0/status"
    assert status_doc["body"]["message_count"] == 3
    assert status_doc["body"]["live_delivery"] is False
    delivery = await agent.send(agent.message("messagepickup/3.0/delivery-request", limit=10))
    assert delivery is not None
    assert delivery["type"] == BASE + "messagepickup/3.0/delivery"
    got = attached(delivery)
    assert got == sent  # in order, the packed messages as forwarded
    assert [opened_by(key, g)["body"]["content"] for g in got] == ["hello 0", "hello 1", "hello 2"]
    # handed out, not acknowledged: leased, not offered to the next poll, not deleted
    again = await agent.send(agent.message("messagepickup/3.0/delivery-request", limit=10))
    assert again is not None
    assert again["type"] == BASE + "messagepickup/3.0/status"
    assert again["body"]["message_count"] == 0
    ids = [a["id"] for a in delivery["attachments"][:2]]
    after = await agent.send(agent.message("messagepickup/3.0/messages-received", message_id_list=ids))
    assert after is not None
    assert after["body"]["message_count"] == 0  # the third is still leased
    # the lease runs out: the unacknowledged one goes out again
    redelivered: list[Any] = []

    async def third_again() -> bool:
        last = await agent.send(agent.message("messagepickup/3.0/delivery-request", limit=10))
        assert last is not None
        redelivered[:] = attached(last) if "attachments" in last else []
        return bool(redelivered)

    await until("the lease to run out", third_again, timeout=REDELIVER_S + 10, interval=0.3)
    assert redelivered == [sent[2]]


async def test_coordinate_mediation_3_0_names(agent: Agent2) -> None:
    family = "coordinate-mediation/3.0"
    did, _ = await mediated(agent, family)
    assert agent.grant["body"]["routing_did"] == [agent.mediator_did]  # 3.0: a list (Veramo)
    listed = await agent.send(agent.message(family + "/recipient-query"))
    assert listed is not None
    assert listed["type"] == BASE + family + "/recipient"
    assert listed["body"]["dids"] == [{"recipient_did": did}]
    removed = await agent.register(did, action="remove", family=family)
    assert removed["type"] == BASE + family + "/recipient-update-response"
    assert removed["body"]["updated"] == [{"recipient_did": did, "action": "remove", "result": "success"}]
    listed = await agent.send(agent.message(family + "/recipient-query"))
    assert listed is not None
    assert listed["body"]["dids"] == []


async def test_legacy_service_encoding_signed_messages_and_did_key_senders(
    relay: RunningRelay, http: Any
) -> None:
    """A peer DID in the older service encoding mediates; a JWS-signed (not encrypted) request
    proves its sender too; a recipient named by a DID URL (next with a fragment) is its DID."""
    old = Agent2(relay.base_url, http, legacy_service=True)
    did, key = await mediated(old)
    signer = Agent2(relay.base_url, http)
    await signer.invitation()
    status, raw = await signer.post(
        signer.signed(signer.message("coordinate-mediation/2.0/mediate-request")), jwm.SIGNED
    )
    assert status == 200, raw
    grant = signer.open(raw).message
    assert grant["type"].endswith("/mediate-grant")
    packed = inner(did, "to a key id")
    assert (await old.post(forward(old.mediator_did, did + "#key-1", packed)))[0] == 202
    delivery = await old.send(old.message("messagepickup/3.0/delivery-request", limit=5))
    assert delivery is not None
    assert opened_by(key, attached(delivery)[0])["body"]["content"] == "to a key id"


async def test_the_stock_clients_shapes_identus_and_veramo(relay: RunningRelay, http: Any) -> None:
    """What the stock clients send (docs/protocols.md, "DIDComm v2 mediator"): Identus' host DID
    with an empty service array (`.SW10`) and services as one array; Veramo's authcrypt with
    A256GCM and the ECDH-1PU KDF without the content tag, no apu/apv, a 3.0 mediate-request
    without return_route (answered anyway, routing_did a list); replies in the sender's variant."""
    identus = Agent2(relay.base_url, http, did="did:peer:2.E{x}.V{v}.SW10")
    did, key = await mediated(identus)
    assert identus.grant["body"]["routing_did"] == identus.mediator_did
    arrayed = Agent2(
        relay.base_url,
        http,
        did="did:peer:2.E{x}.V{v}.S"
        + dk.b64url(json.dumps([{"t": "dm", "s": {"uri": "https://a.test"}}]).encode()),
    )
    await mediated(arrayed)
    assert [s.uri for s in peer2.resolve(arrayed.did).services] == ["https://a.test"]
    veramo = Agent2(relay.base_url, http, enc="A256GCM", tagged=False, did="did:peer:2.E{x}.V{v}")
    await veramo.invitation()
    request = veramo.message("coordinate-mediation/3.0/mediate-request", return_route=False)
    grant = await veramo.send(request)
    assert grant is not None
    assert grant["body"]["routing_did"] == [veramo.mediator_did]
    assert grant["thid"] == request["id"]
    packed = json.loads(veramo.packed(veramo.message("trust-ping/2.0/ping")))
    assert {"apu", "apv"} & set(json.loads(dk.b64decode_any(packed["protected"]))) == set()
    vdid, vkey = new_recipient()
    assert (await veramo.register(vdid, family="coordinate-mediation/3.0"))["body"]["updated"][0][
        "result"
    ] == "success"
    for agent, to, k in ((identus, did, key), (veramo, vdid, vkey)):
        assert (await agent.post(forward(agent.mediator_did, to, inner(to, "hi"))))[0] == 202
        delivery = await agent.send(agent.message("messagepickup/3.0/delivery-request", limit=5))
        assert delivery is not None
        attachment = delivery["attachments"][0]
        assert isinstance(attachment["lastmod_time"], int)  # epoch seconds (didcomm-rust)
        assert opened_by(k, attachment["data"]["json"])["body"]["content"] == "hi"


async def test_forwards_are_charged_to_the_senders_client_quota(
    redis_server: LocalRedis, relay_factory: RelayFactory, seed_file: str, http: Any
) -> None:
    """A forward stores a message: it counts against the sending client's quota as an enqueue
    does (RELAY_CLIENT_RATE_MESSAGES), v1 and v2 alike; the recipient's own limits apply in the
    enqueue itself."""
    relay = await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url=PUBLIC, client_rate_messages=2
    )
    agent = Agent2(relay.base_url, http)
    did, _ = await mediated(agent)
    answers = []
    for i in range(3):
        status, raw = await agent.post(forward(agent.mediator_did, did, inner(did, str(i))))
        answers.append((status, json.loads(raw)["code"] if raw else ""))
    assert answers == [(202, ""), (202, ""), (429, "client_rate_limited")]
    st = await agent.send(agent.message("messagepickup/3.0/status-request"))
    assert st is not None
    assert st["body"]["message_count"] == 2  # pickup and mediation are not charged


async def test_authority_only_a_dids_holder_registers_and_picks_up_for_it(
    relay: RunningRelay, http: Any
) -> None:
    alice, mallory = Agent2(relay.base_url, http), Agent2(relay.base_url, http)
    did, _ = await mediated(alice)
    await mallory.mediate()
    # another connection's live registration is not taken
    taken = await mallory.register(did)
    assert taken["body"]["updated"][0]["result"] == "client_error"
    # pickup names only the connection's own DIDs
    status, raw = await mallory.post(
        mallory.packed(mallory.message("messagepickup/3.0/status-request", recipient_did=did))
    )
    assert status == 400
    assert json.loads(raw)["code"] == "bad_recipient"
    assert (await alice.post(forward(alice.mediator_did, did, inner(did, "x"))))[0] == 202
    got = await mallory.send(mallory.message("messagepickup/3.0/delivery-request", limit=10))
    assert got is not None
    assert got["type"].endswith("/status")
    # not proven (anoncrypt): no mediation, no pickup
    status, raw = await mallory.post(
        mallory.packed(mallory.message("coordinate-mediation/2.0/mediate-request"), False)
    )
    assert status == 403
    assert json.loads(raw)["code"] == "unknown_connection"
    # a message whose from is not the key's DID
    forged = mallory.message("messagepickup/3.0/delivery-request", limit=10)
    forged["from"] = alice.did
    status, raw = await mallory.post(mallory.packed(forged))
    assert status == 400
    assert json.loads(raw)["code"] == "sender_mismatch"
    # a tampered signature
    signed = json.loads(mallory.signed(mallory.message("coordinate-mediation/2.0/keylist-query")))
    signed["payload"] = dk.b64url(
        json.dumps(alice.message("coordinate-mediation/2.0/keylist-query")).encode()
    )
    status, raw = await mallory.post(json.dumps(signed).encode(), jwm.SIGNED)
    assert status == 400
    assert json.loads(raw)["code"] in ("bad_envelope", "sender_mismatch")
    # a DID registers itself over an unproven holder: its own DID is proven
    squatter = Agent2(relay.base_url, http)
    await squatter.mediate()
    assert (await squatter.register(alice.did))["body"]["updated"][0]["result"] == "success"
    own = await alice.register(alice.did)
    assert own["body"]["updated"][0]["result"] == "success"


async def test_mediation_is_needed_before_keylists_and_pickup(agent: Agent2) -> None:
    await agent.invitation()
    status, raw = await agent.post(agent.packed(agent.message("messagepickup/3.0/status-request")))
    assert status == 400
    assert json.loads(raw)["code"] == "mediation_not_granted"


async def test_live_mode_on_the_websocket_pushes_text_frames_and_waits_for_the_ack(
    agent: Agent2, relay: RunningRelay, http: Any
) -> None:
    did, key = await mediated(agent)
    # over HTTP live mode is refused with a problem-report
    refused = await agent.send(agent.message("messagepickup/3.0/live-delivery-change", live_delivery=True))
    assert refused is not None
    assert refused["type"] == BASE + "report-problem/2.0/problem-report"
    assert refused["body"]["code"] == "e.m.live-mode-not-supported"
    async with http.ws_connect(relay.base_url + "/v1/didcomm/ws") as ws:
        change = agent.message("messagepickup/3.0/live-delivery-change", live_delivery=True)
        await ws.send_str(agent.packed(change).decode())
        status = agent.open((await ws.receive_str(timeout=5)).encode()).message
        assert status["body"]["live_delivery"] is True
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        packed = inner(did, "live")
        assert (await agent.post(forward(agent.mediator_did, did, packed)))[0] == 202
        frame = await ws.receive(timeout=5)
        assert frame.type == aiohttp.WSMsgType.TEXT  # Identus reads text frames
        delivery = agent.open(frame.data.encode()).message
        assert loop.time() - sent_at < 1.0
        assert delivery["type"] == BASE + "messagepickup/3.0/delivery"
        assert attached(delivery) == [packed]
        assert opened_by(key, packed)["body"]["content"] == "live"
        # held until acknowledged; the ack may come over HTTP (Identus does so)
        st = await agent.send(agent.message("messagepickup/3.0/status-request"))
        assert st is not None
        assert st["body"]["message_count"] == 1
        ids = [delivery["attachments"][0]["id"]]
        after = await agent.send(agent.message("messagepickup/3.0/messages-received", message_id_list=ids))
        assert after is not None
        assert after["body"]["message_count"] == 0
        # one more arrives: pushed too
        assert (await agent.post(forward(agent.mediator_did, did, inner(did, "two"))))[0] == 202
        second = agent.open((await ws.receive_str(timeout=5)).encode()).message
        assert opened_by(key, attached(second)[0])["body"]["content"] == "two"


async def test_live_window_frees_when_deliveries_are_acknowledged_over_http(
    agent: Agent2, relay: RunningRelay, http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Identus acknowledges live deliveries over HTTP, never on the socket: the socket's window
    of unacknowledged deliveries must still empty, or live delivery stops once it is full."""
    from relay.api import didcomm as api

    monkeypatch.setattr(api, "LIVE_WINDOW", 2)
    did, key = await mediated(agent)
    async with http.ws_connect(relay.base_url + "/v1/didcomm/ws") as ws:
        change = agent.message("messagepickup/3.0/live-delivery-change", live_delivery=True)
        await ws.send_str(agent.packed(change).decode())
        agent.open((await ws.receive_str(timeout=5)).encode())
        for round_ in range(3):  # three windows' worth, each acknowledged over HTTP
            got: list[Any] = []
            for i in range(2):
                assert (await agent.post(forward(agent.mediator_did, did, inner(did, f"{round_}.{i}"))))[
                    0
                ] == 202
            while len(got) < 2:
                delivery = agent.open((await ws.receive_str(timeout=5)).encode()).message
                got += delivery["attachments"]
            contents = [opened_by(key, a["data"]["json"])["body"]["content"] for a in got]
            assert contents == [f"{round_}.0", f"{round_}.1"]
            ids = [a["id"] for a in got]
            ack = await agent.send(agent.message("messagepickup/3.0/messages-received", message_id_list=ids))
            assert ack is not None


async def test_trust_ping_and_discover_features(agent: Agent2) -> None:
    await agent.invitation()
    pong = await agent.send(agent.message("trust-ping/2.0/ping", response_requested=True))
    assert pong is not None
    assert pong["type"] == BASE + "trust-ping/2.0/ping-response"
    found = await agent.send(
        agent.message(
            "discover-features/2.0/queries",
            queries=[{"feature-type": "protocol", "match": "https://didcomm.org/messagepickup/*"}],
        )
    )
    assert found is not None
    assert found["body"]["disclosures"] == [
        {"feature-type": "protocol", "id": "https://didcomm.org/messagepickup/3.0"}
    ]


async def test_forward_with_the_same_id_is_stored_once_and_only_jwes_are_stored(agent: Agent2) -> None:
    did, _ = await mediated(agent)
    packed = inner(did, "once")
    for _ in range(2):
        assert (await agent.post(forward(agent.mediator_did, did, packed, fid="fwd-1")))[0] == 202
    status, raw = await agent.post(forward(agent.mediator_did, did, {"not": "a jwe"}))
    assert status == 400
    assert json.loads(raw)["code"] == "bad_forward"
    stranger, _ = new_recipient()
    status, raw = await agent.post(forward(agent.mediator_did, stranger, inner(stranger, "x")))
    assert status == 404
    assert json.loads(raw)["code"] == "unknown_recipient"
    st = await agent.send(agent.message("messagepickup/3.0/status-request"))
    assert st is not None
    assert st["body"]["message_count"] == 1


async def test_hostile_v2_input_is_bounded_4xx_json_and_stores_nothing(
    agent: Agent2, relay: RunningRelay, redis_server: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    await agent.invitation()
    before = set(r.keys("rf:{*"))
    bomb = b'{"recipients":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    good = json.loads(agent.packed(agent.message("trust-ping/2.0/ping")))
    tampered = {**good, "ciphertext": "A" + good["ciphertext"][1:]}
    wrong_alg = {**good, "protected": dk.b64url(json.dumps({"alg": "RSA1_5", "enc": "A256GCM"}).encode())}
    other, _ = new_recipient()
    for_other = jwm.pack({"id": "1", "type": "x"}, peer2.resolve(other).agreement[0], None)
    plain = json.dumps({"id": "1", "type": BASE + "trust-ping/2.0/ping"}).encode()
    cases: list[tuple[bytes, str, int, str, str]] = [
        (b"not json", jwm.ENCRYPTED, 400, "bad_envelope", "not valid JSON"),
        (bomb, jwm.ENCRYPTED, 400, "json_too_deep", "nests deeper"),
        (json.dumps(tampered).encode(), jwm.ENCRYPTED, 400, "bad_envelope", "does not decrypt"),
        (json.dumps(wrong_alg).encode(), jwm.ENCRYPTED, 400, "bad_envelope", "alg must be"),
        (for_other, jwm.ENCRYPTED, 400, "bad_envelope", "not encrypted for this mediator"),
        (plain, jwm.PLAIN, 403, "unknown_connection", "authcrypted or signed"),
        (b"x" * (8 << 20), jwm.ENCRYPTED, 413, "payload_too_large", "exceeds"),
    ]
    with caplog.at_level("DEBUG"):
        for body, kind, status, code, text in cases:
            got_status, got = await agent.post(body, kind)
            answer = json.loads(got)
            assert (got_status, answer["code"]) == (status, code), got[:200]
            assert text in answer["error"]
    async with agent.http.post(
        relay.base_url + "/v1/didcomm", data=b"{}", headers={"Content-Type": "text/plain"}
    ) as resp:
        assert resp.status == 415
        assert (await resp.json())["code"] == "unsupported_media_type"
    assert set(r.keys("rf:{*")) == before  # nothing written
    for line in caplog.messages:  # no DID or key in a log line
        assert agent.did not in line
        assert agent.mediator_did not in line


async def test_a_body_that_is_not_an_object_is_400_for_every_type(agent: Agent2) -> None:
    from relay.didcomm.mediator2 import HANDLED_TYPES

    await agent.mediate()
    for name in sorted(HANDLED_TYPES - {"routing/2.0/forward", "report-problem/2.0/problem-report"}):
        doc = agent.message(name)
        doc["body"] = [1]
        status, raw = await agent.post(agent.packed(doc))
        assert (status, json.loads(raw)["code"]) == (400, "bad_didcomm_message"), name
    # a skid-less authcrypt whose apu is not base64url
    good = json.loads(agent.packed(agent.message("trust-ping/2.0/ping")))
    header = json.loads(dk.b64decode_any(good["protected"]))
    del header["skid"]
    header["apu"] = "!!"
    good["protected"] = dk.b64url(json.dumps(header).encode())
    status, raw = await agent.post(json.dumps(good).encode())
    assert (status, json.loads(raw)["code"]) == (400, "bad_envelope")


async def test_v1_and_v2_share_the_front_door_and_metrics(
    agent: Agent2, relay: RunningRelay, http: Any
) -> None:
    from tests.support.didcomm_test_agent import Agent, msg

    v1 = Agent(relay.base_url, http)
    await v1.connect()
    assert (await v1.mediate())["@type"].endswith("coordinate-mediation/1.0/mediate-grant")
    # a v2 message sent as plain application/json is told apart by its shape
    await agent.invitation()
    status, raw = await agent.post(agent.packed(agent.message("trust-ping/2.0/ping")), "application/json")
    assert status == 200
    assert agent.open(raw).message["type"].endswith("ping-response")
    assert await v1.send(msg("trust_ping/1.0/ping")) is not None
    async with http.get(relay.base_url + "/metrics") as r:
        text = await r.text()
    assert 'relayfleet_didcomm_messages_total{result="ok",type="trust-ping/2.0/ping"}' in text
    assert 'relayfleet_didcomm_messages_total{result="ok",type="trust_ping/1.0/ping"}' in text
