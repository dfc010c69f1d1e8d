"""Local stand-ins for the push providers the relay reaches directly, following their published
protocols (the real FCM and APNs cannot be reached from here), each over TLS from a per-test CA
(tests/support/tls_pki.py) and served by hypercorn:

* ``FcmServer``: Google's OAuth2 token endpoint for a service account (RFC 7523 JWT-bearer
  grant: the assertion's RS256 signature checked against the account's public key, its iss,
  aud, scope and lifetime) and FCM HTTP v1 ``POST /v1/projects/<id>/messages:send`` (the
  bearer token must be one it issued; FCM's error bodies for UNREGISTERED and an invalid
  ``message.token``).
* ``ApnsServer``: APNs' ``POST /3/device/<token>``, HTTP/2 only (ALPN h2; an HTTP/1.1 request
  is refused), token auth (ES256 provider token: signature by the .p8 key, kid, iss = team
  id, iat within the hour), apns-topic and apns-push-type checked; 410 Unregistered and 400
  BadDeviceToken as Apple answers them.

Each records what it accepted (``notifications``) and what it refused (``refusals``).
``webhook_server`` is the operator's own gateway on plain HTTP (RELAY_PUSH_WEBHOOK).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypercorn.asyncio import serve
from hypercorn.config import Config
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import ECKey, RSAKey
from relayfleet_testing.localredis import free_port

from tests.support.tls_pki import Pki

FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
APNS_MAX_PAYLOAD = 4096

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def _body(receive: Receive, limit: int = 1 << 20) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await receive()
        chunk = event.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ValueError("body too large")
        chunks.append(chunk)
        if not event.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Send, status: int, doc: Any = None, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(doc).encode() if doc is not None else b""
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if doc is not None:
        raw.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode().lower(): v.decode() for k, v in scope["headers"]}


async def _lifespan(scope: Scope, receive: Receive, send: Send) -> bool:
    """Answer hypercorn's lifespan scope (startup, then shutdown); False for any other scope."""
    if scope["type"] != "lifespan":
        return False
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
    return True


async def _arrivals(arrived: asyncio.Event, count: Callable[[], int], n: int, timeout: float) -> None:
    """Until `count()` reaches `n`; a server sets `arrived` at each arrival."""
    async with asyncio.timeout(timeout):
        while count() < n:
            arrived.clear()
            await arrived.wait()


