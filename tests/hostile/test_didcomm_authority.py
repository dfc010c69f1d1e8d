"""Who may reach a queue through the DIDComm mediator, tried as an
outsider would: raw HTTP for the signed API's side, envelopes packed with PyNaCl (the
mediator's own known-answer-tested packer) for the attacker's DIDComm connection, against
`relayfleet relay --auth ed25519` with the mediator on and a real redis-server."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis as redis_client
from nacl.signing import SigningKey

from relay.didcomm import keys as dk
from relay.didcomm.envelope import EnvelopeError, pack, parse, unpack
from relay.protocol import authorization, canonical
from relay.storage import keys as K
from tests.hostile.didcomm_attacker import didcomm_relay, stop_all
from tests.hostile.harness import Relay, report
from tests.support.didcomm_test_agent import Agent, attached, forward_envelope, inner_message, msg

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("didcomm-authority")]  # one relay per module


@pytest.fixture(scope="module")
def signed_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    relay = didcomm_relay(tmp_path_factory.mktemp("authority"), args=("--auth", "ed25519"))
    try:
        yield relay
    finally:
        stop_all(relay)
        relay.assert_log_clean()


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def held(relay: Relay, recipient: bytes, channel: bytes = b"") -> int:
    """Messages in the HTTP API's queue (recipient, channel), read from Redis itself."""
    r = redis_client.Redis.from_url(relay.redis.url)
    return int(r.xlen(K.queue_keys(recipient, channel).msgs))


async def test_a_connection_cannot_claim_a_queue_of_the_signed_api(signed_relay: Relay) -> None:
    victim = dk.KeyPair.from_seed(os.urandom(32))
    async with aiohttp.ClientSession() as http:
        # the victim's correspondents enqueue over the HTTP API: two DIDComm-shaped envelopes
        # (packed to the victim's key) and two plain payloads
        bodies = [pack(b'{"n": %d}' % i, [victim.verkey], None) for i in range(2)]
        bodies += [b"plain text one", b'{"not": "an envelope"}']
        for body in bodies:
            url = f"{signed_relay.url}/v1/queues/{b64(victim.verkey)}/messages"
            async with http.post(url, data=body) as resp:
                assert resp.status == 201, await resp.text()
        assert held(signed_relay, victim.verkey) == 4

        attacker = Agent(signed_relay.url, http)
        await attacker.connect()
        await attacker.mediate()
        # keylist-update 'add' of the victim's public key: a mediator key space of its own,
        # so this names no queue of the signed API (answered as for any free key)
        reply = await attacker.register(victim.verkey)
        assert reply["updated"][0]["result"] == "success"
        status = await attacker.send(msg("messagepickup/2.0/status-request"))
        assert status is not None
        assert status["message_count"] == 0
        delivery = await attacker.send(msg("messagepickup/2.0/delivery-request", limit=10))
        assert delivery is not None
        got = attached(delivery) if delivery["@type"].endswith("/delivery") else []
        ids = [a["@id"] for a in delivery.get("~attach", [])]
        # ids of the victim's queue forged in every shape Pickup uses
        ids += [f"{b64(victim.verkey)}.{seq}" for seq in range(1, 5)]
        after = await attacker.send(msg("messagepickup/2.0/messages-received", message_id_list=ids))
        assert after is not None
    left = held(signed_relay, victim.verkey)
    report("didcomm_claimed_queue", delivered_to_attacker=len(got), victim_before=4, victim_after=left)
    assert got == []
    assert left == 4


async def test_mediated_messages_live_where_the_http_api_cannot_name_them(signed_relay: Relay) -> None:
    """A forward stores in the mediator's key space: not in the key's HTTP API queue."""
    async with aiohttp.ClientSession() as http:
        agent = Agent(signed_relay.url, http)
        await agent.connect()
        await agent.mediate()
        key = dk.KeyPair.from_seed(os.urandom(32)).verkey
        assert (await agent.register(key))["updated"][0]["result"] == "success"
        routing = dk.verkey_from(agent.grant["routing_keys"][0])
        inner = inner_message(key, "mediated")
        assert (await agent.post(forward_envelope(routing, key, inner)))[0] == 202
        assert held(signed_relay, key) == 0  # nothing on the signed API's default channel
        assert held(signed_relay, key, K.MEDIATOR_CHANNEL) == 1
        delivery = await agent.send(msg("messagepickup/2.0/delivery-request", limit=10))
        assert delivery is not None
        assert attached(delivery) == [inner]
        # the HTTP API refuses a channel as long as the mediator's
        url = f"{signed_relay.url}/v1/queues/{b64(key)}/messages?channel={b64(K.MEDIATOR_CHANNEL)}"
        async with http.post(url, data=b"x") as resp:
            assert resp.status == 400
            assert (await resp.json())["code"] == "bad_channel"


