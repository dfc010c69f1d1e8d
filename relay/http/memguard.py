"""Per-process memory guard: refuse new work before RSS passes RELAY_MAX_RSS_MB.

A timer samples /proc/self/statm every 200 ms (one read, no per-request syscall)
and sets `MemoryGuard.over`; the request wrapper checks that flag and answers 503
`overloaded` with Retry-After while it is set. Health, readiness and metrics still
answer. Refusing starts at 90 % of the ceiling: the headroom is for the requests
already admitted (a request body is at most a few MiB) between two samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from aiohttp import web

from relay import metrics

log = logging.getLogger("relay.http.memguard")

SAMPLE_INTERVAL_S = 0.2
REFUSE_AT = 0.9  # of the ceiling
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def cgroup_limit_bytes() -> int | None:
    """The cgroup v2 (or v1) memory limit of this process, when one is set."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip()
            if text != "max":
                value = int(text)
                if 0 < value < 1 << 60:  # v1 reports a huge number for "no limit"
                    return value
    return None


def ceiling_bytes(max_rss_mb: int) -> int | None:
    """The configured ceiling; 0 means the cgroup's limit, else no guard."""
    if max_rss_mb > 0:
        return max_rss_mb << 20
    return cgroup_limit_bytes()


# What one body byte can cost while its request runs (measured: ~5x): the body read in chunks
# and joined, its copy in the Redis command buffer and in the socket's send buffer, a decoded or
# encoded form (fan-out JSON, base64 in a response).
BODY_FACTOR = 5
# Bodies at least this big claim their bytes before being read (smaller ones: the
# sampled RSS is enough, and the hot enqueue path does no bookkeeping).
CLAIM_FROM = 256 << 10
CLAIM = web.RequestKey("relayfleet_memory_claim", int)  # bytes this request claimed


class MemoryGuard:
    """`over` is True while sampled RSS is at or above 90 % of the ceiling.

    Between two samples a burst of big bodies could overshoot, so bodies of
    CLAIM_FROM bytes or more claim their size before they are read: refused when
    RSS + BODY_FACTOR x (claimed bytes) would pass the threshold, released when
    the request is answered.
    """

    __slots__ = ("_handle", "ceiling", "claimed", "held", "over", "rss", "threshold")

    def __init__(self, ceiling: int | None) -> None:
        self.ceiling = ceiling
        self.threshold = int(ceiling * REFUSE_AT) if ceiling else 0
        self.over = False
        self.rss = 0
        self.claimed = 0
        # request bytes the fast path holds (read and not yet answered: buffered,
        # partial bodies, bodies in flight to Redis): counted like claimed bytes
        self.held = 0
        self._handle: asyncio.TimerHandle | None = None

    def claim(self, size: int) -> bool:
        """Claim `size` body bytes for a request; False: refuse it (overloaded)."""
        if self.ceiling is None:
            return True
        self.rss = rss_bytes()  # fresh: a big body is rare and costs far more than this read
        if self.rss + (self.claimed + self.held + size) * BODY_FACTOR >= self.threshold:
            return False
        self.claimed += size
        return True

    def release(self, size: int) -> None:
        self.claimed = max(0, self.claimed - size)

    def start(self) -> None:
        if self.ceiling is None or self._handle is not None:
            return
        log.info(
            "memory guard: refusing new work above %d MiB RSS (ceiling %d MiB)",
            self.threshold >> 20,
            self.ceiling >> 20,
        )
        self._sample()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _sample(self) -> None:
        self.rss = rss_bytes()
        over = self.rss + self.held * BODY_FACTOR >= self.threshold
        if over != self.over:
            self.over = over
            metrics.OVERLOADED.set(1 if over else 0)
            log.warning(
                "memory guard: %s (RSS %d MiB, threshold %d MiB)",
                "refusing new work" if over else "accepting work again",
                self.rss >> 20,
                self.threshold >> 20,
            )
        metrics.RSS_BYTES.set(self.rss)
        metrics.HTTP_HELD_BYTES.set(self.held)
        self._handle = asyncio.get_running_loop().call_later(SAMPLE_INTERVAL_S, self._sample)
