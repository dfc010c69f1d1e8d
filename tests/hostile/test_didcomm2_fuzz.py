"""Property-based fuzzing (Hypothesis) of the DIDComm v2 side: did:peer:2 / did:key resolution,
JWE / JWS opening, and every v2 message type with hostile bodies through a real relay
subprocess. Properties as for v1 (tests/hostile/test_didcomm_fuzz.py): a parser returns or
raises its own error within a bounded time; the relay answers below 500 with JSON, logs no
traceback (`serving` checks the log), and the agent's queue still delivers afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.didcomm import jwm, peer2
from relay.didcomm import keys as dk
from relay.didcomm.mediator2 import HANDLED_TYPES
from tests.hostile.didcomm_attacker import serving
from tests.hostile.fuzzing import B58, Poster, budget, json_values, timed
from tests.hostile.harness import Relay, report
from tests.support.didcomm2_test_agent import Agent2, forward, inner, new_recipient

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("didcomm2-fuzz")]

AGENT = Agent2("http://unused.test", None)  # type: ignore[arg-type]  # keys and DIDs only
RECIPIENT, RECIPIENT_KEY = new_recipient()


def b64(data: bytes) -> str:
    return dk.b64url(data)


services = st.one_of(
    json_values.map(lambda v: b64(json.dumps(v).encode())),
    st.text(max_size=80),
    st.sampled_from(["W10", b64(b'[{"t":"dm","s":{"uri":"x"}}]'), b64(b'{"s":"http://x","r":[1]}')]),
)
dids = st.one_of(
    st.text(max_size=200),
    st.builds(
        lambda keys, svc: "did:peer:2" + "".join("." + k for k in keys) + "".join(".S" + s for s in svc),
        st.lists(
            st.builds(lambda p, t: p + "z" + t, st.sampled_from("EVAXS"), st.text(alphabet=B58, max_size=60)),
            max_size=5,
        ),
        st.lists(services, max_size=3),
    ),
    st.builds(lambda s: "did:key:z" + s, st.text(alphabet=B58, max_size=80)),
    st.just(AGENT.did),
)


@budget(200)
@given(dids)
def test_v2_dids_resolve_or_refuse(did: str) -> None:
    try:
        resolved = timed(lambda: peer2.resolve(did))
    except dk.DidError:
        return
    assert all(k.crv in ("X25519", "P-256") for k in resolved.agreement)
    assert all(k.crv == "Ed25519" for k in resolved.authentication)


MEDIATOR_DID = peer2.encode_peer2(AGENT.key.public, AGENT.sign.verkey, ["http://m.test"], ["didcomm/v2"])
MEDIATOR_KEY = jwm.AgreementKey(MEDIATOR_DID + "#key-1", AGENT.key.secret, AGENT.key.public)


def _lookup(kid: str) -> jwm.AgreementKey | None:
    return MEDIATOR_KEY if kid.startswith(MEDIATOR_DID) else None


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """A real JWE or JWS with one part replaced by something hostile."""
    doc = {"id": "1", "type": "https://didcomm.org/trust-ping/2.0/ping", "from": AGENT.did, "body": {}}
    kind = draw(st.sampled_from(["anon", "auth", "signed"]))
    if kind == "signed":
        packed = json.loads(AGENT.signed(doc))
        target = draw(st.sampled_from(["payload", "signatures"]))
    else:
        to = peer2.resolve(MEDIATOR_DID).agreement[0]
        packed = json.loads(
            jwm.pack(doc, to, AGENT.key if kind == "auth" else None, None, draw(st.sampled_from(jwm.ENCS)))
        )
        target = draw(st.sampled_from(["protected", "recipients", "iv", "ciphertext", "tag", "header"]))
    value = draw(json_values | st.binary(max_size=200).map(b64) | dids)
    if target == "protected" and draw(st.booleans()):
        header = json.loads(dk.b64decode_any(packed["protected"]))
        header[draw(st.sampled_from(["alg", "enc", "epk", "skid", "apu", "apv"]))] = value
        packed["protected"] = b64(json.dumps(header).encode())
    elif target == "header":
        packed["recipients"][0]["header"]["kid"] = value
    else:
        packed[target] = value
    return json.dumps(packed).encode()


@budget(150)
@given(messages())
def test_v2_messages_open_or_refuse(raw: bytes) -> None:
    try:
        opened = timed(lambda: jwm.unpack(raw, _lookup))
    except jwm.JwmError as exc:
        status = exc.status
    else:
        assert isinstance(opened.message, dict)
        return
    assert 400 <= status < 500


# -- through a relay -------------------------------------------------------------------------

TYPES = sorted(HANDLED_TYPES)
FIELDS = [
    "next",
    "updates",
    "limit",
    "recipient_did",
    "message_id_list",
    "live_delivery",
    "queries",
    "paginate",
]


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    yield from serving(tmp_path_factory.mktemp("fuzz2"))


async def _mediated(relay: Relay) -> Agent2:
    async with aiohttp.ClientSession() as http:
        agent = Agent2(relay.url, http)
        await agent.mediate()
        reply = await agent.register(RECIPIENT)
        assert reply["body"]["updated"][0]["result"] == "success"
    return agent


def test_v2_messages_through_the_relay(relay: Relay) -> None:
    agent = asyncio.run(_mediated(relay))
    post = Poster(relay.url + "/v1/didcomm", jwm.ENCRYPTED)

    @budget(60)
    @given(
        st.sampled_from(TYPES),
        st.dictionaries(st.sampled_from(FIELDS), json_values | dids, max_size=4),
        st.one_of(st.none(), json_values),
        st.sampled_from(["authcrypt", "anoncrypt", "signed", "plain"]),
        st.one_of(st.none(), json_values),
    )
    def plaintext(name: str, body: dict[str, Any], attachments: Any, how: str, odd_body: Any) -> None:
        doc = agent.message(name, **body)
        if odd_body is not None:  # the body itself replaced: a list, a number, an object...
            doc["body"] = odd_body
        if attachments is not None:
            doc["attachments"] = attachments
        if how == "plain":
            post(json.dumps(doc).encode(), jwm.PLAIN)
        elif how == "signed":
            post(agent.signed(doc), jwm.SIGNED)
        else:
            post(agent.packed(doc, how == "authcrypt"))

    @budget(40)
    @given(messages())
    def enveloped(raw: bytes) -> None:
        post(raw)

    plaintext()
    enveloped()
    # nothing the fuzzing sent blocks the recipient's queue: a good forward is delivered
    good = inner(RECIPIENT, "after the fuzzing")
    post(forward(agent.mediator_did, RECIPIENT, good))
    delivered = asyncio.run(_deliver(agent, relay))
    assert good in delivered
    report("DIDComm v2 fuzz through the relay", statuses=post.sorted_statuses())


async def _deliver(agent: Agent2, relay: Relay) -> list[Any]:
    got: list[Any] = []
    async with aiohttp.ClientSession() as http:
        agent.http = http
        for _ in range(50):
            reply = await agent.send(agent.message("messagepickup/3.0/delivery-request", limit=100))
            assert reply is not None
            if not reply["type"].endswith("/delivery"):
                return got
            got += [a["data"]["json"] for a in reply["attachments"]]
            ids = [a["id"] for a in reply["attachments"]]
            await agent.send(agent.message("messagepickup/3.0/messages-received", message_id_list=ids))
    return got
