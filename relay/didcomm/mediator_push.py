"""Push notifications 1.0 on the mediator: push-notifications-fcm (Aries RFC 0734) and
push-notifications-apns (RFC 0699), the mediator being the notification-sender. A connection
sets its device (a token, and for fcm a platform; null removes it), reads it back, and gets
notified when its mediated keys' queues fill while nobody fetches them (relay/pushdevices).

The answers, as the RFCs give them: set-device-info → ack (RFC 0015, status OK, in the set's
thread); get-device-info → device-info in the get's thread; a get before any set →
problem-report `not-registered-for-push-notifications`; a set with one of fcm's two values
null (not both) → problem-report `missing-value`.
"""

from __future__ import annotations

import re
from typing import Any

from relay.didcomm.messages import MediatorError, reply
from relay.didcomm.records import Connection, Device, Records

__all__ = ["FAMILIES", "MAX_PLATFORM", "MAX_TOKEN", "PushSettings", "valid_token"]

FAMILIES = {"push-notifications-fcm/1.0": "fcm", "push-notifications-apns/1.0": "apns"}
MAX_TOKEN = 512  # FCM registration tokens are ~160 characters, APNs device tokens 64 hex digits
MAX_PLATFORM = 32
# FCM tokens are URL-safe text ("<id>:<base64url>"); APNs tokens are hex
_TOKEN = {"fcm": re.compile(r"[A-Za-z0-9_:.\-]+"), "apns": re.compile(r"(?:[0-9A-Fa-f]{2})+")}
_PLATFORM = re.compile(r"[A-Za-z0-9 ._\-]+")
NOT_REGISTERED = "not-registered-for-push-notifications"


class _MissingValue(ValueError):
    """One of fcm's two values null, the other not: the RFC's `missing-value` problem-report."""


def valid_token(service: str, token: str) -> bool:
    return 0 < len(token) <= MAX_TOKEN and _TOKEN[service].fullmatch(token) is not None


class PushSettings:
    """The protocol handlers of both families over one connection's records."""

    def __init__(self, records: Records) -> None:
        self.records = records

    async def handle(
        self, doc: dict[str, Any], prefix: str, family: str, short: str, conn: Connection
    ) -> dict[str, Any]:
        service = FAMILIES[family]
        if short == "set-device-info":
            try:
                device = self._device(doc, service)
            except _MissingValue as exc:
                return self._problem(doc, prefix, family, str(exc), "missing-value")
            await self.records.set_device(conn.key, service, device)
            return reply(doc, prefix, "notification/1.0/ack", {"status": "OK"})
        if short == "get-device-info":
            held = (await self.records.devices(conn.key)).get(service)
            if held is None:
                return self._problem(
                    doc, prefix, family, "no push device is set on this connection", NOT_REGISTERED
                )
            body: dict[str, Any] = {"device_token": held.token}
            if service == "fcm":
                body["device_platform"] = held.platform
            return reply(doc, prefix, family + "/device-info", body)
        raise MediatorError(
            f"{family}/{short[:40]} is not a message the mediator accepts", "unsupported_message_type"
        )

    @staticmethod
    def _device(doc: dict[str, Any], service: str) -> Device | None:
        """The device a set names; None to remove it. MediatorError when malformed."""
        token = doc.get("device_token")
        platform = doc.get("device_platform") if service == "fcm" else None
        if token is None and platform is None:
            return None
        if token is None or (service == "fcm" and platform is None):
            raise _MissingValue("device_token and device_platform must be both set or both null")
        if not isinstance(token, str) or not valid_token(service, token):
            shape = "hex digits" if service == "apns" else "letters, digits and _:.-"
            raise MediatorError(f"device_token must be 1 to {MAX_TOKEN} {shape}", "bad_device_info")
        if platform is not None and not (
            isinstance(platform, str) and len(platform) <= MAX_PLATFORM and _PLATFORM.fullmatch(platform)
        ):
            raise MediatorError(
                f"device_platform must be 1 to {MAX_PLATFORM} letters, digits, spaces and ._-",
                "bad_device_info",
            )
        return Device(service, token, platform)

    @staticmethod
    def _problem(doc: dict[str, Any], prefix: str, family: str, text: str, code: str) -> dict[str, Any]:
        """The family's own problem-report (RFC 0035), in the request's thread."""
        return reply(doc, prefix, family + "/problem-report", {"description": {"en": text, "code": code}})