def signed_headers(sk: SigningKey, method: str, path: str) -> dict[str, str]:
    """The contract's signature of a bodiless request, by hand (no client)."""
    ts, nonce = str(int(time.time())), b64(os.urandom(16))
    sig = sk.sign(canonical(method, path, ts, nonce, b"")).signature
    return {"Authorization": authorization(bytes(sk.verify_key), ts, nonce, sig)}


async def test_the_mediated_queue_of_a_key_is_one_of_its_channels_listed_and_marked(tmp_path: Path) -> None:
    """Forwards to a key registered at the mediator store in the mediator's queue of that key,
    which the per-recipient quotas count as one of the key's non-default channels (one of
    RELAY_RECIPIENT_MAX_CHANNELS, its messages and bytes in the key's totals): the owner's
    signed listing shows it marked "mediated", and the HTTP API cannot read it."""
    relay = didcomm_relay(tmp_path, {"RELAY_RECIPIENT_MAX_CHANNELS": "1"}, args=("--auth", "ed25519"))
    owner = SigningKey(os.urandom(32))
    key = bytes(owner.verify_key)
    path = f"/v1/queues/{b64(key)}/channels"
    try:
        async with aiohttp.ClientSession() as http:
            agent = Agent(relay.url, http)
            await agent.connect()
            await agent.mediate()
            assert (await agent.register(key))["updated"][0]["result"] == "success"
            routing = dk.verkey_from(agent.grant["routing_keys"][0])
            for i in range(3):
                inner = inner_message(key, f"mediated {i}")
                assert (await agent.post(forward_envelope(routing, key, inner)))[0] == 202
            mediated_bytes = int(
                redis_client.Redis.from_url(relay.redis.url).hget(
                    K.queue_keys(key, K.MEDIATOR_CHANNEL).meta, "bytes"
                )
                or 0
            )
            async with http.get(relay.url + path, headers=signed_headers(owner, "GET", path)) as resp:
                assert resp.status == 200
                listing = await resp.json()
            # the owner's own non-default channel: the cap of one is taken by the mediated queue
            async with http.post(
                f"{relay.url}/v1/queues/{b64(key)}/messages?channel=Y2hhdA", data=b"x"
            ) as resp:
                chat = (resp.status, (await resp.json())["code"])
            read = f"/v1/queues/{b64(key)}/messages?channel={b64(K.MEDIATOR_CHANNEL)}"
            async with http.get(relay.url + read, headers=signed_headers(owner, "GET", read)) as resp:
                unread = (resp.status, (await resp.json())["code"])
        report("didcomm_mediated_channel", listed=len(listing["channels"]), mediated_messages=3, chat=chat[0])
        assert listing == {
            "channels": [
                {"channel": "", "message_count": 0, "total_bytes": 0, "mediated": False},
                {
                    "channel": b64(K.MEDIATOR_CHANNEL),
                    "message_count": 3,
                    "total_bytes": mediated_bytes,
                    "mediated": True,
                },
            ],
            "message_count": 3,
            "total_bytes": mediated_bytes,
        }
        assert chat == (507, "too_many_channels")
        assert unread == (400, "bad_channel")
        relay.assert_log_clean()
    finally:
        stop_all(relay)


def relay_with(tmp_path: Path, **env: str) -> Relay:
    return didcomm_relay(tmp_path, {k.upper(): v for k, v in env.items()})


