"""Where a device notification goes: the operator's own gateway (RELAY_PUSH_WEBHOOK), Firebase
Cloud Messaging's HTTP v1 API, Apple's APNs over HTTP/2. Each send is retried through
relay/retrying.py (PUSH_WEBHOOK: connection errors, timeouts, 429 and 5xx, honouring
Retry-After up to 5 s); a provider's "this token is dead" answer is final and reported as
UNREGISTERED so the caller removes the device. A notification carries the count of messages
waiting and the RFC's `@type`, never a payload, message id or key; logs never name a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson
from joserfc import jwt
from joserfc.jwk import ECKey, RSAKey

from relay import metrics
from relay.didcomm.records import Device
from relay.retrying import PUSH_WEBHOOK, Policy, retrying

log = logging.getLogger("relay.devicepush")

TIMEOUT_S = 5.0
MAX_RETRY_AFTER_S = 5.0
MAX_ANSWER = 65536  # bytes of a provider's answer read (an error's JSON is small)
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
FCM_TYPE = "https://didcomm.org/push-notifications-fcm"
APNS_TYPE = "https://didcomm.org/push-notifications-apns"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
ACCESS_TOKEN_LIFE_S = 3600  # Google's maximum for a self-signed assertion
APNS_TOKEN_REFRESH_S = 30 * 60  # Apple: refresh no more than every 20 min, tokens die at 60
APNS_DEAD_REASONS = frozenset({"BadDeviceToken", "Unregistered"})


class Outcome(enum.Enum):
    SENT = "sent"
    FAILED = "failed"  # retries exhausted
    REJECTED = "rejected"  # a final refusal not about the token (credentials, the request)
    UNREGISTERED = "unregistered"  # the token is dead: remove the device


class _Retry(Exception):
    """Worth another attempt (429, 5xx, an expired credential), after `retry_after_s`."""

    def __init__(self, retry_after_s: float = 0.0) -> None:
        super().__init__(retry_after_s)
        self.retry_after_s = retry_after_s


class _Final(Exception):
    def __init__(self, outcome: Outcome, why: str) -> None:
        super().__init__(why)
        self.outcome = outcome
        self.why = why


def _retry_after(resp: httpx.Response) -> float:
    with contextlib.suppress(ValueError):
        return min(max(float(resp.headers.get("retry-after", "0")), 0.0), MAX_RETRY_AFTER_S)
    return 0.0


def _word(value: Any) -> str:
    """A provider's reason code, for a log line: a short word or nothing."""
    return value if isinstance(value, str) and len(value) <= 40 and value.isalnum() else ""


def _json(resp: httpx.Response) -> Any:
    try:
        return orjson.loads(resp.content[:MAX_ANSWER]) if resp.content else None
    except orjson.JSONDecodeError:
        return None


class Provider(Protocol):
    name: str  # the metrics' provider label

    def groups(self, devices: Sequence[Device]) -> list[tuple[Device, ...]]:
        """The sends a burst for these devices makes: one per group."""
        ...

    async def send(self, group: tuple[Device, ...], count: int) -> Outcome: ...

    async def close(self) -> None: ...


class _Http:
    """One HTTP client and the retry loop every provider shares."""

    name = "?"

    def __init__(self, client: httpx.AsyncClient, policy: Policy = PUSH_WEBHOOK) -> None:
        self.client = client
        self.policy = policy

    async def close(self) -> None:
        await self.client.aclose()

    def _wait_s(self, exc: BaseException, retry: int) -> float:
        asked = exc.retry_after_s if isinstance(exc, _Retry) else 0.0
        return max(asked, self.policy.wait_s(retry))

    def _retried(self, _: BaseException, __: float) -> None:
        metrics.DEVICE_PUSH.labels(self.name, "retried").inc()

    async def _attempts(self, attempt: Callable[[], Awaitable[None]]) -> Outcome:
        failures = (_Retry, httpx.TransportError, OSError)
        try:
            await retrying(self.policy, failures, wait=self._wait_s, on_retry=self._retried)(attempt)
        except _Final as exc:
            if exc.outcome is Outcome.REJECTED:
                log.warning("push provider %s refused a notification: %s", self.name, exc.why)
            return exc.outcome
        except failures as exc:
            log.warning(
                "push provider %s failed %s times (%s); notification dropped",
                self.name,
                self.policy.attempts,
                type(exc).__name__,
            )
            return Outcome.FAILED
        return Outcome.SENT


# The HTTP stack's own loggers name each request's URL (httpx at INFO; APNs puts the device
# token in the path) and header values (hpack, httpcore at DEBUG): never below WARNING.
QUIET_LOGGERS = ("httpx", "httpcore", "hpack", "h2")


