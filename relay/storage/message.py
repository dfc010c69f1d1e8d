"""A stored message as reads, drains, live delivery and wakeups that carry it hand it on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Message:
    seq: int
    payload: bytes
    received_ms: int
    message_id: str | None
