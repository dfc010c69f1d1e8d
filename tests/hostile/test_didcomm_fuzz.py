"""Property-based fuzzing (Hypothesis) of the DIDComm parsers: bounded JSON, base58, DIDs
(did:key, did:peer:0/2/4), DID Exchange attachments, envelopes, and plaintext messages sent
through a real relay.

Properties: a parser returns or raises its own error (never anything else), within a bounded
time per input; the relay answers every envelope below 500 with JSON, logs no traceback, and
its queues still deliver afterwards. The budget here runs in `make test` (~30 s in all);
`RELAY_FUZZ_EXAMPLES=N` runs N examples per property instead (docs/reliability.md,
"Running it"). Runs are derandomized (the same examples every run) and keep no database.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay import boundedjson
from relay.didcomm import keys as dk
from relay.didcomm.attachments import AttachmentError, attached_document, signed_attachment
from relay.didcomm.envelope import EnvelopeError, pack, parse, unpack
from relay.didcomm.mediator import HANDLED_TYPES
from tests.hostile.didcomm_attacker import Mediated, mediated, serving
from tests.hostile.fuzzing import B58, Poster, budget, json_values, timed
from tests.hostile.harness import Relay, report
from tests.support.didcomm_test_agent import msg

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("didcomm-fuzz")]  # one relay per module


# -- strategies ------------------------------------------------------------------------------


@st.composite
def deep(draw: st.DrawFn) -> bytes:
    """A JSON text nested 0-2000 levels (arrays, objects or both in turn), closed or not."""
    depth = draw(st.integers(0, 2000))
    opens = draw(st.sampled_from([["["], ['{"k":'], ["[", '{"k":']]))
    levels = [opens[i % len(opens)] for i in range(depth)]
    closes = "".join("]" if level == "[" else "}" for level in reversed(levels))
    tail = draw(st.sampled_from(["", closes, closes[: len(closes) // 2]]))
    return ("".join(levels) + "1" + tail).encode()


json_texts = st.one_of(
    st.binary(max_size=500),
    json_values.map(lambda v: json.dumps(v).encode()),
    deep(),
    st.text(alphabet='[]{}",:\\ 0a', max_size=600).map(str.encode),
)


def b64(data: bytes) -> str:
    return dk.b64url(data)


KEY = dk.KeyPair.from_seed(b"\x01" * 32)
VALID_DIDS = [
    KEY.did_key,
    "did:peer:0" + dk.fingerprint(KEY.verkey),
    dk.peer2_did(KEY, ["https://agent.example/didcomm"]),
]


def peer4(document: bytes) -> str:
    encoded = "z" + dk.b58encode(dk.JSON_CODEC + document)
    digest = "z" + dk.b58encode(dk.SHA256_MULTIHASH + hashlib.sha256(encoded.encode()).digest())
    return f"did:peer:4{digest}:{encoded}"


@st.composite
def mutated(draw: st.DrawFn, texts: list[str]) -> str:
    """A valid text with a slice replaced by random characters."""
    text = draw(st.sampled_from(texts))
    start = draw(st.integers(0, len(text)))
    end = draw(st.integers(start, len(text)))
    return text[:start] + draw(st.text(max_size=40)) + text[end:]


dids = st.one_of(
    st.text(max_size=300),
    st.sampled_from(VALID_DIDS),
    mutated(VALID_DIDS),
    st.builds(lambda s: "did:key:z" + s, st.text(alphabet=B58, max_size=200)),
    st.builds(lambda s: "did:peer:2" + s, st.text(alphabet=B58 + ".VESz", max_size=400)),
    json_values.map(lambda v: peer4(json.dumps(v).encode())),
    deep().map(peer4),
    json_texts.map(peer4),
)


def document(key: dk.KeyPair, extra: Any) -> dict[str, Any]:
    return {
        "id": "did:web:agent.example",
        "verificationMethod": [
            {"id": "#k1", "type": "Ed25519VerificationKey2018", "publicKeyBase58": key.b58}
        ],
        "service": [{"type": "did-communication", "recipientKeys": ["#k1"], "extra": extra}],
    }


@st.composite
def attachments(draw: st.DrawFn) -> Any:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(json_values)
    if kind == 1:  # a signed, valid document with random extra content
        signed = signed_attachment(
            KEY, json.dumps(document(KEY, draw(json_values))).encode(), "application/json"
        )
        return signed
    data: dict[str, Any] = {"base64": b64(draw(json_texts))}
    if kind == 3:
        data["jws"] = draw(
            st.fixed_dictionaries(
                {
                    "protected": json_texts.map(b64) | st.text(max_size=50),
                    "signature": st.binary(max_size=80).map(b64),
                    "header": st.dictionaries(st.sampled_from(["kid", "x"]), json_values, max_size=2),
                }
            )
        )
    return {"data": data}


MEDIATOR = dk.Identity.from_seed(b"\x02" * 32, "http://relay.example.test")


@st.composite
def envelopes(draw: st.DrawFn) -> bytes:
    """A valid envelope for the mediator with one part replaced: a field, the protected
    header (random JSON, a nesting bomb, a mutated recipient), or the whole body."""
    sender = draw(st.sampled_from([None, KEY]))
    doc = json.loads(
        pack(b'{"@type": "https://didcomm.org/trust_ping/1.0/ping"}', [MEDIATOR.connection.verkey], sender)
    )
    part = draw(st.sampled_from(["field", "protected", "recipient", "body"]))
    if part == "field":
        doc[draw(st.sampled_from(["protected", "iv", "ciphertext", "tag"]))] = draw(
            json_values | st.binary(max_size=100).map(b64)
        )
    elif part == "protected":
        doc["protected"] = b64(draw(json_texts))
    elif part == "recipient":
        header = json.loads(dk.b64decode_any(doc["protected"]))
        entry = header["recipients"][0]
        target = draw(st.sampled_from(["encrypted_key", "kid", "sender", "iv"]))
        value = draw(json_values | st.binary(max_size=300).map(b64) | st.text(alphabet=B58, max_size=300))
        if target == "encrypted_key":
            entry[target] = value
        else:
            entry["header"][target] = value
        doc["protected"] = b64(json.dumps(header).encode())
    else:
        return draw(json_texts)
    return json.dumps(doc).encode()


# -- parsers ---------------------------------------------------------------------------------


@budget(200)
@given(json_texts)
def test_bounded_json_returns_or_refuses_with_its_code(raw: bytes) -> None:
    try:
        timed(lambda: boundedjson.loads(raw, 1 << 20))
        return
    except boundedjson.JsonLimitError as exc:
        refused = exc
    assert refused.code in ("bad_json", "json_too_deep", "json_too_complex", "json_too_large")
    assert 400 <= refused.status < 500


def _as_parsed(value: Any) -> Any:
    """`value` as docs/api.md says the relay reads it: an integer beyond [-2**63, 2**64 - 1]
    as the nearest float (json keeps it exact)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else float(value)
    if isinstance(value, list):
        return [_as_parsed(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_parsed(v) for k, v in value.items()}
    return value


@budget(150)
@given(json_values)
def test_bounded_json_agrees_with_json_within_the_bounds(value: Any) -> None:
    text = json.dumps(value).encode()
    assert boundedjson.loads(text, 1 << 20) == _as_parsed(json.loads(text))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"-9223372036854775808", -(2**63)),
        (b"18446744073709551615", 2**64 - 1),
        (b"-9223372036854775809", float(-(2**63) - 1)),
        (b"[18446744073709551616]", [float(2**64)]),
    ],
)
def test_bounded_json_reads_integers_exactly_within_64_bits(text: bytes, expected: Any) -> None:
    parsed = boundedjson.loads(text, 1 << 20)
    assert parsed == expected
    assert type(parsed) is type(expected)


