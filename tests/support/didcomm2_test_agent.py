"""A small DIDComm v2 agent for the tests, on the same library as the mediator (joserfc through
relay.didcomm.jwm): its own X25519 and Ed25519 keys in a did:peer:2, authcrypt to the mediator,
anoncrypted forwards, Pickup 3.0 over HTTP (return_route "all") or the WebSocket. The stock
clients (Identus, Veramo) are driven by the v2agents tests; this one makes every step observable."""

from __future__ import annotations

import io
import json
import os
import uuid
import warnings
from typing import Any

import aiohttp
import nacl.bindings as sodium
from joserfc import jws
from joserfc.errors import SecurityWarning
from joserfc.jwk import OKPKey

from relay.didcomm import jwm, peer2
from relay.didcomm import keys as dk
from tests.support.didcomm_test_agent import OnAnyRelay

BASE = "https://didcomm.org/"


class Agent2(OnAnyRelay):
    def __init__(
        self,
        base_url: str,
        http: aiohttp.ClientSession,
        legacy_service: bool = False,
        enc: str = "A256CBC-HS512",
        tagged: bool = True,
        did: str | None = None,
    ) -> None:
        self.base = base_url
        self.http = http
        secret = os.urandom(32)
        self.sign = dk.KeyPair.from_seed(os.urandom(32))
        public = bytes(sodium.crypto_scalarmult_base(secret))
        if legacy_service:  # the older encoding: "s" a string, "t": "dm", r and a beside
            service = {"t": "dm", "s": "https://agent.example.test", "r": [], "a": ["didcomm/v2"]}
            self.did = (
                "did:peer:2.Ez"
                + dk.b58encode(peer2.X25519 + public)
                + ".Vz"
                + dk.b58encode(peer2.ED25519 + self.sign.verkey)
                + ".S"
                + dk.b64url(json.dumps(service).encode())
            )
        elif did is not None:  # the keys' DID in a given shape (its S entries)
            self.did = did.format(
                x="z" + dk.b58encode(peer2.X25519 + public),
                v="z" + dk.b58encode(peer2.ED25519 + self.sign.verkey),
            )
        else:
            self.did = peer2.encode_peer2(
                public, self.sign.verkey, ["https://agent.example.test"], ["didcomm/v2"]
            )
        self.enc, self.tagged = enc, tagged  # how it packs authcrypt (Veramo: A256GCM, untagged)
        self.key = jwm.AgreementKey(self.did + "#key-1", secret, public)
        self.mediator_did = ""
        self.grant: dict[str, Any] = {}

    def lookup(self, kid: str) -> jwm.AgreementKey | None:
        return self.key if peer2.resolve(self.did).key(kid) == peer2.resolve(self.did).agreement[0] else None

    def mediator_key(self) -> peer2.VerificationKey:
        return peer2.resolve(self.mediator_did).agreement[0]

    def packed(self, doc: dict[str, Any], authcrypt: bool = True) -> bytes:
        return jwm.pack(
            doc, self.mediator_key(), self.key if authcrypt else None, None, self.enc, self.tagged
        )

    def signed(self, doc: dict[str, Any]) -> bytes:
        """A JWS (EdDSA, general JSON) by this agent's Ed25519 key."""
        kid = self.did + "#key-2"
        jwk = {
            "kty": "OKP",
            "crv": "Ed25519",
            "x": dk.b64url(self.sign.verkey),
            "d": dk.b64url(self.sign.sign_secret[:32]),
        }
        with warnings.catch_warnings():  # "EdDSA": DIDComm's name, deprecated by RFC 9864
            warnings.simplefilter("ignore", SecurityWarning)
            out = jws.serialize_json(
                [{"protected": {"alg": "EdDSA", "typ": jwm.SIGNED}, "header": {"kid": kid}}],
                json.dumps(doc).encode(),
                OKPKey.import_key(jwk),  # type: ignore[arg-type]
                algorithms=["EdDSA"],
            )
        return json.dumps(out).encode()

    def open(self, raw: bytes) -> jwm.Opened:
        return jwm.unpack(raw, self.lookup)

    async def post(self, body: bytes, content_type: str = jwm.ENCRYPTED) -> tuple[int, bytes]:
        data = body if len(body) < 1 << 20 else io.BytesIO(body)  # aiohttp warns on large bytes
        async with self.http.post(
            self.base + "/v1/didcomm", data=data, headers={"Content-Type": content_type}
        ) as r:
            return r.status, await r.read()

    def message(self, name: str, return_route: bool = True, **body: Any) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": str(uuid.uuid4()),
            "type": BASE + name,
            "from": self.did,
            "to": [self.mediator_did],
            "body": body,
        }
        if return_route:
            doc["return_route"] = "all"
        return doc

    async def send(self, doc: dict[str, Any], authcrypt: bool = True) -> dict[str, Any] | None:
        status, raw = await self.post(self.packed(doc, authcrypt))
        if status == 202:
            return None
        assert status == 200, (status, raw[:300])
        opened = self.open(raw)
        assert opened.sender_did == self.mediator_did
        assert (opened.enc, opened.tagged) == (self.enc, self.tagged)  # answered as it was asked
        assert doc["id"] in (opened.message.get("thid"), opened.message.get("pthid"))
        return opened.message

    async def invitation(self) -> dict[str, Any]:
        async with self.http.get(self.base + "/v1/didcomm/v2/invitation") as r:
            assert r.status == 200
            body: dict[str, Any] = await r.json()
        self.mediator_did = body["invitation"]["from"]
        return body

    async def mediate(self, family: str = "coordinate-mediation/2.0") -> dict[str, Any]:
        if not self.mediator_did:
            await self.invitation()
        grant = await self.send(self.message(family + "/mediate-request"))
        assert grant is not None
        assert grant["type"] == BASE + family + "/mediate-grant", grant
        self.grant = grant
        return grant

    async def register(
        self, *dids: str, action: str = "add", family: str = "coordinate-mediation/2.0"
    ) -> dict[str, Any]:
        name = "keylist-update" if family.endswith("2.0") else "recipient-update"
        updates = [{"recipient_did": d, "action": action} for d in dids]
        reply = await self.send(self.message(f"{family}/{name}", updates=updates))
        assert reply is not None
        return reply


