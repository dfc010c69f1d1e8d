"""What the DIDComm attacks need: a relay with the mediator on, envelopes no agent would pack
(bombs in the protected header, an oversized sealed sender), and a probe that measures how
long the relay's event loop stalls while an attack is handled.

Envelopes are packed with PyNaCl through relay.didcomm.envelope (pinned to Credo's by the
known-answer tests) or built by hand where an attack needs a field no packer writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nacl.bindings as sodium

from relay.didcomm import keys as dk
from relay.didcomm.envelope import pack
from tests.hostile.harness import Relay, start_redis, start_relay
from tests.support.didcomm_test_agent import Agent, forward_envelope, inner_message

WIRE = {"Content-Type": "application/didcomm-envelope-enc"}


def didcomm_relay(
    workdir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ("--auth", "none")
) -> Relay:
    """`relayfleet relay` with the mediator on (its own redis-server); stop both with stop_all."""
    workdir.mkdir(parents=True, exist_ok=True)
    seed = workdir / "seed"
    seed.write_text(os.urandom(32).hex() + "\n")
    full = {
        "RELAY_DIDCOMM_SEED_FILE": str(seed),
        "RELAY_PUBLIC_URL": "http://relay.example.test",
        "RELAY_DIDCOMM_REDELIVER_S": "1",
        **(env or {}),
    }
    redis = start_redis()
    try:
        return start_relay(redis, workdir, full, args=args)
    except BaseException:
        redis.stop()
        raise


def stop_all(relay: Relay) -> None:
    relay.stop()
    relay.redis.stop()


def serving(workdir: Path) -> Iterator[Relay]:
    """A module fixture's body: a mediator relay for the module's attacks, stopped afterwards,
    its log then checked clean (no planted marker, no traceback, no RecursionError)."""
    started = didcomm_relay(workdir)
    try:
        yield started
    finally:
        stop_all(started)
        started.assert_log_clean()
        assert b"RecursionError" not in started.log_bytes()


@dataclass
class Mediated:
    """A connected agent with mediation granted and one registered recipient key."""

    agent: Agent
    key: bytes  # the registered recipient key (its queue is the Pickup queue)
    routing: bytes  # the mediator's routing key, which anonymous senders forward to

    def forward(self, inner: Any) -> bytes:
        return forward_envelope(self.routing, self.key, inner)

    def forward_raw(self, inner: bytes) -> bytes:
        """A forward whose `msg` is the JSON text `inner`, byte for byte (json.dumps recurses)."""
        head = {"@type": "https://didcomm.org/routing/1.0/forward", "@id": str(uuid.uuid4())}
        head["to"] = dk.b58encode(self.key)
        plaintext = json.dumps(head).encode()[:-1] + b', "msg": ' + inner + b"}"
        return pack(plaintext, [self.routing], None)

    def good(self, text: str) -> dict[str, Any]:
        return inner_message(self.key, text)


async def mediated(relay: Relay, http: aiohttp.ClientSession) -> Mediated:
    agent = Agent(relay.url, http)
    await agent.connect()
    await agent.mediate()
    key = dk.KeyPair.from_seed(os.urandom(32)).verkey
    reply = await agent.register(key)
    assert reply["updated"][0]["result"] == "success"
    return Mediated(agent, key, dk.verkey_from(agent.grant["routing_keys"][0]))


async def invitation_key(relay: Relay, http: aiohttp.ClientSession) -> bytes:
    async with http.get(relay.url + "/v1/didcomm/invitation") as resp:
        doc = await resp.json()
    return dk.verkey_from(doc["invitation"]["services"][0]["recipientKeys"][0])


async def post(http: aiohttp.ClientSession, relay: Relay, body: bytes) -> tuple[int, dict[str, Any]]:
    async with http.post(relay.url + "/v1/didcomm", data=io.BytesIO(body), headers=WIRE) as resp:
        raw = await resp.read()
        return resp.status, (json.loads(raw) if raw and resp.content_type == "application/json" else {})


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hand_packed(header: dict[str, Any] | bytes) -> bytes:
    """An envelope around a protected header of the attacker's choosing (it never decrypts)."""
    protected = header if isinstance(header, bytes) else json.dumps(header).encode()
    return json.dumps(
        {
            "protected": dk.b64url(protected),
            "iv": dk.b64url(os.urandom(12)),
            "ciphertext": dk.b64url(os.urandom(32)),
            "tag": dk.b64url(os.urandom(16)),
        }
    ).encode()


def sealed_sender_envelope(to: bytes, sender_text: bytes) -> bytes:
    """Authcrypt whose sealed `sender` opens (anyone can seal to the mediator's key) to text
    of the attacker's choosing, e.g. 200,000 base58 characters."""
    x_to = dk.to_x25519_public(to)
    entry = {
        "encrypted_key": dk.b64url(os.urandom(48)),
        "header": {
            "kid": dk.b58encode(to),
            "sender": dk.b64url(sodium.crypto_box_seal(sender_text, x_to)),
            "iv": dk.b64url(os.urandom(24)),
        },
    }
    header = {"enc": "xchacha20poly1305_ietf", "typ": "JWM/1.0", "alg": "Authcrypt", "recipients": [entry]}
    return hand_packed(header)


def exchange_request(invitation: dict[str, Any], did: str, attach: dict[str, Any] | None) -> bytes:
    """A DID Exchange request's plaintext (packed by the caller with a key of its own)."""
    doc: dict[str, Any] = {
        "@type": "https://didcomm.org/didexchange/1.1/request",
        "@id": str(uuid.uuid4()),
        "~thread": {"pthid": invitation["@id"]},
        "label": "attacker",
        "did": did,
    }
    if attach is not None:
        doc["did_doc~attach"] = attach
    return json.dumps(doc).encode()


def peer4_did(document: bytes) -> str:
    """A long-form did:peer:4 whose hash matches `document` (raw bytes after the JSON codec)."""
    encoded = "z" + dk.b58encode(dk.JSON_CODEC + document)
    digest = "z" + dk.b58encode(dk.SHA256_MULTIHASH + hashlib.sha256(encoded.encode()).digest())
    return f"did:peer:4{digest}:{encoded}"


def packed_by(kp: dk.KeyPair, to: bytes, plaintext: bytes) -> bytes:
    return pack(plaintext, [to], kp)


class LoopProbe:
    """GET /healthz back to back on its own connection while an attack runs: the slowest
    answer is how long the relay's event loop was blocked (plus one request's cost)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.worst_ms = 0.0
        self.count = 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LoopProbe]:
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as s:

            async def probe() -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    async with s.get(self.relay.url + "/healthz") as resp:
                        await resp.read()
                    self.worst_ms = max(self.worst_ms, (time.perf_counter() - t0) * 1000)
                    self.count += 1
                    await asyncio.sleep(0.005)

            task = asyncio.create_task(probe())
            await asyncio.sleep(0.05)
            try:
                yield self
            finally:
                await asyncio.sleep(0.05)
                stop.set()
                await task