@budget(150)
@given(st.text(alphabet=B58, max_size=120) | st.text(max_size=120))
def test_base58_decodes_bounded_or_refuses(text: str) -> None:
    try:
        raw = timed(lambda: dk.b58decode(text))
    except dk.DidError:
        assert len(text) > dk.MAX_B58 or set(text) - set(B58)
        return
    assert dk.b58encode(raw) == text


@budget(150)
@given(dids)
def test_dids_resolve_to_keys_or_refuse(did: str) -> None:
    try:
        found = timed(lambda: dk.keys_of_did(did))
    except dk.DidError:
        return
    assert found
    assert all(isinstance(k, bytes) and len(k) == 32 for k in found)


@budget(150)
@given(attachments())
def test_attachments_verify_or_refuse(attach: Any) -> None:
    try:
        doc = timed(lambda: attached_document(attach))
    except AttachmentError:
        return
    assert doc is None or isinstance(doc, dict)


@budget(150)
@given(envelopes())
def test_envelopes_open_or_refuse(raw: bytes) -> None:
    try:
        opened = timed(lambda: unpack(parse(raw), MEDIATOR.keypair_for))
    except EnvelopeError as exc:
        status = exc.status
    else:
        assert opened.recipient == MEDIATOR.connection.verkey
        return
    assert 400 <= status < 500


