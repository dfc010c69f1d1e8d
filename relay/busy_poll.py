"""The relay loop's busy-poll window (docs/design-decisions.md, "Busy-polling after I/O").

A relay that sleeps in epoll between a client's requests is woken by the kernel when the
next one arrives; on a virtual machine whose idle vCPU halts, that wake-up goes through the
host, and the relay then runs from cold caches. On the wake path (an enqueue arriving soon
after the relay answered the last request) that was most of what the relay took beyond
nginx + nchan (docs/benchmarks.md, "Waking the relay: busy-polling after I/O").

So after I/O the loop keeps polling for the next event for a short window instead of
sleeping: a callback rescheduled with `call_soon` makes the loop poll epoll without
blocking. Three bounds keep this from costing anyone else:
- every turn yields the CPU (sched_yield): a task that wants this CPU runs first;
- no spinning while a batched store call is awaited (asked of relay/storage/pipeline.py
  at every turn): batches mean load, and then Redis and the clients need the CPU; a lone
  call written on an idle connection (the wake's enqueue) is polled for;
- a budget: spinning takes at most `share` of one core, averaged over a second.
Nothing here runs when nothing happens; window 0 (the default, RELAY_BUSY_POLL_US) turns it off,
and then `active` is None: each I/O path checks that, and does nothing more.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from relay import metrics

_BUDGET_PERIOD_S = 0.1  # the budget is `share` of one core over this long (its burst)

_clock = time.perf_counter


class BusyPoll:
    """One loop's busy-poll window; `event` is called as I/O arrives."""

    __slots__ = (
        "_cap",
        "_last_event",
        "_loop",
        "_refilled",
        "_share",
        "_spinning",
        "_started",
        "_store_busy",
        "_tokens",
        "_window",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, window_s: float, share: float, store_busy: Callable[[], bool]
    ) -> None:
        self._loop = loop
        self._store_busy = store_busy  # True while a batched store call is awaited
        self._window = window_s
        self._share = share
        self._cap = share * _BUDGET_PERIOD_S
        self._tokens = self._cap  # seconds of spinning left (refilled at `share` per second)
        self._refilled = _clock()
        self._last_event = 0.0
        self._started = 0.0
        self._spinning = False

    def event(self) -> None:
        """I/O arrived: poll for the next for a while rather than sleep."""
        now = self._last_event = _clock()
        if self._spinning:
            return
        tokens = min(self._cap, self._tokens + (now - self._refilled) * self._share)
        self._refilled = now
        self._tokens = tokens
        if tokens > 0:
            self._spinning = True
            self._started = now
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        now = _clock()
        if self._store_busy():
            self._stop(now, "store")
        elif now - self._last_event >= self._window:
            self._stop(now, "window")
        elif now - self._started >= self._tokens:
            self._stop(now, "budget")
        else:
            os.sched_yield()
            self._loop.call_soon(self._turn)

    def _stop(self, now: float, ended_by: str) -> None:
        spun = now - self._started
        self._tokens -= spun
        self._spinning = False
        metrics.BUSY_POLL_SECONDS.inc(spun)
        metrics.BUSY_POLL_WINDOWS.labels(ended_by).inc()


# The relay process's one, once installed; None: off. Read as `busy_poll.active` at each
# event (not bound at import), so the I/O paths pay one check when it is off.
active: BusyPoll | None = None


def install(
    loop: asyncio.AbstractEventLoop, window_us: int, share: float, store_busy: Callable[[], bool]
) -> None:
    """Busy-poll `loop` after I/O (the relay's own process; window 0 or share 0: never), not
    while `store_busy()`. Replaces what an earlier call installed."""
    global active
    active = None
    if window_us > 0 and share > 0 and hasattr(os, "sched_yield"):
        active = BusyPoll(loop, window_us / 1e6, share, store_busy)
