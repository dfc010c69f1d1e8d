"""The DIDs DIDComm v2 peers use here: did:peer:2 (keys and services inside the DID) and did:key,
resolved to what the v2 mediator needs of a DID document: its key-agreement keys (X25519 or
P-256, to encrypt to and to check an authcrypt sender), its authentication keys (Ed25519, to
check a JWS) and its DIDCommMessaging services.

did:peer:2 is ``did:peer:2`` followed by ``.<purpose><multibase key>`` (E: key agreement,
V: authentication) and ``.S<base64url JSON>`` service entries, abbreviated: ``t`` type
(``dm`` = DIDCommMessaging), ``s`` serviceEndpoint, ``r`` routingKeys, ``a`` accept. Two service
encodings are in use: the current one, ``"s": {"uri": ..., "a": [...], "r": [...]}``, and the
older one, ``"s": "https://..."`` with ``r``/``a`` beside it; base64url may come padded or not.
Keys are named ``#key-1``, ``#key-2``... in order; older resolvers named them by their multibase
text (``#6LS...`` or ``#z6LS...``): every name resolves here, and a reply names the mediator's
own key the way the peer named it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from relay import boundedjson
from relay.didcomm.keys import DidError, b58decode, b58encode, b64decode_any, b64url

__all__ = [
    "ED25519",
    "P256",
    "X25519",
    "Resolved",
    "Service",
    "VerificationKey",
    "did_of",
    "encode_peer2",
    "resolve",
]

ED25519 = b"\xed\x01"
X25519 = b"\xec\x01"
P256 = b"\x80\x24"  # compressed point, multicodec 0x1200
MAX_DID = 8192  # a did:peer:2 with a few keys and services is under 2 KiB
MAX_ENTRIES = 16  # keys and services of one did:peer:2
MAX_SERVICE = 2048  # base64url characters of one service entry
MAX_KEY_TEXT = 64  # multibase characters of one key (P-256 compressed: 48)


@dataclass(frozen=True)
class VerificationKey:
    """One key of a DID: `crv` X25519 / Ed25519 / P-256, `raw` the public key bytes (P-256:
    the 33-byte compressed point), `kid` its canonical DID URL."""

    kid: str
    crv: str
    raw: bytes

    def jwk(self) -> dict[str, str | list[str]]:
        if self.crv == "P-256":
            x, y = _p256_xy(self.raw)
            return {"kty": "EC", "crv": "P-256", "x": b64url(x), "y": b64url(y), "kid": self.kid}
        return {"kty": "OKP", "crv": self.crv, "x": b64url(self.raw), "kid": self.kid}


@dataclass(frozen=True)
class Service:
    uri: str
    routing_keys: tuple[str, ...] = ()
    accept: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resolved:
    did: str
    agreement: tuple[VerificationKey, ...]
    authentication: tuple[VerificationKey, ...]
    services: tuple[Service, ...] = ()
    aliases: dict[str, VerificationKey] = field(default_factory=dict)  # fragment -> key

    def key(self, kid: str) -> VerificationKey | None:
        """The key a DID URL of this DID names, under any of the names resolvers give it."""
        did, _, fragment = kid.partition("#")
        if did != self.did or not fragment:
            return None
        return self.aliases.get(fragment)


def did_of(text: str) -> str:
    """The DID of a DID URL (its fragment and query cut off)."""
    return text.split("#", 1)[0].split("?", 1)[0]


def multibase(codec: bytes, raw: bytes) -> str:
    return "z" + b58encode(codec + raw)


def _key(text: str) -> tuple[str, bytes]:
    if not text.startswith("z") or len(text) > MAX_KEY_TEXT:
        raise DidError("a key must be base58btc multibase")
    raw = b58decode(text[1:])
    for codec, crv, size in ((X25519, "X25519", 32), (ED25519, "Ed25519", 32), (P256, "P-256", 33)):
        if raw.startswith(codec) and len(raw) == len(codec) + size:
            return crv, raw[len(codec) :]
    raise DidError("a key must be X25519, Ed25519 or P-256")


def _p256_xy(compressed: bytes) -> tuple[bytes, bytes]:
    # cryptography is joserfc's own dependency: the point's y from its compressed form
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        point = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), compressed)
    except ValueError:
        raise DidError("not a P-256 point") from None
    numbers = point.public_numbers()
    return numbers.x.to_bytes(32, "big"), numbers.y.to_bytes(32, "big")


def _services(encoded: str) -> list[Service]:
    """The services of one S entry: one JSON object, or an array of them (Identus writes all
    its services as one array, and ``[]`` when it has none)."""
    if len(encoded) > MAX_SERVICE:
        raise DidError(f"a did:peer:2 service exceeds {MAX_SERVICE} characters")
    try:
        doc = boundedjson.loads(b64decode_any(encoded), MAX_SERVICE, "a did:peer:2 service", 6)
    except boundedjson.JsonLimitError as exc:
        raise DidError(exc.text) from None
    except DidError:
        raise DidError("a did:peer:2 service is not base64url") from None
    entries = doc if isinstance(doc, list) else [doc]
    return [_service(entry) for entry in entries]


def _service(doc: Any) -> Service:
    if not isinstance(doc, dict):
        raise DidError("a did:peer:2 service must be a JSON object")
    endpoint = doc.get("s", doc.get("serviceEndpoint"))
    routing, accept = doc.get("r", doc.get("routingKeys")), doc.get("a", doc.get("accept"))
    if isinstance(endpoint, dict):  # the current encoding: the endpoint object holds r and a
        routing = endpoint.get("r", endpoint.get("routingKeys", routing))
        accept = endpoint.get("a", endpoint.get("accept", accept))
        endpoint = endpoint.get("uri")
    if not isinstance(endpoint, str):
        raise DidError("a did:peer:2 service needs an endpoint URI")
    return Service(endpoint, _strings(routing), _strings(accept))


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def resolve(did: Any) -> Resolved:
    """The keys and services of a did:peer:2 or did:key (a DID URL's fragment ignored)."""
    if not isinstance(did, str) or len(did) > MAX_DID:
        raise DidError(f"a DID must be a string of at most {MAX_DID} characters")
    return _resolve(did_of(did))


@functools.lru_cache(maxsize=1024)
def _resolve(did: str) -> Resolved:
    """Cached: the same few peers' DIDs come with every message, and decoding one costs ~0.7 ms
    (base58, JSON); at most 1,024 DIDs of at most 8 KiB held."""
    if did.startswith("did:peer:2."):
        return _peer2(did)
    if did.startswith("did:key:"):
        return _did_key(did)
    raise DidError("only did:peer:2 and did:key resolve here")


def _peer2(did: str) -> Resolved:
    entries = did[len("did:peer:2.") :].split(".")
    if len(entries) > MAX_ENTRIES:
        raise DidError(f"a did:peer:2 has more than {MAX_ENTRIES} entries")
    agreement: list[VerificationKey] = []
    authentication: list[VerificationKey] = []
    services: list[Service] = []
    aliases: dict[str, VerificationKey] = {}
    number = 0
    for position, entry in enumerate(entries, 1):
        purpose, body = entry[:1], entry[1:]
        if purpose == "S":
            services.extend(_services(body))
            continue
        if purpose not in ("E", "V", "A", "I", "D"):
            raise DidError("a did:peer:2 entry has an unknown purpose")
        number += 1
        crv, raw = _key(body)
        vk = VerificationKey(f"{did}#key-{number}", crv, raw)
        # resolvers name a key by its count among keys (the method spec), by its position among
        # all entries (Identus; the same when keys come first) or by its multibase text
        for alias in (f"key-{number}", f"key-{position}", body, body[1:]):
            aliases.setdefault(alias, vk)
        if purpose == "E":
            if crv == "Ed25519":
                raise DidError("a key-agreement key must be X25519 or P-256")
            agreement.append(vk)
        elif purpose == "V":
            authentication.append(vk)
    return Resolved(did, tuple(agreement), tuple(authentication), tuple(services), aliases)


def _did_key(did: str) -> Resolved:
    text = did[len("did:key:") :]
    crv, raw = _key(text)
    aliases: dict[str, VerificationKey] = {}
    if crv == "Ed25519":
        # the X25519 key a did:key of an Ed25519 key stands for (the did:key method's derivation)
        import nacl.bindings as sodium

        try:
            x = bytes(sodium.crypto_sign_ed25519_pk_to_curve25519(raw))
        except Exception:
            raise DidError("not a valid Ed25519 public key") from None
        x_text = multibase(X25519, x)
        sign = VerificationKey(f"{did}#{text}", "Ed25519", raw)
        agree = VerificationKey(f"{did}#{x_text}", "X25519", x)
        aliases.update({text: sign, text[1:]: sign, x_text: agree, x_text[1:]: agree})
        return Resolved(did, (agree,), (sign,), (), aliases)
    vk = VerificationKey(f"{did}#{text}", crv, raw)
    aliases.update({text: vk, text[1:]: vk})
    return Resolved(did, (vk,), (), (), aliases)


def encode_peer2(agreement: bytes, authentication: bytes, endpoints: list[str], accept: list[str]) -> str:
    """A did:peer:2 of one X25519 key (#key-1), one Ed25519 key (#key-2) and one DIDCommMessaging
    service per endpoint, in the current encoding (``"s": {"uri": ...}``, unpadded base64url):
    clients send to the first service they can reach."""
    parts = ["did:peer:2", ".E" + multibase(X25519, agreement), ".V" + multibase(ED25519, authentication)]
    for endpoint in endpoints:
        service = {"t": "dm", "s": {"uri": endpoint, "a": accept, "r": []}}
        parts.append(".S" + b64url(json.dumps(service, separators=(",", ":")).encode()))
    return "".join(parts)
