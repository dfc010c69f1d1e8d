"""Inbox append: `storedAt` is the stored `createdAt`, identical when the append is retried."""

from __future__ import annotations

import base64

import pytest

from tests.hostile.harness import SECRET_INBOX_ID, SECRET_PAYLOAD, Relay, http, request_answer

pytestmark = pytest.mark.timeout(60)


async def test_stored_at_is_created_at_and_stable_on_retry(hostile_relay: Relay) -> None:
    inbox = {"X-Inbox-ID": SECRET_INBOX_ID + "-retry", "Content-Type": "application/json"}
    body = b'{"messageId":"m-retry-1","ciphertext":"%s"}' % base64.urlsafe_b64encode(SECRET_PAYLOAD).rstrip(
        b"="
    )
    first = await request_answer(hostile_relay, http("POST", "/v1/inbox/append", body, inbox))
    assert first.status == 201, first
    retried = await request_answer(hostile_relay, http("POST", "/v1/inbox/append", body, inbox))
    assert retried.status == 200, retried
    assert retried.json() == first.json()
    read = await request_answer(hostile_relay, http("GET", "/v1/inbox/messages", headers=inbox))
    (message,) = read.json()["messages"]
    assert message["createdAt"] == first.json()["storedAt"]
    hostile_relay.assert_log_clean()
