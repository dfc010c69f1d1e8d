"""Device notifications for mediated recipients that nobody is fetching for.

A forward stored for a key whose queue had no subscriber anywhere in the fleet (the
enqueue's PUBLISH reached none) is `offer`ed: never awaited by the enqueue, it opens or
joins the key's pending burst in a bounded map. RELAY_PUSH_COALESCE_S after the burst's
first store a worker takes it, and only then pays Redis round trips:

1. online anywhere (a live socket or a waiting poll on any relay): nothing;
2. the key's connection and its devices (relay/didcomm/records.py): none, nothing;
3. the connection's push window (records.push_window, fleet-wide): taken at most once per
   RELAY_PUSH_MIN_INTERVAL_S; inside it the burst is counted `coalesced`, nothing sent;
4. each provider sends its groups concurrently; a dead token removes that device.

So a burst of N stores costs one notification per device at most, carrying the count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from relay import metrics
from relay.devicepush.providers import Outcome, Provider
from relay.didcomm.records import QUEUE_CHANNEL, Records
from relay.push import cancel_all

log = logging.getLogger("relay.devicepush")

MAX_PENDING = 10_000  # recipients with a pending burst, per relay process
WORKERS = 4
Online = Callable[[bytes, bytes], Awaitable[bool]]


async def nobody_online(_: bytes, __: bytes) -> bool:
    """Without fleet presence (a notifier built alone): the enqueue's subscriber count is the
    only signal."""
    return False


@dataclass
class _Burst:
    due: float  # monotonic
    count: int


class DeviceNotifier:
    def __init__(
        self,
        records: Records,
        providers: Sequence[Provider],
        *,
        online: Online = nobody_online,
        coalesce_s: float = 1.0,
        min_interval_s: float = 60.0,
        max_pending: int = MAX_PENDING,
        workers: int = WORKERS,
    ) -> None:
        self.records = records
        self.providers = tuple(providers)
        self.online = online
        self.coalesce_s = coalesce_s
        self.min_interval_ms = int(min_interval_s * 1000)
        self.max_pending = max_pending
        self.workers = workers
        self._pending: OrderedDict[bytes, _Burst] = OrderedDict()  # in due order (one window)
        self._ready = asyncio.Event()
        self._due: asyncio.Queue[tuple[bytes, int]] = asyncio.Queue(maxsize=workers)
        self._tasks: list[asyncio.Task[None]] = []

    def offer(self, recipient: bytes) -> None:
        """A message was stored for `recipient`'s mediated queue with nobody subscribed to it.
        Never blocks, never raises."""
        burst = self._pending.get(recipient)
        if burst is not None:
            burst.count += 1
            metrics.DEVICE_PUSH_BURSTS.labels("merged").inc()
            return
        if len(self._pending) >= self.max_pending:
            metrics.DEVICE_PUSH_BURSTS.labels("dropped").inc()
            return
        self._pending[recipient] = _Burst(time.monotonic() + self.coalesce_s, 1)
        self._ready.set()

    def pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._schedule())]
        self._tasks += [loop.create_task(self._work()) for _ in range(self.workers)]

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        for p in self.providers:
            await p.close()

    async def _schedule(self) -> None:
        """Hand each burst to the workers once its window closed (the map's first is the
        earliest: every burst waits the same window)."""
        while True:
            if not self._pending:
                self._ready.clear()
                await self._ready.wait()
                continue
            recipient, burst = next(iter(self._pending.items()))
            wait_s = burst.due - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
                continue
            del self._pending[recipient]
            await self._due.put((recipient, burst.count))

    async def _work(self) -> None:
        while True:
            recipient, count = await self._due.get()
            try:
                await self.notify(recipient, count)
            except Exception as exc:  # a shard down, a bug: this burst is lost, the next is not
                log.error("device push for a burst failed: %s", type(exc).__name__)

    async def notify(self, recipient: bytes, count: int) -> None:
        """One burst of `count` stores for `recipient`, its window closed."""
        if await self.online(recipient, QUEUE_CHANNEL):
            metrics.DEVICE_PUSH_BURSTS.labels("online").inc()
            return
        owner = await self.records.owner(recipient)
        devices = await self.records.devices(owner) if owner is not None else {}
        targets = [(p, g) for p in self.providers for g in p.groups(tuple(devices.values()))]
        if owner is None or not targets:
            metrics.DEVICE_PUSH_BURSTS.labels("no_device").inc()
            return
        if not await self.records.push_window(owner, self.min_interval_ms):
            for p, _ in targets:
                metrics.DEVICE_PUSH.labels(p.name, "coalesced").inc()
            return
        metrics.DEVICE_PUSH_BURSTS.labels("notified").inc()
        outcomes = await asyncio.gather(*(p.send(g, count) for p, g in targets))
        for (p, group), outcome in zip(targets, outcomes, strict=True):
            metrics.DEVICE_PUSH.labels(p.name, outcome.value).inc()
            if outcome is Outcome.UNREGISTERED and await self.records.drop_device(owner, group[0]):
                log.info("push provider %s said a %s token is dead: device removed", p.name, group[0].service)
