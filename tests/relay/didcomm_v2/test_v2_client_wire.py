"""What the stock DIDComm v2 clients put on the wire, pinned without a mediator.

The Identus SDK 7.0.0 and Veramo 7.0.1 agents (tests/support/didcomm_stock_agents.py) send basic
messages to did:peer:2 DIDs this test makes, whose DIDCommMessaging service is a local HTTP
endpoint that records each request: directly (the service's uri is the endpoint) and through a
mediator (the uri is a mediator DID whose own service is the endpoint, so the client wraps a
Routing 2.0 forward). The v2 mediator must take exactly this (docs/protocols.md, "DIDComm v2
interop"): the HTTP method and content type, the JWE's algorithms, who it is encrypted to and
from, and that both clients resolve a did:peer:2 service written as `"s": {"uri": ...}` in
unpadded base64url, one service per S segment.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nacl.bindings as sodium
import nacl.public
import pytest
import pytest_asyncio
from aiohttp import web

from relay.didcomm import keys as dk
from tests.support.didcomm_stock_agents import IdentusAgent, NodeAgent, Toolchain, VeramoAgent, toolchain

pytestmark = [
    pytest.mark.didcomm_agents,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
]


def _peer2(endpoint: str) -> str:
    """did:peer:2 of a fresh X25519 (#key-1) and Ed25519 (#key-2) key and one DIDCommMessaging
    service in the current encoding, unpadded: what the v2 mediator's own DID looks like."""
    x = bytes(nacl.public.PrivateKey.generate().public_key)
    ed, _ = sodium.crypto_sign_keypair()
    service = {"t": "dm", "s": {"uri": endpoint, "a": ["didcomm/v2"]}}
    return "".join(
        [
            "did:peer:2",
            ".Ez" + dk.b58encode(dk.X25519_CODEC + x),
            ".Vz" + dk.b58encode(dk.ED25519_CODEC + ed),
            ".S" + dk.b64url(json.dumps(service, separators=(",", ":")).encode()),
        ]
    )


def _protected(jwe: dict[str, Any]) -> dict[str, Any]:
    text = str(jwe["protected"])
    header: dict[str, Any] = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    return header


@dataclass
class Endpoint:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Clients:
    endpoint: Endpoint
    identus: IdentusAgent
    veramo: VeramoAgent
    agents: list[NodeAgent]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def clients(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Clients]:
    tools: Toolchain = toolchain()
    workdir: Path = tmp_path_factory.mktemp("didcomm-v2-wire")
    recorded: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        recorded.append(
            {
                "method": request.method,
                "path": request.path,
                "content_type": request.headers.get("Content-Type", ""),
                "body": await request.read(),
            }
        )
        return web.Response(status=202)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    endpoint = Endpoint(f"http://127.0.0.1:{port}/inbox", recorded)
    identus = IdentusAgent(tools, workdir, "identus")
    veramo = VeramoAgent(tools, workdir, "veramo")
    try:
        await identus.start_agent(None)
        await veramo.start_agent(None)
        yield Clients(endpoint, identus, veramo, [identus, veramo])
    except BaseException:
        for agent in (identus, veramo):
            print(f"===== {agent.name} =====\n{agent.log_tail()}")
        raise
    finally:
        await identus.stop()
        await veramo.stop()
        await runner.cleanup()


async def _send(clients: Clients, agent: NodeAgent, to: str, content: str) -> dict[str, Any]:
    """One basic message from a new DID of `agent` to `to`; the request the endpoint got."""
    sender = (await agent.command("new-did"))["did"]
    before = len(clients.endpoint.requests)
    await agent.command("send", timeout=60, **{"from": sender, "to": to, "content": content})
    got = clients.endpoint.requests[before:]
    assert len(got) == 1, got
    request = got[0]
    request["sender"] = sender
    request["jwe"] = json.loads(request["body"])
    return request


async def test_identus_posts_authcrypt_to_the_first_service(clients: Clients) -> None:
    to = _peer2(clients.endpoint.url)
    request = await _send(clients, clients.identus, to, "direct")
    assert request["method"] == "POST"
    assert request["path"] == "/inbox"
    assert request["content_type"] == "application/didcomm-encrypted+json"
    header = _protected(request["jwe"])
    assert (header["alg"], header["enc"]) == ("ECDH-1PU+A256KW", "A256CBC-HS512")
    assert header["skid"] == request["sender"] + "#key-1"  # its own X25519 key: E comes first
    assert [r["header"]["kid"] for r in request["jwe"]["recipients"]] == [to + "#key-1"]
    # Identus' own DIDs: E, V and an S segment holding a JSON array ("[]" without a mediator)
    parts = request["sender"].split(".")
    assert [p[:1] for p in parts[1:]] == ["E", "V", "S"]
    assert json.loads(dk.b64decode_any(parts[3][1:])) == []


async def test_identus_wraps_an_authcrypt_forward_to_the_mediator_did(clients: Clients) -> None:
    mediator = _peer2(clients.endpoint.url)
    to = _peer2(mediator)  # the recipient's service names its mediator's DID
    request = await _send(clients, clients.identus, to, "forwarded")
    assert request["content_type"] == "application/didcomm-encrypted+json"
    header = _protected(request["jwe"])
    # the forward itself is authcrypted from the sender's peer DID to the mediator DID
    assert (header["alg"], header["enc"]) == ("ECDH-1PU+A256KW", "A256CBC-HS512")
    assert header["skid"] == request["sender"] + "#key-1"
    assert [r["header"]["kid"] for r in request["jwe"]["recipients"]] == [mediator + "#key-1"]


async def test_veramo_posts_authcrypt_with_a256gcm(clients: Clients) -> None:
    to = _peer2(clients.endpoint.url)
    request = await _send(clients, clients.veramo, to, "direct")
    assert request["method"] == "POST"
    assert request["content_type"] == "application/didcomm-encrypted+json"  # the JWE's typ
    header = _protected(request["jwe"])
    # Veramo's default content encryption for authcrypt, and no apu/apv (its ECDH-1PU KDF
    # leaves out the content tag: docs/protocols.md)
    assert (header["alg"], header["enc"]) == ("ECDH-1PU+A256KW", "A256GCM")
    assert "apu" not in header
    assert "apv" not in header
    assert header["skid"] == request["sender"] + "#key-1"
    assert [r["header"]["kid"] for r in request["jwe"]["recipients"]] == [to + "#key-1"]


async def test_veramo_wraps_an_anoncrypt_forward_to_the_mediator_did(clients: Clients) -> None:
    mediator = _peer2(clients.endpoint.url)
    to = _peer2(mediator)
    request = await _send(clients, clients.veramo, to, "forwarded")
    header = _protected(request["jwe"])
    assert (header["alg"], header["enc"]) == ("ECDH-ES+A256KW", "A256GCM")
    assert "skid" not in header
    assert [r["header"]["kid"] for r in request["jwe"]["recipients"]] == [mediator + "#key-1"]
