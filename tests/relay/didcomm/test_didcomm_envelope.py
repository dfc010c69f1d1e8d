"""DIDComm v1 envelopes: known answers from a real implementation, round trips, tampering.

The two vectors are envelopes Credo-ts 0.5 (Askar) packed, published as interop fixtures in
credo-ts packages/askar/tests/askar-didcomm-credo-05.test.ts with the recipient's key; opening
them proves the relay reads what Askar-based agents write (12-byte nonce, AAD, key boxes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from relay.didcomm import keys as dk
from relay.didcomm.envelope import EnvelopeError, pack, parse, unpack

CREDO_RECIPIENT_SEED = bytes.fromhex("226e10dad834f65c4e2b4bed1c29db06908f225eaa27ca7ebe2b74258fd6f1eb")
CREDO_AUTHCRYPT = {
    "protected": (
        "eyJlbmMiOiJ4Y2hhY2hhMjBwb2x5MTMwNV9pZXRmIiwidHlwIjoiSldNLzEuMCIsImFsZyI6IkF1dGhjcnlwdCIsInJl"
        "Y2lwaWVudHMiOlt7ImVuY3J5cHRlZF9rZXkiOiJfWm5YYkdYLVFwTG8xVEllY1BnbDFFZUhiZEpyMUMteWNvc25fWWVD"
        "Zm9BeUlzUVk4UmFBTG1IMFZlcEhQcnMwIiwiaGVhZGVyIjp7ImtpZCI6IkJUZk5WSDFDSzVHN29HRmRwbkFFUjNaaTRz"
        "d3Jrc2J1RWsxZjNXTVV4cWhmIiwic2VuZGVyIjoiWjBBZXZVYkRsand4YzJsdVhpYWI5M1Z2OUw1YzBGdm4tV3ljaUpH"
        "c0RYcWlobVdtTEg1R1JtQjVaN2FTRVNfQXFsMDByUllQMDRkaWg1YjVSTG9ydEg1N2JUSER3QnhGallZTElMSE9ValI4"
        "NUZJeHdsSnNhM1NKUXY0IiwiaXYiOiJjYjJlaDdYRHdFSVU0WFNrWDduOFl6cVVNSXRMUWlUbyJ9fV19"
    ),
    "ciphertext": "ZN9MbaJYFEIcIsjS7RJL0-J8QvuJCRgfUyunQPlN2FTa88HfCFyJfwCWeN1RbZs",
    "iv": "t2rSkBzjq8uu7-ji",
    "tag": "bOflaQwnOsUngIeoh9adww",
}
CREDO_ANONCRYPT = {
    "protected": (
        "eyJlbmMiOiJ4Y2hhY2hhMjBwb2x5MTMwNV9pZXRmIiwidHlwIjoiSldNLzEuMCIsImFsZyI6IkFub25jcnlwdCIsInJl"
        "Y2lwaWVudHMiOlt7ImVuY3J5cHRlZF9rZXkiOiJZME9uTUNGZ2VIQUpEV1Y4NkVhWEpQWXN5RUVlWXVfZVNQX2ltX3VD"
        "MUFkYkpRalI4RkRTUFZxd1RrUU5GcDc1X2RwemZpX2pqcGlUVTZhQ2VobThTdzMwS3B5bmJHemNROWdsUnFxY1NnQSIs"
        "ImhlYWRlciI6eyJraWQiOiJCVGZOVkgxQ0s1RzdvR0ZkcG5BRVIzWmk0c3dya3NidUVrMWYzV01VeHFoZiJ9fV19"
    ),
    "ciphertext": "GTzzcCSkcofiC2dH2LRChTxikb9Nn8ZAesGY6iJWzeLNQea5SgEqM0zw-cwVSbFlPSq5_w",
    "iv": "EF6uHk2lUSoayxV7",
    "tag": "op_xOrKdtJVhCa0u1hBJ7A",
}


def holder(*pairs: dk.KeyPair) -> Callable[[bytes], dk.KeyPair | None]:
    return lambda verkey: next((kp for kp in pairs if kp.verkey == verkey), None)


def test_credo_recipient_key_is_the_one_the_vectors_name() -> None:
    kp = dk.KeyPair.from_seed(CREDO_RECIPIENT_SEED)
    assert kp.b58 == "BTfNVH1CK5G7oGFdpnAER3Zi4swrksbuEk1f3WMUxqhf"
    assert dk.b64url(kp.verkey) == "m2lbHnBNuvMlBnJrV1tPKLc-Jdabzd_GWXs1Ft39U_4"


def test_opens_credo_authcrypt() -> None:
    kp = dk.KeyPair.from_seed(CREDO_RECIPIENT_SEED)
    opened = unpack(CREDO_AUTHCRYPT, holder(kp))
    assert json.loads(opened.message) == {"@type": "https://didcomm.org/connections/1.0"}
    assert opened.recipient == kp.verkey
    assert opened.sender is not None
    assert dk.b64url(opened.sender) == "R0s2NusuG1Yth0izz5kNzd1_-vLb4m5sUoSUBVDOOcY"


def test_opens_credo_anoncrypt() -> None:
    kp = dk.KeyPair.from_seed(CREDO_RECIPIENT_SEED)
    opened = unpack(CREDO_ANONCRYPT, holder(kp))
    assert json.loads(opened.message) == {"@type": "https://didcomm.org/another-protocol/1.0"}
    assert opened.sender is None


@pytest.mark.parametrize("nonce_bytes", [12, 24])
@pytest.mark.parametrize("authcrypt", [True, False])
def test_round_trip(nonce_bytes: int, authcrypt: bool) -> None:
    me, you, other = (dk.KeyPair.from_seed(os.urandom(32)) for _ in range(3))
    message = json.dumps({"@type": "https://didcomm.org/trust_ping/1.0/ping", "x": "é" * 100}).encode()
    raw = pack(message, [other.verkey, you.verkey], me if authcrypt else None, nonce_bytes)
    env = parse(raw)
    header = json.loads(dk.b64decode_any(env["protected"]))
    assert header["typ"] == "JWM/1.0"
    assert header["enc"] == "xchacha20poly1305_ietf"
    assert header["alg"] == ("Authcrypt" if authcrypt else "Anoncrypt")
    assert [r["header"]["kid"] for r in header["recipients"]] == [other.b58, you.b58]
    assert len(dk.b64decode_any(env["iv"])) == nonce_bytes
    assert len(dk.b64decode_any(env["tag"])) == 16
    assert "=" not in raw.decode()
    for reader in (you, other):
        opened = unpack(env, holder(reader))
        assert opened.message == message
        assert opened.sender == (me.verkey if authcrypt else None)


def test_tampering_and_strangers_are_refused() -> None:
    me, you, stranger = (dk.KeyPair.from_seed(os.urandom(32)) for _ in range(3))
    env = parse(pack(b'{"a": 1}', [you.verkey], me))
    with pytest.raises(EnvelopeError):
        unpack(env, holder(stranger))
    for name in ("ciphertext", "tag", "iv"):
        bad = dict(env)
        raw = bytearray(dk.b64decode_any(bad[name]))
        raw[0] ^= 1
        bad[name] = dk.b64url(bytes(raw))
        with pytest.raises(EnvelopeError):
            unpack(bad, holder(you))
    # the AAD is the protected header as sent: re-encoding it (padding) breaks the tag
    bad = dict(env, protected=env["protected"] + "=" * (-len(env["protected"]) % 4 or 4))
    with pytest.raises(EnvelopeError):
        unpack(bad, holder(you))
    with pytest.raises(EnvelopeError):
        parse(b'{"protected": "x"}')


def test_did_key_and_peer_dids() -> None:
    kp = dk.KeyPair.from_seed(bytes(32))
    assert dk.did_key(kp.verkey).startswith("did:key:z6Mk")
    assert dk.verkey_from(dk.did_key(kp.verkey) + "#frag") == kp.verkey
    assert dk.verkey_from(kp.b58) == kp.verkey
    assert dk.b58decode(dk.b58encode(b"\0\0abc")) == b"\0\0abc"
    did = dk.peer2_did(kp, ["https://x.test/v1/didcomm"])
    assert dk.keys_of_did(did) == [kp.verkey]
    with pytest.raises(dk.DidError):
        dk.keys_of_did("did:web:example.com")
    with pytest.raises(dk.DidError):
        dk.verkey_from("did:key:z6LSbysY2xFMRpGMhb7tFTLMpeuPRaqaWM1yECx2AtzE3KCc")  # X25519, not Ed25519