def http_client(ca_file: str | None, http2: bool = False) -> httpx.AsyncClient:
    """A client for one provider: TLS checked against `ca_file` (else the system's CAs)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    verify: Any = True
    if ca_file:
        verify = ssl.create_default_context(cafile=ca_file)
    return httpx.AsyncClient(
        http2=http2, verify=verify, timeout=TIMEOUT_S, follow_redirects=False, trust_env=False
    )


# -- the operator's gateway ------------------------------------------------------------------
class WebhookProvider(_Http):
    """RELAY_PUSH_WEBHOOK for devices: one POST per burst, naming every device of the
    connection (`{"type": "didcomm-devices", "count", "devices": [{"service", "device_token",
    "device_platform"}]}`); the gateway talks to FCM/APNs itself. 4xx (but 429) is final."""

    name = "webhook"

    def __init__(self, url: str, client: httpx.AsyncClient, policy: Policy = PUSH_WEBHOOK) -> None:
        super().__init__(client, policy)
        self.url = url

    def groups(self, devices: Sequence[Device]) -> list[tuple[Device, ...]]:
        return [tuple(devices)] if devices else []

    async def send(self, group: tuple[Device, ...], count: int) -> Outcome:
        body = orjson.dumps(
            {
                "type": "didcomm-devices",
                "count": count,
                "devices": [
                    {"service": d.service, "device_token": d.token, "device_platform": d.platform}
                    for d in group
                ],
            }
        )

        async def attempt() -> None:
            resp = await self.client.post(
                self.url, content=body, headers={"Content-Type": "application/json"}
            )
            if resp.is_success:
                return
            if resp.status_code == 429 or resp.status_code >= 500:
                raise _Retry(_retry_after(resp))
            raise _Final(Outcome.REJECTED, f"HTTP {resp.status_code}")

        return await self._attempts(attempt)


# -- Firebase Cloud Messaging, HTTP v1 -------------------------------------------------------
@dataclass(frozen=True)
class FcmCredentials:
    """The fields of a Google service-account JSON file FCM's OAuth2 exchange needs."""

    project_id: str
    client_email: str
    private_key: str  # PEM, RSA
    private_key_id: str
    token_uri: str

    @classmethod
    def parse(cls, raw: bytes) -> FcmCredentials:
        doc = orjson.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        fields = {}
        for name in ("project_id", "client_email", "private_key"):
            value = doc.get(name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} missing")
            fields[name] = value
        key_id = doc.get("private_key_id")
        uri = doc.get("token_uri") or "https://oauth2.googleapis.com/token"
        if not isinstance(uri, str) or not uri.startswith(("https://", "http://")):
            raise ValueError("token_uri is not an http(s) URL")
        creds = cls(
            fields["project_id"],
            fields["client_email"],
            fields["private_key"],
            key_id if isinstance(key_id, str) else "",
            uri,
        )
        creds.assertion(int(time.time()))  # the key signs, or this file is refused now
        return creds

    def assertion(self, now: int) -> str:
        """The signed JWT exchanged for an access token (RFC 7523, RS256)."""
        claims = {
            "iss": self.client_email,
            "scope": FCM_SCOPE,
            "aud": self.token_uri,
            "iat": now,
            "exp": now + ACCESS_TOKEN_LIFE_S,
        }
        header = {"alg": "RS256", **({"kid": self.private_key_id} if self.private_key_id else {})}
        return jwt.encode(header, claims, RSAKey.import_key(self.private_key), algorithms=["RS256"])


class FcmProvider(_Http):
    """POST {base}/v1/projects/<project>/messages:send with an OAuth2 access token from the
    service account (JWT-bearer grant at its token_uri, cached until a minute before it
    expires). A data message: `@type` and `message_count` (FCM data values are strings).
    UNREGISTERED: a 404, an FCM errorCode UNREGISTERED, or INVALID_ARGUMENT naming
    message.token."""

    name = "fcm"

    def __init__(
        self, creds: FcmCredentials, base_url: str, client: httpx.AsyncClient, policy: Policy = PUSH_WEBHOOK
    ) -> None:
        super().__init__(client, policy)
        self.creds = creds
        self.url = f"{base_url.rstrip('/')}/v1/projects/{creds.project_id}/messages:send"
        self._token: tuple[str, float] | None = None  # (access token, monotonic expiry)
        self._lock = asyncio.Lock()

    def groups(self, devices: Sequence[Device]) -> list[tuple[Device, ...]]:
        return [(d,) for d in devices if d.service == "fcm"]

    async def access_token(self) -> str:
        async with self._lock:  # one exchange at a time; the rest reuse its token
            if self._token is not None and self._token[1] > time.monotonic():
                return self._token[0]
            form = {"grant_type": JWT_BEARER, "assertion": self.creds.assertion(int(time.time()))}
            resp = await self.client.post(self.creds.token_uri, data=form)
            if resp.status_code == 429 or resp.status_code >= 500:
                raise _Retry(_retry_after(resp))
            doc = _json(resp)
            token = doc.get("access_token") if isinstance(doc, dict) and resp.is_success else None
            if not isinstance(token, str) or not token:
                raise _Final(Outcome.REJECTED, f"the OAuth2 token endpoint answered HTTP {resp.status_code}")
            life = doc.get("expires_in", 3600)
            life_s = float(life) if isinstance(life, int | float) else 3600.0
            self._token = (token, time.monotonic() + max(0.0, life_s - 60.0))
            return token

    async def send(self, group: tuple[Device, ...], count: int) -> Outcome:
        (device,) = group
        body = orjson.dumps(
            {
                "message": {
                    "token": device.token,
                    "data": {"@type": FCM_TYPE, "message_count": str(count)},
                    "android": {"priority": "high"},
                }
            }
        )

        async def attempt() -> None:
            token = await self.access_token()
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            resp = await self.client.post(self.url, content=body, headers=headers)
            if resp.is_success:
                return
            if resp.status_code == 401:  # revoked or expired early: a fresh one, once more
                self._token = None
                raise _Retry()
            if resp.status_code == 429 or resp.status_code >= 500:
                raise _Retry(_retry_after(resp))
            if _fcm_token_dead(resp.status_code, _json(resp)):
                raise _Final(Outcome.UNREGISTERED, "token unregistered")
            raise _Final(Outcome.REJECTED, f"HTTP {resp.status_code}")

        return await self._attempts(attempt)


