"""Bounded parsing, attacked: JSON nesting bombs wherever the relay parses JSON (the DIDComm
body, protected header, decrypted Anoncrypt and Authcrypt plaintext, did_doc~attach and its
JWS header, a did:peer:4 document, WebSocket frames, HTTP API bodies), base58 text long
enough to stall a quadratic decoder, and a plaintext past the mediator's MAX_MESSAGE.

Every bomb must get a 4xx JSON with its documented code (docs/api.md, "Input limits"), or an
error frame on a WebSocket that stays open; never a 500, never 1011, never a RecursionError
in the log. While the base58 attacks run, a probe measures the event loop's worst stall.
Before: 500 `internal_error` (RecursionError) for every bomb, 1011 on the socket, and
12-15 s of stall for 200,000 base58 characters.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from relay.didcomm import keys as dk
from relay.didcomm.envelope import pack
from tests.hostile.didcomm_attacker import (
    LoopProbe,
    exchange_request,
    hand_packed,
    invitation_key,
    mediated,
    nested,
    peer4_did,
    post,
    sealed_sender_envelope,
    serving,
)
from tests.hostile.harness import Relay, recipient, report
from tests.support.didcomm_test_agent import msg

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("parsing-bombs")]  # one relay per module

BOMB = b"[" * 100_000
STALL_MS = 250  # the probe's worst answer while an attack runs (a loaded 2-core machine)


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    yield from serving(tmp_path_factory.mktemp("bombs"))


def _invitation_doc(relay: Relay) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(relay.url + "/v1/didcomm/invitation") as resp:
        invitation: dict[str, Any] = json.loads(resp.read())["invitation"]
    return invitation


def _attach(document: bytes, jws_protected: bytes | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"base64": dk.b64url(document)}
    if jws_protected is not None:
        data["jws"] = {"header": {}, "protected": dk.b64url(jws_protected), "signature": dk.b64url(b"x" * 64)}
    return {"@id": str(uuid.uuid4()), "mime-type": "application/json", "data": data}


def _doc_with(key: dk.KeyPair, base58_key: str | None = None) -> bytes:
    method = {"id": "#k1", "type": "Ed25519VerificationKey2018", "publicKeyBase58": base58_key or key.b58}
    return json.dumps({"id": "did:web:attacker.example", "verificationMethod": [method]}).encode()


async def test_nesting_bombs_get_4xx_with_their_code(http: aiohttp.ClientSession, relay: Relay) -> None:
    to = await invitation_key(relay, http)
    stranger = dk.KeyPair.from_seed(os.urandom(32))
    invitation = _invitation_doc(relay)
    deep_doc = b'{"id": "did:web:x", "service": ' + nested(3000) + b"}"
    cases: dict[str, tuple[bytes, int, str]] = {
        "body": (BOMB, 400, "json_too_deep"),
        "body_closed": (nested(50_000), 400, "json_too_deep"),
        "protected": (hand_packed(b"[" * 40_000), 400, "json_too_deep"),
        "anoncrypt_plaintext": (pack(BOMB, [to], None), 400, "json_too_deep"),
        "authcrypt_plaintext": (pack(BOMB, [to], stranger), 400, "json_too_deep"),
        "did_doc_attach": (
            pack(exchange_request(invitation, "did:web:x", _attach(deep_doc)), [to], stranger),
            400,
            "request_not_accepted",
        ),
        "jws_header": (
            pack(
                exchange_request(invitation, "did:web:x", _attach(_doc_with(stranger), b"[" * 3000)),
                [to],
                stranger,
            ),
            400,
            "request_not_accepted",
        ),
        "did_peer_4": (
            pack(exchange_request(invitation, peer4_did(b"[" * 3000), None), [to], stranger),
            400,
            "request_not_accepted",
        ),
        "values": (b"[" + b"0," * 200_000 + b"0]", 400, "json_too_complex"),
    }
    figures = {}
    for name, (body, status, code) in cases.items():
        started = time.perf_counter()
        got_status, got = await post(http, relay, body)
        figures[name] = f"{got_status}/{got.get('code')}/{(time.perf_counter() - started) * 1000:.0f}ms"
        assert (got_status, got.get("code")) == (status, code), (name, got)
    report("DIDComm nesting bombs", **figures)


async def test_message_over_max_message_is_413(http: aiohttp.ClientSession, relay: Relay) -> None:
    to = await invitation_key(relay, http)
    stranger = dk.KeyPair.from_seed(os.urandom(32))
    ping = {**msg("trust_ping/1.0/ping"), "pad": "x" * (1 << 20)}
    status, body = await post(http, relay, pack(json.dumps(ping).encode(), [to], stranger))
    assert (status, body.get("code")) == (413, "message_too_large")


async def test_websocket_bomb_frames_answer_errors_and_the_socket_stays(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    m = await mediated(relay, http)
    to = await invitation_key(relay, http)
    codes = []
    async with http.ws_connect(relay.url.replace("http://", "ws://") + "/v1/didcomm/ws") as ws:
        for frame in (BOMB, pack(BOMB, [to], None), hand_packed(b"[" * 40_000)):
            await ws.send_bytes(frame)
            answer = await ws.receive_json(timeout=5)
            codes.append(answer["code"])
        await ws.send_str(BOMB.decode())
        codes.append((await ws.receive_json(timeout=5))["code"])
        # still a working socket: a return-routed trust ping is answered
        await ws.send_bytes(
            m.agent.packed({**msg("trust_ping/1.0/ping"), "~transport": {"return_route": "all"}})
        )
        pong, _ = m.agent.open((await ws.receive(timeout=5)).data)
        assert pong["@type"].endswith("/ping_response")
        assert not ws.closed
    assert codes == ["json_too_deep"] * 4
    report("DIDComm WebSocket bombs", codes=codes, close_code=ws.close_code)


async def test_api_json_bodies_and_live_frames_refuse_bombs(
    http: aiohttp.ClientSession, relay: Relay
) -> None:
    key = recipient(201)
    bodies = {
        f"/v1/queues/{key}/ack": b'{"seqs": ' + BOMB,
        "/v1/messages": b'{"recipients": ' + BOMB,
        "/v1/didcomm/pickup": b'{"@type": ' + BOMB,
    }
    for path, body in bodies.items():
        async with http.post(
            relay.url + path, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400, path
            assert (await resp.json())["code"] == "json_too_deep", path
    async with http.post(
        relay.url + "/v1/inbox/append", data=b'{"messageId": ' + BOMB, headers={"X-Inbox-ID": "bombed-inbox"}
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["code"] == "json_too_deep"
    async with http.ws_connect(relay.url.replace("http://", "ws://") + f"/v1/queues/{key}/live") as ws:
        assert (await ws.receive_json(timeout=5))["type"] == "empty"
        await ws.send_str(BOMB.decode())
        answer = await ws.receive_json(timeout=5)
        assert answer["code"] == "json_too_deep", answer
        assert not ws.closed


async def test_base58_attacks_do_not_stall_the_loop(http: aiohttp.ClientSession, relay: Relay) -> None:
    to = await invitation_key(relay, http)
    stranger = dk.KeyPair.from_seed(os.urandom(32))
    invitation = _invitation_doc(relay)
    long_b58 = ("z" * 200_000).encode()
    attacks = {
        # a sealed sender of 200,000 / 30,000 base58 characters (the first also overflows protected)
        "sealed_sender_200k": sealed_sender_envelope(to, long_b58),
        "sealed_sender_30k": sealed_sender_envelope(to, long_b58[:30_000]),
        # publicKeyBase58 of 200,000 (past the attachment bound) and 40,000 characters
        "publicKeyBase58_200k": pack(
            exchange_request(invitation, "did:web:x", _attach(_doc_with(stranger, "z" * 200_000))),
            [to],
            stranger,
        ),
        "publicKeyBase58_40k": pack(
            exchange_request(invitation, "did:web:x", _attach(_doc_with(stranger, "z" * 40_000))),
            [to],
            stranger,
        ),
        # did:peer:4 documents of ~16,000 (past the bound) and ~8,000 base58 characters
        "did_peer_4_16k": pack(exchange_request(invitation, peer4_did(b" " * 11_000), None), [to], stranger),
        "did_peer_4_8k": pack(exchange_request(invitation, peer4_did(b" " * 5_800), None), [to], stranger),
    }
    figures = {}
    for name, body in attacks.items():
        probe = LoopProbe(relay)
        async with probe.running():
            status, answer = await post(http, relay, body)
        assert 400 <= status < 500, (name, status, answer)
        figures[name] = f"{status}/{answer.get('code')}/stall {probe.worst_ms:.0f}ms"
        assert probe.worst_ms < STALL_MS, (name, probe.worst_ms)
    report("base58 stalls", **figures)