async def test_a_squatted_key_is_held_until_expiry_and_forwards_stay_encrypted(tmp_path: Path) -> None:
    """First come, first served, within bounds: a squatter's registration of someone's
    recipient key refuses the owner's (client_error) while it lives, holds forwards the squatter
    cannot read (encrypted to the key), and expires with the squatter's idle connection."""
    relay = relay_with(tmp_path, relay_didcomm_idle_expiry_s="3")
    owner_key = dk.KeyPair.from_seed(os.urandom(32))
    try:
        async with aiohttp.ClientSession() as http:
            squatter, owner = Agent(relay.url, http), Agent(relay.url, http)
            for a in (squatter, owner):
                await a.connect()
                await a.mediate()
            assert (await squatter.register(owner_key.verkey))["updated"][0]["result"] == "success"
            refused = await owner.register(owner_key.verkey)
            assert refused["updated"][0]["result"] == "client_error"  # whose it is, not said
            routing = dk.verkey_from(squatter.grant["routing_keys"][0])
            secret = inner_message(owner_key.verkey, "for the owner only")
            assert (await squatter.post(forward_envelope(routing, owner_key.verkey, secret)))[0] == 202
            delivery = await squatter.send(msg("messagepickup/2.0/delivery-request", limit=10))
            assert delivery is not None
            (got,) = attached(delivery)
            assert got == secret
            with pytest.raises(EnvelopeError):  # the squatter holds only its own key
                unpack(parse(json.dumps(got).encode()), squatter.lookup)
            opened = unpack(
                parse(json.dumps(got).encode()), lambda k: owner_key if k == owner_key.verkey else None
            )
            assert b"for the owner only" in opened.message
            # a key that is the connection's own authcrypt key is proven: it takes a squat over
            assert (await squatter.register(owner.kp.verkey))["updated"][0]["result"] == "success"
            assert (await owner.register(owner.kp.verkey))["updated"][0]["result"] == "success"
            # the owner stays active, the squatter goes idle past the expiry (3 s)
            for _ in range(4):
                await asyncio.sleep(1)
                assert await owner.send(msg("trust_ping/1.0/ping")) is not None
            taken = await owner.register(owner_key.verkey)
            status, body = await squatter.post(squatter.packed(msg("coordinate-mediation/1.0/keylist-query")))
        report(
            "didcomm_squat",
            owner_during_squat=refused["updated"][0]["result"],
            squatter_reads_plaintext=False,
            owner_after_expiry=taken["updated"][0]["result"],
        )
        assert taken["updated"][0]["result"] == "success"
        assert status == 403
        assert json.loads(body)["code"] == "unknown_connection"  # the squatter's connection expired
    finally:
        stop_all(relay)


# Idle expiry in the records test: well above the 5,000 registrations' time (5.3 s under a
# loaded parallel suite, when 4 s let the first connection's records expire before the count)
RECORDS_IDLE_S = 15


async def test_keys_and_connections_are_capped_and_records_expire(tmp_path: Path) -> None:
    """5,000 keys over 5 connections: 100 a connection registered, the rest refused; a sixth
    connection from the same client in the hour refused 429; everything expires when idle, and
    the periodic sweep (every second here) removes it from Redis with no write to its slots."""
    relay = relay_with(
        tmp_path,
        relay_didcomm_idle_expiry_s=str(RECORDS_IDLE_S),
        relay_didcomm_max_connections_per_client="5",
        relay_didcomm_sweep_interval_s="1",
    )
    try:
        async with aiohttp.ClientSession() as http:
            agents = [Agent(relay.url, http) for _ in range(6)]
            results: list[str] = []
            started = time.perf_counter()
            for a in agents[:5]:
                await a.connect()
                await a.mediate()
                keys = [dk.KeyPair.from_seed(os.urandom(32)).verkey for _ in range(1000)]
                reply = await a.register(*keys)
                results += [u["result"] for u in reply["updated"]]
            elapsed = time.perf_counter() - started
            # the count below is only meaningful while the first connection's records still live
            assert elapsed < RECORDS_IDLE_S - 2, f"registering took {elapsed:.1f} s"
            with pytest.raises(AssertionError):
                await agents[5].connect()
            status, body, headers = await exchange_answer(http, relay, agents[5])
            r = redis_client.Redis.from_url(relay.redis.url)
            fields_before, idle_before = record_fields(r)
            expires = time.monotonic() + RECORDS_IDLE_S
            await asyncio.sleep(RECORDS_IDLE_S + 0.5)
            # expired: every connection unknown, every key unregistered (a forward finds no one)
            codes = []
            for a in agents[:5]:
                st, b = await a.post(a.packed(msg("coordinate-mediation/1.0/keylist-query")))
                codes.append((st, json.loads(b)["code"]))
            routing = dk.verkey_from(agents[0].grant["routing_keys"][0])
            fwd = forward_envelope(routing, keys[0], inner_message(keys[0], "late"))
            forward_status = (await agents[0].post(fwd))[0]
            # gone from Redis within two sweep intervals of the expiry (docs/protocols.md, "Limits")
            for _ in range(int((expires + 2.5 - time.monotonic()) / 0.1)):
                if record_fields(r) == (0, 0):
                    break
                await asyncio.sleep(0.1)
            fields_after, idle_after = record_fields(r)
            removed_after_s = round(time.monotonic() - expires, 1)
        report(
            "didcomm_records",
            keys_asked=len(results),
            registered=results.count("success"),
            refused=results.count("server_error"),
            seconds=round(elapsed, 2),
            sixth_connection=status,
            record_fields_before_expiry=fields_before,
            record_fields_after_expiry=fields_after,
            idle_members_before_expiry=idle_before,
            idle_members_after_expiry=idle_after,
            removed_seconds_after_expiry=removed_after_s,
        )
        assert fields_before == 510  # 500 registrations, 5 connections, their 5 keylists
        assert idle_before == 505  # a registration or a connection each
        assert (fields_after, idle_after) == (0, 0)
        assert results.count("success") == 500
        assert results.count("server_error") == 4500
        assert status == 429
        assert json.loads(body)["code"] == "too_many_connections"
        assert int(headers["Retry-After"]) >= 1
        assert codes == [(403, "unknown_connection")] * 5
        assert forward_status == 404
    finally:
        stop_all(relay)