def _fcm_token_dead(status: int, doc: Any) -> bool:
    """FCM v1's answers for a token that will never work again (its error reference)."""
    if status == 404:
        return True
    error = doc.get("error") if isinstance(doc, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    codes: set[str] = set()
    fields: set[str] = set()
    for d in details if isinstance(details, list) else []:
        if not isinstance(d, dict):
            continue
        if isinstance(d.get("errorCode"), str):
            codes.add(d["errorCode"])
        for v in d.get("fieldViolations") or []:
            if isinstance(v, dict) and isinstance(v.get("field"), str):
                fields.add(v["field"])
    if "UNREGISTERED" in codes:
        return True
    status_name = error.get("status") if isinstance(error, dict) else None
    invalid = "INVALID_ARGUMENT" in codes or status_name == "INVALID_ARGUMENT"
    return status == 400 and invalid and "message.token" in fields


# -- Apple Push Notification service, HTTP/2 with token auth --------------------------------
@dataclass(frozen=True)
class ApnsCredentials:
    key_pem: str  # the .p8 signing key (EC P-256)
    key_id: str
    team_id: str
    topic: str  # the app's bundle id

    def provider_token(self, now: int) -> str:
        """ES256 JWT: header kid, claims iss (team) and iat (Apple's token-based auth)."""
        header = {"alg": "ES256", "kid": self.key_id}
        return jwt.encode(
            header, {"iss": self.team_id, "iat": now}, ECKey.import_key(self.key_pem), algorithms=["ES256"]
        )


class ApnsProvider(_Http):
    """POST {base}/3/device/<token> over HTTP/2 (APNs speaks nothing else), authorization
    `bearer <provider token>` (refreshed every 30 min, or when APNs says it expired),
    apns-topic, apns-push-type alert, apns-priority 10, apns-collapse-id (a newer notification
    replaces an unread older one on the phone). UNREGISTERED: 410, or 400 BadDeviceToken."""

    name = "apns"

    def __init__(
        self, creds: ApnsCredentials, base_url: str, client: httpx.AsyncClient, policy: Policy = PUSH_WEBHOOK
    ) -> None:
        super().__init__(client, policy)
        self.creds = creds
        self.base = base_url.rstrip("/")
        self._token: tuple[str, float] | None = None

    def groups(self, devices: Sequence[Device]) -> list[tuple[Device, ...]]:
        return [(d,) for d in devices if d.service == "apns"]

    def provider_token(self) -> str:
        if self._token is None or self._token[1] <= time.monotonic():
            self._token = (
                self.creds.provider_token(int(time.time())),
                time.monotonic() + APNS_TOKEN_REFRESH_S,
            )
        return self._token[0]

    async def send(self, group: tuple[Device, ...], count: int) -> Outcome:
        (device,) = group
        body = orjson.dumps(
            {
                "aps": {"alert": {"title": "New messages", "body": "Open the app to receive them"}},
                "@type": APNS_TYPE,
                "message_count": count,
            }
        )
        url = f"{self.base}/3/device/{device.token}"

        async def attempt() -> None:
            headers = {
                "authorization": f"bearer {self.provider_token()}",
                "apns-topic": self.creds.topic,
                "apns-push-type": "alert",
                "apns-priority": "10",
                "apns-expiration": str(int(time.time()) + 86400),
                "apns-collapse-id": "relayfleet-messages",
            }
            resp = await self.client.post(url, content=body, headers=headers)
            if resp.is_success:
                return
            doc = _json(resp)
            reason = doc.get("reason") if isinstance(doc, dict) else None
            if resp.status_code == 410 or (resp.status_code == 400 and reason in APNS_DEAD_REASONS):
                raise _Final(Outcome.UNREGISTERED, "token unregistered")
            if resp.status_code == 403 and reason == "ExpiredProviderToken":
                self._token = None
                raise _Retry()
            if resp.status_code == 429 or resp.status_code >= 500:
                raise _Retry(_retry_after(resp))
            raise _Final(
                Outcome.REJECTED, f"HTTP {resp.status_code} {reason if isinstance(reason, str) else ''}"
            )

        return await self._attempts(attempt)