@dataclass
class _Served:
    notifications: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[tuple[int, str]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def _refuse(self, status: int, why: str) -> None:
        self.refusals.append((status, why))
        self.arrived.set()

    async def wait_for(self, n: int, timeout: float = 10.0) -> None:
        await _arrivals(self.arrived, lambda: len(self.notifications), n, timeout)


@asynccontextmanager
async def _serving(app: Any, pki: Pki, alpn: list[str]) -> AsyncIterator[str]:
    config = Config()
    port = free_port()
    config.bind = [f"127.0.0.1:{port}"]
    config.certfile = str(pki.server_cert)
    config.keyfile = str(pki.server_key)
    config.alpn_protocols = alpn
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 2.0
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(serve(app, config, shutdown_trigger=stop.wait))
    tls = ssl.create_default_context(cafile=str(pki.ca))
    tls.set_alpn_protocols(alpn)
    for _ in range(500):  # listening? (a whole TLS handshake: a bare connect would hold shutdown)
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        w.close()
        await w.wait_closed()
        break
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


# -- FCM --------------------------------------------------------------------------------------
@dataclass
class FcmServer(_Served):
    project_id: str = "relayfleet-test"
    client_email: str = "push@relayfleet-test.iam.gserviceaccount.com"
    key: rsa.RSAPrivateKey = field(default_factory=lambda: rsa.generate_private_key(65537, 2048))
    key_id: str = field(default_factory=lambda: secrets.token_hex(8))
    unregistered: set[str] = field(default_factory=set)  # tokens FCM says are gone
    issued: set[str] = field(default_factory=set)
    token_grants: int = 0
    http_versions: set[str] = field(default_factory=set)

    def service_account(self) -> dict[str, Any]:
        """The JSON key file Google issues for a service account, pointing at this server."""
        pem = self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        return {
            "type": "service_account",
            "project_id": self.project_id,
            "private_key_id": self.key_id,
            "private_key": pem,
            "client_email": self.client_email,
            "client_id": "1234567890",
            "auth_uri": "https://accounts.example.invalid/o/oauth2/auth",
            "token_uri": self.url + "/token",
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await _lifespan(scope, receive, send):
            return
        self.http_versions.add(scope["http_version"])
        body = await _body(receive)
        path = scope["path"]
        if scope["method"] == "POST" and path == "/token":
            await self._token(send, body)
        elif scope["method"] == "POST" and path == f"/v1/projects/{self.project_id}/messages:send":
            await self._send(scope, send, body)
        else:
            self._refuse(404, path)
            await _answer(
                send, 404, {"error": {"code": 404, "status": "NOT_FOUND", "message": "no such method"}}
            )

    async def _token(self, send: Send, body: bytes) -> None:
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        try:
            if form.get("grant_type") != JWT_BEARER:
                raise ValueError("grant_type")
            tok = jwt.decode(
                form.get("assertion", ""), RSAKey.import_key(self.key.public_key()), algorithms=["RS256"]
            )
            if tok.header.get("kid") != self.key_id:
                raise ValueError("kid")
            jwt.JWTClaimsRegistry(
                iss={"essential": True, "value": self.client_email},
                aud={"essential": True, "value": self.url + "/token"},
                iat={"essential": True},
                exp={"essential": True},
                scope={"essential": True},
            ).validate(tok.claims)
            claims = tok.claims
            if FCM_SCOPE not in str(claims["scope"]).split() or claims["exp"] - claims["iat"] > 3600:
                raise ValueError("scope or lifetime")
        except (ValueError, KeyError, JoseError) as exc:
            self._refuse(400, f"token: {type(exc).__name__}")
            await _answer(send, 400, {"error": "invalid_grant", "error_description": str(exc)})
            return
        token = "ya29." + secrets.token_urlsafe(24)
        self.issued.add(token)
        self.token_grants += 1
        await _answer(send, 200, {"access_token": token, "expires_in": 3599, "token_type": "Bearer"})

    async def _send(self, scope: Scope, send: Send, body: bytes) -> None:
        auth = _headers(scope).get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:] not in self.issued:
            self._refuse(401, "bearer")
            err = {"code": 401, "status": "UNAUTHENTICATED", "message": "Request had invalid authentication"}
            await _answer(send, 401, {"error": err})
            return
        doc = json.loads(body)
        message = doc.get("message", {})
        token = message.get("token")
        if token in self.unregistered:
            self._refuse(404, "unregistered")
            details: list[dict[str, Any]] = [
                {"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": "UNREGISTERED"}
            ]
            err = {
                "code": 404,
                "status": "NOT_FOUND",
                "message": "Requested entity was not found.",
                "details": details,
            }
            await _answer(send, 404, {"error": err})
            return
        if not isinstance(token, str) or not token or ":" not in token:
            self._refuse(400, "invalid token")
            bad: list[dict[str, Any]] = [
                {
                    "@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                    "errorCode": "INVALID_ARGUMENT",
                },
                {
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": [
                        {"field": "message.token", "description": "Invalid registration token"}
                    ],
                },
            ]
            err = {"code": 400, "status": "INVALID_ARGUMENT", "message": "bad token", "details": bad}
            await _answer(send, 400, {"error": err})
            return
        data = message.get("data", {})
        if not all(isinstance(v, str) for v in data.values()):  # FCM: data values are strings
            self._refuse(400, "data")
            await _answer(
                send, 400, {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "data"}}
            )
            return
        self.notifications.append({"token": token, "message": message, "raw": body})
        self.arrived.set()
        await _answer(send, 200, {"name": f"projects/{self.project_id}/messages/{uuid.uuid4().hex}"})