def record_fields(r: redis_client.Redis) -> tuple[int, int]:
    """Fields of every slot's DIDComm records hash and members of every idle-expiry zset."""
    fields = sum(r.hlen(k) for k in r.scan_iter("rf:{*}:didcomm"))
    members = sum(r.zcard(k) for k in r.scan_iter("rf:{*}:didcomm-idle"))
    return fields, members


async def exchange_answer(
    http: aiohttp.ClientSession, relay: Relay, agent: Agent
) -> tuple[int, bytes, dict[str, str]]:
    """The raw answer to a DID Exchange request from `agent` (a fresh connection)."""
    async with http.get(relay.url + "/v1/didcomm/invitation") as r:
        inv = (await r.json())["invitation"]
    key = dk.verkey_from(inv["services"][0]["recipientKeys"][0])
    request = {
        "@type": "https://didcomm.org/didexchange/1.1/request",
        "@id": str(uuid.uuid4()),
        "~thread": {"pthid": inv["@id"]},
        "label": "sixth",
        "did": agent.did,
    }
    body = agent.packed(request, to=key)
    headers = {"Content-Type": "application/didcomm-envelope-enc"}
    async with http.post(relay.url + "/v1/didcomm", data=body, headers=headers) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


async def test_forwards_need_the_enqueue_token_when_tokens_are_on(tmp_path: Path) -> None:
    relay = relay_with(tmp_path, relay_enqueue_tokens="tok-1")
    try:
        async with aiohttp.ClientSession() as http:
            agent = Agent(relay.url, http)
            await agent.connect()  # the handshake and mediation need no token
            await agent.mediate()
            key = dk.KeyPair.from_seed(os.urandom(32)).verkey
            assert (await agent.register(key))["updated"][0]["result"] == "success"
            routing = dk.verkey_from(agent.grant["routing_keys"][0])
            wire = {"Content-Type": "application/didcomm-envelope-enc"}
            answers = {}
            for name, extra in (("none", {}), ("wrong", {"Authorization": "Bearer nope"})):
                fwd = forward_envelope(routing, key, inner_message(key, name))
                async with http.post(relay.url + "/v1/didcomm", data=fwd, headers={**wire, **extra}) as resp:
                    answers[name] = (resp.status, await resp.json(), resp.headers.get("WWW-Authenticate"))
            fwd = forward_envelope(routing, key, inner_message(key, "with token"))
            good = {**wire, "Authorization": "Bearer tok-1"}
            async with http.post(relay.url + "/v1/didcomm", data=fwd, headers=good) as resp:
                answers["token"] = (resp.status, {}, None)
            ws_url = relay.url.replace("http://", "ws://") + "/v1/didcomm/ws"
            async with http.ws_connect(ws_url) as ws:  # an upgrade without the token
                await ws.send_bytes(forward_envelope(routing, key, inner_message(key, "ws, none")))
                ws_plain = await ws.receive_json(timeout=5)
            async with http.ws_connect(ws_url, headers={"Authorization": "Bearer tok-1"}) as ws:
                await ws.send_bytes(forward_envelope(routing, key, inner_message(key, "ws, token")))
                ping = {**msg("trust_ping/1.0/ping"), "~transport": {"return_route": "all"}}
                await ws.send_bytes(agent.packed(ping))
                await ws.receive_bytes(timeout=5)  # the ping's answer: the forward went first
            status = await agent.send(msg("messagepickup/2.0/status-request"))  # no token needed
        report("didcomm_forward_token", **{k: v[0] for k, v in answers.items()}, ws_without=ws_plain["code"])
        for name in ("none", "wrong"):
            st, doc, scheme = answers[name]
            assert (st, doc["code"], scheme) == (401, "unauthorized", "Bearer")
            assert doc["error"] == "a forward requires a valid bearer token"
        assert answers["token"][0] == 202
        assert ws_plain == {"error": "a forward requires a valid bearer token", "code": "unauthorized"}
        assert status is not None
        assert status["message_count"] == 2  # the two with the token
    finally:
        stop_all(relay)
