"""The wire protocol's encodings, shared by the server and the client library (docs/api.md).

A leaf: it imports nothing from the relay server, the fleet or storage, so
`relay.client` (and any app embedding it) pulls in only this, aiohttp's client and
PyNaCl. Queue owners sign each request with their Ed25519 key:

  Authorization: Relay-Ed25519 key=<b64url>, ts=<unix s>, nonce=<b64url 16 B>, sig=<b64url 64 B>

over "relay-v1\\n" METHOD "\\n" PATH_AND_QUERY "\\n" ts "\\n" nonce "\\n" hex(sha256(body)).
"""

from __future__ import annotations

import binascii
import hashlib
import os
import re
import time
from dataclasses import dataclass
from typing import NamedTuple

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

SCHEME = "Relay-Ed25519"
KEY_BYTES = 32
NONCE_BYTES = 16
SIG_BYTES = 64

_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")
_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")
_URLSAFE = bytes.maketrans(b"+/", b"-_")


def b64decode(text: str) -> bytes:
    """Unpadded base64url; ValueError for anything else."""
    if not _B64URL.fullmatch(text):  # not .match: `$` also matches before a final newline
        raise ValueError("not base64url without padding")
    return b64decode_alphabet(text.encode("ascii"))  # the regex made it ASCII of that alphabet


def b64decode_alphabet(data: bytes) -> bytes:
    """b64decode for ASCII a parser already matched as base64url characters ([A-Za-z0-9_-]):
    the same bytes or ValueError, without the regex and the str round trip (what
    base64.urlsafe_b64decode does, minus two Python layers)."""
    if len(data) % 4 == 1:
        raise ValueError("not base64url without padding")
    try:
        return binascii.a2b_base64(data.translate(_FROM_URLSAFE) + b"=" * (-len(data) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url without padding") from None


def b64encode(data: bytes) -> str:
    # binascii + translate: what base64.urlsafe_b64encode does, minus two Python layers
    return binascii.b2a_base64(data, newline=False).translate(_URLSAFE).rstrip(b"=").decode("ascii")


@dataclass(frozen=True, slots=True)
class Credentials:
    """A parsed Authorization header (nonce kept as sent: it is part of the signed text)."""

    key: bytes
    ts: str
    nonce: str
    sig: bytes


def canonical(method: str, path_and_query: str, ts: str, nonce: str, body: bytes) -> bytes:
    """The exact bytes a request signature covers."""
    digest = hashlib.sha256(body).hexdigest()
    return f"relay-v1\n{method}\n{path_and_query}\n{ts}\n{nonce}\n{digest}".encode()


def authorization(key: bytes, ts: str, nonce: str, sig: bytes) -> str:
    """The Authorization header value for already-computed credentials."""
    return f"{SCHEME} key={b64encode(key)}, ts={ts}, nonce={nonce}, sig={b64encode(sig)}"


def sign_headers(private_key: bytes, method: str, path_and_query: str, body: bytes = b"") -> dict[str, str]:
    """Authorization header for a request (used by the client library and tests)."""
    sk = SigningKey(private_key)
    ts = str(int(time.time()))
    nonce = b64encode(os.urandom(NONCE_BYTES))
    sig = sk.sign(canonical(method, path_and_query, ts, nonce, body)).signature
    return {"Authorization": authorization(bytes(sk.verify_key), ts, nonce, sig)}


class KeyPair(NamedTuple):
    """An Ed25519 key pair, raw 32-byte halves, in the order `relayfleet keygen` prints them."""

    public: bytes
    private: bytes


def keypair() -> KeyPair:
    """A fresh Ed25519 key pair: `public, private = keypair()`, or `.public` / `.private`."""
    sk = SigningKey.generate()
    return KeyPair(bytes(sk.verify_key), bytes(sk))


def key_bytes(key: bytes | str, what: str = "key") -> bytes:
    """A 32-byte key given raw or as the base64url text `relayfleet keygen` prints; ValueError
    naming `what` otherwise."""
    if isinstance(key, str):
        try:
            key = b64decode(key.strip())
        except ValueError:
            raise ValueError(f"{what} must be 32 bytes or their base64url text (as keygen prints)") from None
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ValueError(f"{what} must be 32 bytes or their base64url text (as keygen prints)")
    return bytes(key)


def public_key_of(private_key: bytes | str) -> bytes:
    """The public half of an Ed25519 private key (raw or base64url)."""
    return bytes(SigningKey(key_bytes(private_key, "private key")).verify_key)


def parse_authorization(value: str | None) -> Credentials:
    """Parse a Relay-Ed25519 header; ValueError carries the contract's 401 text."""
    if not value:
        raise ValueError("missing Authorization header")
    scheme, _, rest = value.strip().partition(" ")
    if scheme != SCHEME:
        raise ValueError(f"Authorization scheme must be {SCHEME}")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, eq, val = part.strip().partition("=")
        if not eq or name in fields:
            raise ValueError("malformed Authorization header")
        fields[name] = val.strip()
    if set(fields) != {"key", "ts", "nonce", "sig"}:
        raise ValueError("Authorization needs exactly key, ts, nonce and sig")
    try:
        key, nonce, sig = b64decode(fields["key"]), b64decode(fields["nonce"]), b64decode(fields["sig"])
    except ValueError:
        raise ValueError("key, nonce and sig must be base64url without padding") from None
    if len(key) != KEY_BYTES or len(nonce) != NONCE_BYTES or len(sig) != SIG_BYTES:
        raise ValueError("key must be 32 bytes, nonce 16 bytes and sig 64 bytes")
    if not fields["ts"].isascii() or not fields["ts"].isdigit() or len(fields["ts"]) > 12:
        raise ValueError("ts must be unix seconds")
    return Credentials(key, fields["ts"], fields["nonce"], sig)


def signature_valid(creds: Credentials, method: str, path_and_query: str, body: bytes) -> bool:
    """Whether `creds.sig` is `creds.key`'s signature over this request."""
    try:
        VerifyKey(creds.key).verify(canonical(method, path_and_query, creds.ts, creds.nonce, body), creds.sig)
    except (BadSignatureError, ValueError):
        return False
    return True
