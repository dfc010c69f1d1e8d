"""Who may reach a queue through the DIDComm mediator, tried as an
outsider would: raw HTTP for the signed API's side, envelopes packed with PyNaCl (the
mediator's own known-answer-tested packer) for the attacker's DIDComm connection, against
`relayfleet relay --auth ed25519` with the mediator on and a real redis-server."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator

import aiohttp
import pytest
import redis as redis_client

from relay.didcomm import keys as dk
from relay.didcomm.envelope import pack
from relay.storage import keys as K
from tests.hostile.didcomm_attacker import didcomm_relay, stop_all
from tests.hostile.harness import Relay, report
from tests.support.didcomm_test_agent import Agent, attached, forward_envelope, inner_message, msg

pytestmark = pytest.mark.timeout(120)


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
