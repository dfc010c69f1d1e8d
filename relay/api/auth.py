"""Request authentication (DESIGN §3, contract).

Queue owners sign each request with their Ed25519 key:
  Authorization: Relay-Ed25519 key=<b64url>, ts=<unix s>, nonce=<b64url 16 B>, sig=<b64url 64 B>
over "relay-v1\\n" METHOD "\\n" PATH_AND_QUERY "\\n" ts "\\n" nonce "\\n" hex(sha256(body)).
Senders stay anonymous unless enqueue tokens are configured.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

from aiohttp import web
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from relay.api.errors import unauthorized
from relay.api.params import b64decode, b64encode
from relay.service import QueueService
from relay.settings import Settings

SCHEME = "Relay-Ed25519"


@dataclass(frozen=True, slots=True)
class Credentials:
    key: bytes
    ts: str
    nonce: str
    sig: bytes


def canonical(method: str, path_and_query: str, ts: str, nonce: str, body: bytes) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return f"relay-v1\n{method}\n{path_and_query}\n{ts}\n{nonce}\n{digest}".encode()


def sign_headers(private_key: bytes, method: str, path_and_query: str, body: bytes = b"") -> dict[str, str]:
    """Authorization header for a request (used by the client library and tests)."""
    import os

    sk = SigningKey(private_key)
    ts = str(int(time.time()))
    nonce = b64encode(os.urandom(16))
    sig = sk.sign(canonical(method, path_and_query, ts, nonce, body)).signature
    key = b64encode(bytes(sk.verify_key))
    return {"Authorization": f"{SCHEME} key={key}, ts={ts}, nonce={nonce}, sig={b64encode(sig)}"}


def keypair() -> tuple[bytes, bytes]:
    sk = SigningKey.generate()
    return bytes(sk.verify_key), bytes(sk)


def parse_header(value: str | None) -> Credentials:
    if not value:
        raise unauthorized("missing Authorization header")
    scheme, _, rest = value.strip().partition(" ")
    if scheme != SCHEME:
        raise unauthorized(f"Authorization scheme must be {SCHEME}")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, eq, val = part.strip().partition("=")
        if not eq or name in fields:
            raise unauthorized("malformed Authorization header")
        fields[name] = val.strip()
    if set(fields) != {"key", "ts", "nonce", "sig"}:
        raise unauthorized("Authorization needs exactly key, ts, nonce and sig")
    try:
        key, nonce, sig = b64decode(fields["key"]), b64decode(fields["nonce"]), b64decode(fields["sig"])
    except ValueError:
        raise unauthorized("key, nonce and sig must be base64url without padding") from None
    if len(key) != 32 or len(nonce) != 16 or len(sig) != 64:
        raise unauthorized("key must be 32 bytes, nonce 16 bytes and sig 64 bytes")
    if not fields["ts"].isascii() or not fields["ts"].isdigit() or len(fields["ts"]) > 12:
        raise unauthorized("ts must be unix seconds")
    return Credentials(key, fields["ts"], fields["nonce"], sig)


class Authenticator:
    def __init__(self, settings: Settings, service: QueueService) -> None:
        self.enabled = settings.auth != "none"
        self.skew = settings.auth_skew_s
        self.tokens = tuple(t.encode() for t in settings.enqueue_tokens)
        self.service = service

    async def verify(self, request: web.Request, recipient: bytes, body: bytes = b"") -> None:
        """Prove the caller holds `recipient`'s private key; raise 401 otherwise."""
        if not self.enabled:
            return
        await self.verify_header(
            request.headers.get("Authorization"), request.method, request.raw_path, recipient, body
        )

    async def verify_header(
        self, header: str | None, method: str, path_and_query: str, recipient: bytes, body: bytes
    ) -> None:
        creds = parse_header(header)
        if not hmac.compare_digest(creds.key, recipient):
            raise unauthorized("key does not match the queue's recipient")
        if abs(int(creds.ts) - time.time()) > self.skew:
            raise unauthorized("ts is outside the allowed clock skew")
        try:
            VerifyKey(creds.key).verify(
                canonical(method, path_and_query, creds.ts, creds.nonce, body), creds.sig
            )
        except (BadSignatureError, ValueError):
            raise unauthorized("signature does not verify") from None
        # recorded only after the signature checks out, so nobody can burn others' nonces
        fresh = await self.service.use_nonce(
            recipient, f"{b64encode(creds.key)}.{creds.nonce}", 2 * self.skew * 1000
        )
        if not fresh:
            raise unauthorized("nonce was already used")

    def verify_enqueue(self, request: web.Request) -> None:
        if not self.tokens:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme != "Bearer" or not any(hmac.compare_digest(token.strip().encode(), t) for t in self.tokens):
            raise unauthorized("enqueue requires a valid bearer token", "Bearer")
