"""`Bounded`: a dict of at most `most` entries that drops its oldest to take a new one.

The relay's in-process caches share it (the route cache, a shard's enqueue parts, the recipient
reconciliation stamps), so each keeps a fixed size under churn. Oldest means first inserted: a
lookup does not renew an entry (an LRU's move to the end on every hit would cost the hot path's
hits for a cache whose entries are all equally cheap to make again). It is an OrderedDict, whose
oldest entry is found in constant time; a plain dict finds it by skipping the slots its earlier
deletions left, ~60 us at 1,000,000 queues, and a loop of `del d[next(iter(d))]` grows
quadratic under churn.

Cost (process CPU time, medians of 21 alternating rounds of 65,536-entry caches, one process
on a 2-core machine at load average 7 from other work: ratios, not absolute figures): a hit is
OrderedDict's own `get`, no Python frame (128 against 129 ns written out); a miss that inserts
and evicts, through `put`, 638 against 556 ns written out at the call site (x1.12, one Python
frame), beside the ~6 us of computing a route or an enqueue's parts that the miss pays anyway.

A leaf: the standard library only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Bounded(OrderedDict[K, V]):
    """At most `most` entries: `put` past the bound drops the first inserted one."""

    __slots__ = ("most",)

    def __init__(self, most: int) -> None:
        if most < 1:
            raise ValueError("a bounded cache holds at least one entry")
        super().__init__()
        self.most = most

    def put(self, key: K, value: V) -> None:
        """Map `key` to `value`, then drop the oldest entry if that made one too many (a key
        already held keeps its place in the order and drops nothing)."""
        self[key] = value
        if len(self) > self.most:
            self.popitem(last=False)
