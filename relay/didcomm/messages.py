"""What every protocol of the mediator shares: the message type prefixes, its error (a
problem-report or a 4xx) and the reply that continues a message's thread."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["PREFIXES", "MediatorError", "reply", "thread_of"]

# The two spellings of a DIDComm v1 message type's prefix; a reply copies the request's.
PREFIXES = ("https://didcomm.org/", "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/")


class MediatorError(Exception):
    """A message the mediator will not act on: a problem-report to a known sender, else 4xx JSON."""

    def __init__(
        self, text: str, code: str = "bad_didcomm_message", status: int = 400, retry_after_s: float = 0
    ) -> None:
        super().__init__(text)
        self.text = text
        self.code = code
        self.status = status
        self.retry_after_s = retry_after_s  # a 429's Retry-After


def thread_of(doc: dict[str, Any]) -> tuple[str | None, str | None]:
    thread = doc.get("~thread")
    if not isinstance(thread, dict):
        return None, None
    thid, pthid = thread.get("thid"), thread.get("pthid")
    return (thid if isinstance(thid, str) else None), (pthid if isinstance(pthid, str) else None)


def reply(doc: dict[str, Any], prefix: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A reply to `doc` of type `prefix` + `name`, in its thread, with `body`'s fields."""
    thid, _ = thread_of(doc)
    out: dict[str, Any] = {"@type": prefix + name, "@id": str(uuid.uuid4())}
    thread = thid or doc.get("@id")
    if thread:
        out["~thread"] = {"thid": thread}
    out.update(body)
    return out
