"""What the operator last wrote to each object, so an unchanged write costs no request.

Every resync used to apply each of a shard's children again, and each of the fleet's shared
objects (ServiceAccount, Role, RoleBinding, fleet Service) once per shard: 100 shards sent
~1,000 requests a minute at rest, most of them writes that changed nothing
(docs/design-decisions.md, "Unchanged applies cost nothing"). Here each object keeps the
digest of what was last written to it; a write of the same content is skipped until the
entry is due again (`period`, jittered: drift that no read notices, a hand-deleted Service,
is still corrected within it). A changed content is written at once. A read that shows the
object moved away from what was written (a Deployment's generation, a child gone) forgets
the entry, so the next reconcile writes it again.

Pure bookkeeping: no I/O, a clock and a random source injected for tests.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

# A digest meaning "checked: the object does not exist" (a retired child not to look for again).
ABSENT = "absent"
# Entries fall due between (1 - JITTER) x period and the period after their write, so objects
# written together (a fleet applied in one go) are not all written again in the same second.
JITTER = 0.25


def digest(content: Any) -> str:
    """A stable digest of JSON-able content (key order does not matter)."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def key(api_version: str, kind: str, namespace: str | None, name: str) -> tuple[str, str, str | None, str]:
    """The entry key of one object: the one spelling `object_key` and the reads share."""
    return api_version, kind, namespace, name


def object_key(obj: Mapping[str, Any]) -> tuple[str, str, str | None, str]:
    meta = obj.get("metadata") or {}
    return key(str(obj["apiVersion"]), str(obj["kind"]), meta.get("namespace"), str(meta["name"]))


@dataclass(frozen=True)
class _Entry:
    digest: str
    due: float
    generation: int | None


class Written:
    """Per key (an object, or a part of one): the digest last written and when it falls due."""

    def __init__(
        self,
        period: float,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.period = period
        self._clock = clock
        self._jitter = jitter
        self._entries: dict[Hashable, _Entry] = {}
        self._prune_at = 64

    def __len__(self) -> int:
        return len(self._entries)

    def fresh(self, key: Hashable, content_digest: str) -> bool:
        """True when `content_digest` was written under `key` and is not due again yet."""
        entry = self._entries.get(key)
        return entry is not None and entry.digest == content_digest and self._clock() < entry.due

    def record(self, key: Hashable, content_digest: str, answer: Mapping[str, Any] | None = None) -> None:
        """`content_digest` was just written (`answer`: the object the API server returned)."""
        generation = ((answer or {}).get("metadata") or {}).get("generation")
        now = self._clock()
        due = now + self.period * (1.0 - JITTER * self._jitter())
        self._entries[key] = _Entry(content_digest, due, generation if isinstance(generation, int) else None)
        if len(self._entries) >= self._prune_at:
            # An entry past due only ever answers "write again": dropping those keeps the
            # map to what was written within a period (objects deleted since included).
            self._entries = {k: e for k, e in self._entries.items() if e.due > now}
            self._prune_at = 2 * len(self._entries) + 64

    def forget(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def observed(self, key: Hashable, seen: Mapping[str, Any] | None) -> None:
        """A read of the object: forget the entry when it is gone or its spec moved since the
        write (its generation differs), so the next reconcile writes it again."""
        entry = self._entries.get(key)
        if entry is None or entry.digest == ABSENT:
            return
        generation = ((seen or {}).get("metadata") or {}).get("generation")
        if seen is None or (entry.generation is not None and generation != entry.generation):
            self.forget(key)
