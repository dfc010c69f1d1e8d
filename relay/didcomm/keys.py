"""Key encodings DIDComm v1 uses, and the mediator's identity derived from the fleet's seed.

Verkeys travel as base58 (envelope ``kid``, forward ``to``) or as ``did:key`` (Ed25519
multicodec 0xed01, multibase 'z' = base58btc); peers describe themselves with did:peer
(numalgo 2: keys and services in the DID, 4: a hashed JSON document, 1: a document
attached to the request) or a plain DID document.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

import nacl.bindings as sodium

from relay import boundedjson

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {ch: i for i, ch in enumerate(_B58)}
ED25519_CODEC = b"\xed\x01"
X25519_CODEC = b"\xec\x01"
JSON_CODEC = b"\x80\x04"  # varint of multicodec 0x0200 (json), did:peer:4's document
SHA256_MULTIHASH = b"\x12\x20"
DID_KEY = "did:key:"
MAX_DID = 16384  # a did:peer:4 long form carries a whole document; bound the work
# base58 decoding costs the square of the length (one big number): every caller passes a bound
# checked before decoding (docs/api.md, "Input limits"); a key is at most 47 characters
MAX_B58 = 64
MAX_PEER4_DOCUMENT = 8192  # base58 characters of a did:peer:4 document (~6 KB of JSON)


class DidError(ValueError):
    """A key or DID the mediator cannot use (the caller answers 4xx / problem-report)."""


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str, max_chars: int = MAX_B58) -> bytes:
    if len(text) > max_chars:
        raise DidError(f"base58 text longer than {max_chars} characters")
    n = _b58_value(text)
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def _b58_value(text: str) -> int:
    """The number `text` spells, halves joined by one multiplication (Karatsuba on large
    halves) instead of a multiply-add per digit on an ever longer number: 8,192 characters
    take ~5 ms instead of ~40."""
    if len(text) > 64:
        half = len(text) // 2
        scale: int = 58 ** (len(text) - half)
        return _b58_value(text[:half]) * scale + _b58_value(text[half:])
    n = 0
    for ch in text:
        i = _B58_INDEX.get(ch)
        if i is None:
            raise DidError("not base58")
        n = n * 58 + i
    return n


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64decode_any(text: str, max_chars: int | None = None) -> bytes:
    """base64 or base64url, padded or not (agents differ); longer than `max_chars` refused
    before decoding."""
    if not isinstance(text, str):
        raise DidError("expected a base64 string")
    if max_chars is not None and len(text) > max_chars:
        raise DidError(f"base64 text longer than {max_chars} characters")
    t = text.strip().replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(t + "=" * (-len(t) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise DidError("not base64") from None


def did_key(verkey: bytes) -> str:
    return DID_KEY + "z" + b58encode(ED25519_CODEC + verkey)


def fingerprint(verkey: bytes) -> str:
    return "z" + b58encode(ED25519_CODEC + verkey)


def _multibase_ed25519(text: str) -> bytes:
    if not text.startswith("z") or len(text) > 64:
        raise DidError("not a base58btc multibase key")
    raw = b58decode(text[1:])
    if len(raw) != 34 or not raw.startswith(ED25519_CODEC):
        raise DidError("not an Ed25519 key")
    return raw[2:]


def verkey_from(text: Any) -> bytes:
    """A 32-byte Ed25519 key from a base58 verkey or a did:key (a fragment is ignored)."""
    if not isinstance(text, str) or not text:
        raise DidError("a key must be a non-empty string")
    if text.startswith(DID_KEY):
        return _multibase_ed25519(text[len(DID_KEY) :].split("#", 1)[0])
    if len(text) > 50:
        raise DidError("not a base58 verkey")
    raw = b58decode(text)
    if len(raw) != 32:
        raise DidError("a verkey must be 32 bytes")
    return raw


@functools.lru_cache(maxsize=4096)
def to_x25519_public(verkey: bytes) -> bytes:
    """Cached: the conversion costs more than opening a sealed box, and the same few agents'
    keys come back on every message."""
    try:
        return bytes(sodium.crypto_sign_ed25519_pk_to_curve25519(verkey))
    except Exception:
        raise DidError("not a valid Ed25519 public key") from None


@dataclass(frozen=True)
class KeyPair:
    """An Ed25519 key and the X25519 key DIDComm v1 derives from it."""

    verkey: bytes
    sign_secret: bytes  # libsodium's 64-byte secret (seed || public)
    x_public: bytes
    x_secret: bytes

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        pk, sk = sodium.crypto_sign_seed_keypair(seed)
        return cls(
            verkey=bytes(pk),
            sign_secret=bytes(sk),
            x_public=bytes(sodium.crypto_sign_ed25519_pk_to_curve25519(pk)),
            x_secret=bytes(sodium.crypto_sign_ed25519_sk_to_curve25519(sk)),
        )

    @property
    def b58(self) -> str:
        return b58encode(self.verkey)

    @property
    def did_key(self) -> str:
        return did_key(self.verkey)

    def sign(self, data: bytes) -> bytes:
        return bytes(sodium.crypto_sign(data, self.sign_secret)[:64])


def verify(verkey: bytes, data: bytes, signature: bytes) -> bool:
    try:
        sodium.crypto_sign_open(signature + data, verkey)
    except Exception:
        return False
    return True


def read_seed(text: bytes) -> bytes:
    """The 32-byte seed in RELAY_DIDCOMM_SEED_FILE: 32 raw bytes, 64 hex digits or base64 of 32 bytes."""
    stripped = text.strip()
    if len(stripped) == 64:
        try:
            return bytes.fromhex(stripped.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    try:
        decoded = b64decode_any(stripped.decode("ascii"))
        if len(decoded) == 32:
            return decoded
    except (UnicodeDecodeError, DidError):
        pass
    if len(text) == 32:
        return text
    raise DidError("the DIDComm seed must be 32 bytes: raw, 64 hex digits or base64")


def derive(seed: bytes, purpose: bytes) -> bytes:
    return hashlib.sha256(b"relayfleet didcomm v1 " + purpose + b"\0" + seed).digest()


@dataclass(frozen=True)
class Identity:
    """Everything the fleet's mediator is, derived from its seed and public URL, so every relay
    given the same Secret and URL is the same mediator (same DID, keys, invitation)."""

    connection: KeyPair  # the invitation key and the key of the mediator's DID
    routing: KeyPair  # the routing key handed out in mediate-grant
    endpoint: str  # RELAY_PUBLIC_URL + /v1/didcomm
    ws_endpoint: str
    did: str  # did:peer:2 with both keys and both services
    invitation_id: str

    @classmethod
    def from_seed(cls, seed: bytes, public_url: str) -> Identity:
        base = public_url.rstrip("/")
        endpoint = base + "/v1/didcomm"
        if base.startswith("https://"):
            ws = "wss://" + base[len("https://") :] + "/v1/didcomm/ws"
        elif base.startswith("http://"):
            ws = "ws://" + base[len("http://") :] + "/v1/didcomm/ws"
        else:
            raise DidError("RELAY_PUBLIC_URL must start with http:// or https://")
        conn = KeyPair.from_seed(derive(seed, b"connection"))
        routing = KeyPair.from_seed(derive(seed, b"routing"))
        did = peer2_did(conn, [endpoint, ws])
        inv = str(uuid.UUID(bytes=derive(seed + base.encode(), b"invitation")[:16], version=4))
        return cls(conn, routing, endpoint, ws, did, inv)

    def keypair_for(self, verkey: bytes) -> KeyPair | None:
        for kp in (self.connection, self.routing):
            if kp.verkey == verkey:
                return kp
        return None


def peer2_did(kp: KeyPair, endpoints: list[str]) -> str:
    """did:peer:2 as Credo builds one for DIDComm v1: V (Ed25519, #key-1), E (X25519, #key-2),
    one abbreviated did-communication service per endpoint naming #key-1."""
    parts = ["did:peer:2", ".V" + fingerprint(kp.verkey), ".Ez" + b58encode(X25519_CODEC + kp.x_public)]
    for priority, endpoint in enumerate(endpoints):
        service = {
            "t": "did-communication",
            "priority": priority,
            "recipientKeys": ["#key-1"],
            "r": [],
            "s": endpoint,
            "a": ["didcomm/aip1", "didcomm/aip2;env=rfc19"],
        }
        parts.append(".S" + b64url(json.dumps(service, separators=(",", ":")).encode()))
    return "".join(parts)


# -- what a peer's DID says -------------------------------------------------------------


def _method_key(method: Any) -> bytes | None:
    """The Ed25519 key of a verification method, or None for other key types."""
    if not isinstance(method, dict):
        return None
    kind = method.get("type")
    if kind in ("Ed25519VerificationKey2018", "Ed25519VerificationKey2020", "Multikey"):
        if isinstance(method.get("publicKeyBase58"), str):
            try:
                raw = b58decode(method["publicKeyBase58"])
            except DidError:
                return None
            return raw if len(raw) == 32 else None
        if isinstance(method.get("publicKeyMultibase"), str):
            try:
                return _multibase_ed25519(method["publicKeyMultibase"])
            except DidError:
                return None
    return None


def keys_of_document(doc: Any) -> list[bytes]:
    """The DIDComm v1 recipient keys of a DID document: its did-communication services'
    recipientKeys (did:key, base58 or references), else every Ed25519 authentication key."""
    if not isinstance(doc, dict):
        raise DidError("a DID document must be a JSON object")
    methods: dict[str, bytes] = {}
    for section in ("verificationMethod", "authentication", "publicKey"):
        entries = doc.get(section)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            key = _method_key(entry)
            if key is not None and isinstance(entry.get("id"), str):
                methods[entry["id"].rsplit("#", 1)[-1]] = key
    found: list[bytes] = []
    services = doc.get("service")
    for service in services if isinstance(services, list) else []:
        if not isinstance(service, dict) or service.get("type") not in ("did-communication", "IndyAgent"):
            continue
        for ref in service.get("recipientKeys") or []:
            if not isinstance(ref, str):
                continue
            if ref.startswith(DID_KEY) or "#" not in ref:
                with contextlib.suppress(DidError):
                    found.append(verkey_from(ref))
            elif (key := methods.get(ref.rsplit("#", 1)[-1])) is not None:
                found.append(key)
    if not found:
        found = list(dict.fromkeys(methods.values()))
    if not found:
        raise DidError("the DID document names no Ed25519 recipient key")
    return list(dict.fromkeys(found))


def _peer2_keys(did: str) -> list[bytes]:
    keys: list[bytes] = []
    for entry in did[len("did:peer:2") :].split(".")[1:]:
        if entry[:1] == "V":
            keys.append(_multibase_ed25519(entry[1:]))
    if not keys:
        raise DidError("the did:peer:2 has no Ed25519 (V) key")
    return keys


def _peer4_document(did: str) -> dict[str, Any]:
    body = did[len("did:peer:4") :]
    if ":" not in body:
        raise DidError("a short-form did:peer:4 cannot be resolved; send the long form")
    digest, encoded = body.split(":", 1)
    if not encoded.startswith("z") or not digest.startswith("z"):
        raise DidError("not a did:peer:4")
    expected = "z" + b58encode(SHA256_MULTIHASH + hashlib.sha256(encoded.encode()).digest())
    if digest != expected:
        raise DidError("the did:peer:4 hash does not match its document")
    raw = b58decode(encoded[1:], MAX_PEER4_DOCUMENT)
    if not raw.startswith(JSON_CODEC):
        raise DidError("the did:peer:4 document is not JSON")
    try:
        doc = boundedjson.loads(raw[len(JSON_CODEC) :], MAX_PEER4_DOCUMENT, "the did:peer:4 document")
    except boundedjson.JsonLimitError as exc:
        raise DidError(exc.text) from None
    if not isinstance(doc, dict):
        raise DidError("the did:peer:4 document is not a JSON object")
    return doc


def keys_of_did(did: Any, attached: dict[str, Any] | None = None) -> list[bytes]:
    """The recipient keys a peer's DID stands for: did:key, did:peer:0/2/4 from the DID itself,
    anything else from the (verified) attached document."""
    if not isinstance(did, str) or not did.startswith("did:") or len(did) > MAX_DID:
        raise DidError("did must be a DID")
    if did.startswith(DID_KEY):
        return [verkey_from(did)]
    if did.startswith("did:peer:0"):
        return [_multibase_ed25519(did[len("did:peer:0") :])]
    if did.startswith("did:peer:2"):
        return _peer2_keys(did)
    if did.startswith("did:peer:4"):
        return keys_of_document(_peer4_document(did))
    if attached is not None:
        return keys_of_document(attached)
    raise DidError("the DID is not resolvable here (did:key, did:peer:0/2/4, or attach the document)")