# -- through a relay -------------------------------------------------------------------------

TYPES = sorted(HANDLED_TYPES)  # every type the mediator acts on
FIELDS = [
    "to",
    "msg",
    "limit",
    "recipient_key",
    "message_id_list",
    "updates",
    "query",
    "did",
    "did_doc~attach",
]


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    yield from serving(tmp_path_factory.mktemp("fuzz"))


async def _mediated(relay: Relay) -> Mediated:
    async with aiohttp.ClientSession() as http:
        return await mediated(relay, http)


def test_plaintext_messages_and_envelopes_through_the_relay(relay: Relay) -> None:
    m = asyncio.run(_mediated(relay))
    post = Poster(relay.url + "/v1/didcomm", "application/didcomm-envelope-enc")

    @budget(40)
    @given(
        st.sampled_from(TYPES),
        st.dictionaries(st.sampled_from(FIELDS), json_values | attachments() | dids, max_size=4),
        st.sampled_from(["connection", "anonymous", "stranger"]),
    )
    def plaintext(name: str, fields: dict[str, Any], who: str) -> None:
        doc = {**msg(name), **fields, "~transport": {"return_route": "all"}}
        body = json.dumps(doc).encode()
        if who == "connection":
            post(pack(body, [m.agent.mediator_key or b""], m.agent.kp))
        elif who == "anonymous":
            post(pack(body, [m.routing], None))
        else:
            post(pack(body, [m.routing], KEY))

    @budget(40)
    @given(envelopes())
    def enveloped(raw: bytes) -> None:
        post(raw)

    plaintext()
    enveloped()
    # nothing the fuzzing sent blocks the agent's queue: a good forward is delivered
    good = m.good("after the fuzzing")
    post(m.forward(good))
    delivery = asyncio.run(_deliver(m, relay))
    assert json.dumps(good).encode() in delivery
    report("DIDComm fuzz through the relay", statuses=post.sorted_statuses())


async def _deliver(m: Mediated, relay: Relay) -> list[bytes]:
    """Everything Pickup hands out for the agent's key, until nothing is left."""
    got: list[bytes] = []
    async with aiohttp.ClientSession() as http:
        m.agent.http = http
        for _ in range(50):
            reply = await m.agent.send(msg("messagepickup/2.0/delivery-request", limit=100))
            assert reply is not None
            if not reply["@type"].endswith("/delivery"):
                return got
            got += [dk.b64decode_any(a["data"]["base64"]) for a in reply["~attach"]]
            ids = [a["@id"] for a in reply["~attach"]]
            await m.agent.send(msg("messagepickup/2.0/messages-received", message_id_list=ids))
    return got
