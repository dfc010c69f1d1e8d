"""Request authentication (docs/api.md): the server side of relay.protocol.

The header format, canonical string and signature check live in relay.protocol (a
leaf the client library shares); this module adds the clock-skew window, the
once-only nonce (through the service) and the optional enqueue bearer tokens.
Senders stay anonymous unless enqueue tokens are configured.
"""

from __future__ import annotations

import hmac
import time

from aiohttp import web

from relay import metrics
from relay.api.errors import unauthorized
from relay.protocol import (
    SCHEME,
    Credentials,
    b64encode,
    parse_authorization,
    signature_valid,
)

# Re-exported for code written against the old location; new code imports relay.protocol.
from relay.protocol import canonical as canonical
from relay.protocol import keypair as keypair
from relay.protocol import sign_headers as sign_headers
from relay.service import QueueService
from relay.settings import Settings

__all__ = ["SCHEME", "Authenticator", "Credentials", "canonical", "keypair", "parse_header", "sign_headers"]


def parse_header(value: str | None) -> Credentials:
    """The caller's credentials, or 401 with the contract's text (relay.protocol parses)."""
    try:
        return parse_authorization(value)
    except ValueError as e:
        raise unauthorized(str(e)) from None


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
        if not signature_valid(creds, method, path_and_query, body):
            raise unauthorized("signature does not verify")
        # recorded only after the signature checks out, so nobody can burn others' nonces
        fresh = await self.service.use_nonce(
            recipient, f"{b64encode(creds.key)}.{creds.nonce}", 2 * self.skew * 1000
        )
        if not fresh:
            raise unauthorized("nonce was already used")

    def verify_enqueue(self, request: web.Request, route: str = "/v1/queues/{recipient}/messages") -> None:
        """A storing route's (enqueue, fan-out, inbox append) token check."""
        if self.tokens:
            self.verify_enqueue_header(request.headers.get("Authorization"), route)

    def verify_enqueue_header(
        self, header: str | None, route: str = "/v1/queues/{recipient}/messages"
    ) -> None:
        """401 unless `header` carries one of the enqueue tokens (when any are configured),
        counted under `route` in relayfleet_quota_refusals_total."""
        if not self.tokens:
            return
        header = header or ""
        scheme, _, token = header.partition(" ")
        if scheme != "Bearer" or not any(
            hmac.compare_digest(token.strip().encode("utf-8", "replace"), t) for t in self.tokens
        ):
            metrics.quota_refused(route, "enqueue_token")
            raise unauthorized("a storing request requires a valid bearer token", "Bearer")