def new_recipient() -> tuple[str, jwm.AgreementKey]:
    """A fresh recipient DID (as an agent registers for each connection) and its key."""
    secret = os.urandom(32)
    public = bytes(sodium.crypto_scalarmult_base(secret))
    did = peer2.encode_peer2(
        public, dk.KeyPair.from_seed(os.urandom(32)).verkey, ["https://x.test"], ["didcomm/v2"]
    )
    return did, jwm.AgreementKey(did + "#key-1", secret, public)


def inner(to: str, text: str) -> dict[str, Any]:
    """A message for `to` as a sender packs it (anoncrypt; the mediator never opens it)."""
    doc = {"id": str(uuid.uuid4()), "type": BASE + "basicmessage/2.0/message", "body": {"content": text}}
    packed: dict[str, Any] = json.loads(jwm.pack(doc, peer2.resolve(to).agreement[0], None, enc="XC20P"))
    return packed


def forward(
    mediator_did: str, to: str, packed: dict[str, Any], base64: bool = False, fid: str | None = None
) -> bytes:
    """What a sender posts to the mediator: a Routing 2.0 forward, anoncrypted to the mediator."""
    data: dict[str, Any] = {"base64": dk.b64url(json.dumps(packed).encode())} if base64 else {"json": packed}
    doc = {
        "id": fid or str(uuid.uuid4()),
        "type": BASE + "routing/2.0/forward",
        "to": [mediator_did],
        "body": {"next": to},
        "attachments": [{"id": str(uuid.uuid4()), "data": data}],
    }
    return jwm.pack(doc, peer2.resolve(mediator_did).agreement[0], None)


def attached(delivery: dict[str, Any]) -> list[Any]:
    """The packed messages of a Pickup 3.0 delivery (data.json: Veramo reads nothing else)."""
    return [a["data"]["json"] for a in delivery["attachments"]]