# -- APNs -------------------------------------------------------------------------------------
@dataclass
class ApnsServer(_Served):
    team_id: str = "TEAM123456"
    key_id: str = "KEY1234567"
    topic: str = "org.relayfleet.wallet"
    key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    unregistered: set[str] = field(default_factory=set)

    def auth_key_p8(self) -> str:
        """The .p8 file Apple issues: the PKCS#8 PEM of a P-256 key."""
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await _lifespan(scope, receive, send):
            return
        body = await _body(receive)
        headers = _headers(scope)
        if scope["http_version"] != "2":  # APNs speaks HTTP/2 only
            self._refuse(505, scope["http_version"])
            await _answer(send, 505, {"reason": "HTTPVersionNotSupported"})
            return
        path = scope["path"]
        if scope["method"] != "POST" or not path.startswith("/3/device/"):
            self._refuse(404, path)
            await _answer(send, 404, {"reason": "BadPath"})
            return
        reason = self._auth(headers)
        if reason is not None:
            self._refuse(403, reason)
            await _answer(send, 403, {"reason": reason})
            return
        if headers.get("apns-topic") != self.topic:
            self._refuse(400, "topic")
            await _answer(send, 400, {"reason": "BadTopic" if "apns-topic" in headers else "MissingTopic"})
            return
        if headers.get("apns-push-type") not in ("alert", "background"):
            self._refuse(400, "push type")
            await _answer(send, 400, {"reason": "InvalidPushType"})
            return
        token = path[len("/3/device/") :]
        if token in self.unregistered:
            self._refuse(410, "unregistered")
            await _answer(send, 410, {"reason": "Unregistered", "timestamp": int(time.time() * 1000)})
            return
        if len(token) != 64 or any(c not in "0123456789abcdefABCDEF" for c in token):
            self._refuse(400, "bad token")
            await _answer(send, 400, {"reason": "BadDeviceToken"})
            return
        if len(body) > APNS_MAX_PAYLOAD:
            self._refuse(413, "payload")
            await _answer(send, 413, {"reason": "PayloadTooLarge"})
            return
        self.notifications.append(
            {"token": token, "headers": headers, "payload": json.loads(body), "raw": body}
        )
        self.arrived.set()
        await _answer(send, 200, headers={"apns-id": str(uuid.uuid4()).upper()})

    def _auth(self, headers: dict[str, str]) -> str | None:
        """None when the provider token is good, else APNs' reason."""
        auth = headers.get("authorization", "")
        if not auth.startswith("bearer "):
            return "MissingProviderToken"
        token = auth[len("bearer ") :]
        public = ECKey.import_key(
            self.key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        try:
            tok = jwt.decode(token, public, algorithms=["ES256"])
        except (JoseError, ValueError):
            return "InvalidProviderToken"
        if tok.header.get("alg") != "ES256" or tok.header.get("kid") != self.key_id:
            return "InvalidProviderToken"
        claims = tok.claims
        if "iss" not in claims or "iat" not in claims:
            return "InvalidProviderToken"
        if claims["iss"] != self.team_id:
            return "InvalidProviderToken"
        if time.time() - float(claims["iat"]) > 3600:
            return "ExpiredProviderToken"
        return None


@dataclass
class Webhook:
    """The operator's own gateway (RELAY_PUSH_WEBHOOK, or the queue push hook's): records each
    call, then answers with the next of `answers` (204 once they are used up), after `delay_s`."""

    url: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)  # statuses to answer, in order; then 204
    delay_s: float = 0.0
    answered: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for(self, n: int, timeout: float = 5.0) -> None:
        """Until `n` calls have arrived (answered or not)."""
        await _arrivals(self.arrived, lambda: len(self.calls), n, timeout)


@asynccontextmanager
async def webhook_server() -> AsyncIterator[Webhook]:
    hook = Webhook()

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        hook.raw.append(body)
        hook.calls.append(json.loads(body))
        hook.arrived.set()
        if hook.delay_s:
            await asyncio.sleep(hook.delay_s)
        status = hook.answers.pop(0) if hook.answers else 204
        hook.answered += 1
        return web.Response(status=status)

    app = web.Application()
    app.router.add_post("/push", receive)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    hook.url = str(server.make_url("/push"))
    try:
        yield hook
    finally:
        await server.close()


@asynccontextmanager
async def fcm_server(pki: Pki) -> AsyncIterator[FcmServer]:
    server = FcmServer()
    async with _serving(server, pki, ["h2", "http/1.1"]) as url:
        server.url = url
        yield server


@asynccontextmanager
async def apns_server(pki: Pki) -> AsyncIterator[ApnsServer]:
    server = ApnsServer()
    async with _serving(server, pki, ["h2"]) as url:
        server.url = url
        yield server


def write_credentials(directory: Path, fcm: FcmServer | None, apns: ApnsServer | None) -> Path:
    """RELAY_PUSH_CREDENTIALS_DIR as the mounted Secret lays it out."""
    directory.mkdir(parents=True, exist_ok=True)
    if fcm is not None:
        (directory / "fcm-service-account.json").write_text(json.dumps(fcm.service_account()))
    if apns is not None:
        (directory / "apns-auth-key.p8").write_text(apns.auth_key_p8())
        (directory / "apns-key-id").write_text(apns.key_id + "\n")
        (directory / "apns-team-id").write_text(apns.team_id + "\n")
        (directory / "apns-topic").write_text(apns.topic + "\n")
    return directory
