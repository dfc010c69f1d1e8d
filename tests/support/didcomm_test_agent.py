"""A small DIDComm v1 agent for the tests: its own keys and did:peer:2, packs with PyNaCl
(through relay.didcomm.envelope, whose output the known-answer tests pin to Credo's), and
speaks to the relay over HTTP or its WebSocket. The e2e with stock Credo-ts and ACA-Py is
tests/relay/didcomm/test_didcomm_agents.py; this one makes every protocol step observable."""

from __future__ import annotations

import copy
import json
import os
import uuid
from typing import Any, Self

import aiohttp

from relay.didcomm import keys as dk
from relay.didcomm.envelope import pack, parse, unpack

WIRE = "application/didcomm-envelope-enc"


class OnAnyRelay:
    """A test agent that may talk to another relay of the fleet as itself."""

    base: str

    def on(self, base_url: str) -> Self:
        """The same agent (keys, DID, mediator, grant, HTTP session) talking to `base_url`."""
        other = copy.copy(self)
        other.base = base_url
        return other


class Agent(OnAnyRelay):
    def __init__(self, base_url: str, http: aiohttp.ClientSession) -> None:
        self.base = base_url
        self.http = http
        self.kp = dk.KeyPair.from_seed(os.urandom(32))
        self.did = dk.peer2_did(self.kp, ["didcomm:transport/queue"])
        self.mediator_key: bytes | None = None  # the key of the mediator's DID, after DID Exchange
        self.invitation: dict[str, Any] = {}
        self.grant: dict[str, Any] = {}

    def lookup(self, verkey: bytes) -> dk.KeyPair | None:
        return self.kp if verkey == self.kp.verkey else None

    def open(self, raw: bytes) -> tuple[dict[str, Any], bytes | None]:
        opened = unpack(parse(raw), self.lookup)
        return json.loads(opened.message), opened.sender

    def packed(self, doc: dict[str, Any], to: bytes | None = None, nonce_bytes: int = 12) -> bytes:
        target = to or self.mediator_key
        assert target is not None
        return pack(json.dumps(doc).encode(), [target], self.kp, nonce_bytes)

    async def post(self, body: bytes) -> tuple[int, bytes]:
        async with self.http.post(self.base + "/v1/didcomm", data=body, headers={"Content-Type": WIRE}) as r:
            return r.status, await r.read()

    async def send(self, doc: dict[str, Any], return_route: bool = True, **kw: Any) -> dict[str, Any] | None:
        if return_route:
            doc = {**doc, "~transport": {"return_route": "all"}}
        status, body = await self.post(self.packed(doc, **kw))
        if status == 202:
            return None
        assert status == 200, (status, body[:300])
        reply, sender = self.open(body)
        assert sender == self.mediator_key
        return reply

    async def connect(self) -> dict[str, Any]:
        """Out-of-band invitation → DID Exchange 1.1 request → response → complete."""
        async with self.http.get(self.base + "/v1/didcomm/invitation") as r:
            assert r.status == 200
            self.invitation = (await r.json())["invitation"]
        invitation_key = dk.verkey_from(self.invitation["services"][0]["recipientKeys"][0])
        request = {
            "@type": "https://didcomm.org/didexchange/1.1/request",
            "@id": str(uuid.uuid4()),
            "~thread": {"pthid": self.invitation["@id"]},
            "label": "test agent",
            "did": self.did,
        }
        self.mediator_key = invitation_key
        response = await self.send(request, to=invitation_key)
        assert response is not None
        complete = {
            "@type": "https://didcomm.org/didexchange/1.1/complete",
            "@id": str(uuid.uuid4()),
            "~thread": {"thid": request["@id"], "pthid": self.invitation["@id"]},
        }
        assert await self.send(complete, return_route=False) is None
        return response

    async def mediate(self) -> dict[str, Any]:
        grant = await self.send(msg("coordinate-mediation/1.0/mediate-request"))
        assert grant is not None
        assert grant["@type"].endswith("/mediate-grant"), grant
        self.grant = grant
        return grant

    async def register(self, *keys: bytes, action: str = "add") -> dict[str, Any]:
        updates = [{"recipient_key": dk.did_key(k), "action": action} for k in keys]
        reply = await self.send(msg("coordinate-mediation/1.0/keylist-update", updates=updates))
        assert reply is not None
        return reply


def msg(name: str, **body: Any) -> dict[str, Any]:
    return {"@type": "https://didcomm.org/" + name, "@id": str(uuid.uuid4()), **body}


def forward_envelope(routing_key: bytes, to: bytes, inner: dict[str, Any], fid: str | None = None) -> bytes:
    """What an anonymous sender posts: a forward for `to`, anoncrypted to the routing key."""
    fwd: dict[str, Any] = {
        "@type": "https://didcomm.org/routing/1.0/forward",
        "@id": fid or str(uuid.uuid4()),
    }
    fwd.update({"to": dk.b58encode(to), "msg": inner})
    return pack(json.dumps(fwd).encode(), [routing_key], None)


def inner_message(to: bytes, text: str) -> dict[str, Any]:
    """A packed message for the recipient key `to` (the mediator never opens it)."""
    doc = {"@type": "https://didcomm.org/basicmessage/1.0/message", "@id": str(uuid.uuid4()), "content": text}
    packed: dict[str, Any] = json.loads(pack(json.dumps(doc).encode(), [to], None))
    return packed


def attached(delivery: dict[str, Any]) -> list[Any]:
    """The packed messages of a Pickup 2.0 delivery (each attachment's data.base64, as JSON)."""
    return [json.loads(dk.b64decode_any(a["data"]["base64"])) for a in delivery["~attach"]]
