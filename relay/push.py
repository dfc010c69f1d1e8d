"""Push hook (phnx QS): tell a webhook when a message is stored for a client that is offline.

"Offline" means nobody in the fleet waits on the queue's wakeup channel (the
enqueue script's PUBLISH reached no subscriber) and this process holds no live
connection for it. The webhook gets ``{"recipient", "channel", "seq"}`` as JSON,
never the payload. Enqueue never waits for it: notifications go into a bounded
map of pending queues (a newer seq replaces an unsent older one for the same
queue, so a burst costs one call), drained by a few workers with bounded retries
(relay/retrying.py, PUSH_WEBHOOK: 429, 5xx, timeouts and connection errors; a 4xx is final).
When the map is full, new notifications are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web

from relay import metrics
from relay.api.context import CTX, Context
from relay.protocol import b64encode
from relay.retrying import PUSH_WEBHOOK, Policy, retrying
from relay.service import OnStored
from relay.storage.keys import MEDIATOR_CHANNEL

log = logging.getLogger("relay.push")


MAX_PENDING = 10_000
WORKERS = 4
TIMEOUT_S = 5.0
MAX_RETRY_AFTER_S = 5.0  # a webhook asking for longer is retried after this


class _Refused(Exception):
    """The webhook answered 4xx (not 429): final."""


class _Failed(Exception):
    """The webhook answered 429 or 5xx: retried, after its Retry-After if it gave one."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(retry_after_s)
        self.retry_after_s = retry_after_s


class PushNotifier:
    def __init__(
        self,
        url: str,
        *,
        max_pending: int = MAX_PENDING,
        workers: int = WORKERS,
        timeout_s: float = TIMEOUT_S,
        policy: Policy = PUSH_WEBHOOK,
    ) -> None:
        self.url = url
        self.max_pending = max_pending
        self.workers = workers
        self.timeout_s = timeout_s
        self.policy = policy
        self._pending: OrderedDict[tuple[bytes, bytes], int] = OrderedDict()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def target(self) -> str:
        """The webhook's host, for logs (the URL itself may carry a token)."""
        return urlsplit(self.url).hostname or "?"

    def offer(self, recipient: bytes, channel: bytes, seq: int) -> None:
        """Queue a notification; never blocks, never raises."""
        key = (recipient, channel)
        if key in self._pending:
            self._pending[key] = max(seq, self._pending[key])
            metrics.PUSH_NOTIFICATIONS.labels("coalesced").inc()
            return
        if len(self._pending) >= self.max_pending:
            metrics.PUSH_NOTIFICATIONS.labels("dropped").inc()
            return
        self._pending[key] = seq
        self._ready.set()

    def pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work()) for _ in range(self.workers)]

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _work(self) -> None:
        while True:
            if not self._pending:
                self._ready.clear()
                await self._ready.wait()
                continue
            (recipient, channel), seq = self._pending.popitem(last=False)
            await self._deliver(recipient, channel, seq)

    async def _post(self, body: bytes) -> None:
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self.url, data=body, headers=headers) as resp:
            await resp.read()
            if 200 <= resp.status < 300:
                return
            if resp.status != 429 and resp.status < 500:
                raise _Refused(resp.status)
            retry_after = 0.0
            with contextlib.suppress(ValueError):
                retry_after = min(float(resp.headers.get("Retry-After", "0")), MAX_RETRY_AFTER_S)
            raise _Failed(retry_after)

    def _wait_s(self, exc: BaseException, retry: int) -> float:
        asked = exc.retry_after_s if isinstance(exc, _Failed) else 0.0
        return max(asked, self.policy.wait_s(retry))

    def _retried(self, _: BaseException, __: float) -> None:
        metrics.PUSH_NOTIFICATIONS.labels("retried").inc()

    async def _deliver(self, recipient: bytes, channel: bytes, seq: int) -> None:
        body = orjson.dumps({"recipient": b64encode(recipient), "channel": b64encode(channel), "seq": seq})
        failures = (_Failed, aiohttp.ClientError, TimeoutError, OSError)
        try:
            await retrying(self.policy, failures, wait=self._wait_s, on_retry=self._retried)(self._post, body)
        except _Refused as exc:
            metrics.PUSH_NOTIFICATIONS.labels("rejected").inc()
            log.warning("push webhook at %s refused a notification: %s", self.target, exc.args[0])
        except failures:
            metrics.PUSH_NOTIFICATIONS.labels("failed").inc()
            log.warning(
                "push webhook at %s failed %s times; notification dropped", self.target, self.policy.attempts
            )
        else:
            metrics.PUSH_NOTIFICATIONS.labels("sent").inc()


NOTIFIER = web.AppKey("relayfleet_push", PushNotifier)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel a notifier's workers and wait until each has ended."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


class Notifier(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def hook(app: web.Application, offer: OnStored, notifier: Notifier) -> None:
    """Call `offer` for every stored message, after any hook already on the app's queue
    service, and run `notifier` from the app's start-up to its clean-up (the webhook's and
    relay/devicepush's)."""
    service = app[CTX].service
    previous = service.on_stored

    def on_stored(recipient: bytes, channel: bytes, seq: int, subscribers: int) -> None:
        if previous is not None:
            previous(recipient, channel, seq, subscribers)
        offer(recipient, channel, seq, subscribers)

    service.on_stored = on_stored

    async def start(_: web.Application) -> None:
        await notifier.start()

    async def stop(_: web.Application) -> None:
        await notifier.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


def install(app: web.Application, notifier: PushNotifier) -> None:
    """Hook `notifier` into the app's queue service (after any hook already there)."""
    c: Context = app[CTX]

    def offer(recipient: bytes, channel: bytes, seq: int, subscribers: int) -> None:
        # a mediated key's queue is notified per device instead (relay/devicepush)
        if subscribers == 0 and channel != MEDIATOR_CHANNEL and (recipient, channel) not in c.live.by_queue:
            notifier.offer(recipient, channel, seq)

    hook(app, offer, notifier)
    app[NOTIFIER] = notifier


def setup(app: web.Application) -> None:
    url = app[CTX].settings.push_webhook
    if not url:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        log.error("RELAY_PUSH_WEBHOOK must be an http(s) URL; push notifications are off")
        return
    install(app, PushNotifier(url))
    log.info("push notifications for offline queues go to %s", parts.hostname)
