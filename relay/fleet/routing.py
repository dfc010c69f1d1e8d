"""Routing: the shard map in use, one store + wakeup hub per shard, and reloads.

A reload swaps the map and opens stores for new shards; stores of shards that
left are closed only after a grace period, so requests and waiters already on
them finish undisturbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relay import metrics
from relay.bounded import Bounded
from relay.fleet.credentials import CredentialsError, shard_url
from relay.fleet.sharding import SLOT_COUNT, ShardMap, ShardMapError, SlotRange, loads_shard_map, slot_of
from relay.storage import keys as K
from relay.storage.store import QueueLimits, ShardStore
from relay.storage.wakeups import WakeupHub

log = logging.getLogger("relay.routing")

_RETIRE_AFTER_S = 90.0
# queues whose route is kept (~760 B each): more than the waiters a relay holds, so a wake finds
# its queue's route; when full, the oldest entry goes (emptying it made every lookup miss)
_ROUTES_MAX = 65536


@dataclass(frozen=True, slots=True)
class Route:
    keys: K.QueueKeys
    store: ShardStore
    hub: WakeupHub


def single_shard_map(redis_url: str, fleet: str = "default") -> ShardMap:
    return ShardMap(fleet, 1, {"default": redis_url}, (SlotRange(0, SLOT_COUNT - 1, "default"),))


MapSource = Callable[[], Awaitable[ShardMap | None]]


class ShardRouter:
    """Routes a queue to its shard's store and wakeup hub under the shard map in use, and swaps maps."""

    def __init__(self, shard_map: ShardMap, limits: QueueLimits, credentials_dir: str | None = None) -> None:
        self.map = shard_map
        self.limits = limits
        # one file per shard with its full URL (a mounted Secret), read at every (re)load
        self.credentials_dir = credentials_dir
        self.stores: dict[str, ShardStore] = {}
        self.hubs: dict[str, WakeupHub] = {}
        # (recipient, channel) -> its Route under the map, stores and hubs in use: emptied
        # whenever one of them changes (computing a route showed in enqueue profiles)
        self._routes: Bounded[tuple[bytes, bytes], Route] = Bounded(_ROUTES_MAX)
        self._source: MapSource | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()
        self._refreshing: asyncio.Future[bool] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        # each shard's credentials file as last read: (inode, mtime_ns, size), None if absent
        self._stamps: dict[str, tuple[int, int, int] | None] = {}
        self._auth_failed: set[str] = set()  # shards whose login Redis refused since the last look

    async def start(self, source: MapSource | None = None, poll_s: float = 1.0) -> None:
        await self._open_shards(self.map)
        metrics.SHARD_MAP_EPOCH.set(self.map.epoch)
        self._source = source
        if source is not None or self.credentials_dir:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch(poll_s))

    async def close(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        retiring = list(self._retiring)
        for t in retiring:
            t.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for hub in self.hubs.values():
            await hub.stop()
        for store in self.stores.values():
            await store.close()

    def _stamp(self, name: str) -> tuple[int, int, int] | None:
        if not self.credentials_dir:
            return None
        try:
            st = os.stat(os.path.join(self.credentials_dir, name))  # follows a Secret volume's links
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def _open_shards(self, shard_map: ShardMap) -> None:
        for name, map_url in shard_map.shards.items():
            self._stamps[name] = self._stamp(name)
            url = shard_url(name, map_url, self.credentials_dir)
            store = self.stores.get(name)
            if store is not None and store.url == url:
                continue
            new_store = ShardStore(name, url, self.limits)
            new_store.on_auth_failure = functools.partial(self._auth_failed.add, name)
            with contextlib.suppress(Exception):
                await new_store.start()  # an unreachable shard must not stop the others
            hub = WakeupHub(url, name, on_reconnect=metrics.SUBSCRIBER_RECONNECTS.labels(name).inc)
            hub.on_map_moved = self._map_moved
            await hub.start(wait_connected=1.0)
            old_store, old_hub = self.stores.get(name), self.hubs.get(name)
            self.stores[name], self.hubs[name] = new_store, hub
            self._routes.clear()
            if old_store is not None and old_hub is not None:
                self._retire(old_store, old_hub)

    def _map_moved(self) -> None:
        """A migration moved slots off a shard: reload now (install wakes every waiter, and
        each re-waits where its queue lives), not at the next poll of the source."""
        if self._source is None:
            return

        async def reload() -> None:
            await self.refresh()

        task = asyncio.get_running_loop().create_task(reload())
        self._retiring.add(task)  # cancelled on close like the retirements
        task.add_done_callback(self._retiring.discard)

    def _retire(self, store: ShardStore, hub: WakeupHub) -> None:
        async def later() -> None:
            hub.wake_all()  # its waiters re-read through the new route
            try:
                await asyncio.sleep(_RETIRE_AFTER_S)
            finally:  # also when the fleet closes first: never leak the connections
                await hub.stop()
                await store.close()

        task = asyncio.get_running_loop().create_task(later())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def route(self, recipient: bytes, channel: bytes) -> Route:
        route = self._routes.get((recipient, channel))
        if route is not None:
            return route
        slot = slot_of(recipient, channel)
        shard = self.map.shard_for_slot(slot)
        keys = K.queue_keys_for_id(slot, K.queue_id(recipient, channel))
        route = Route(keys, self.stores[shard], self.hubs[shard])
        self._routes.put((recipient, channel), route)
        return route

    async def install(self, new_map: ShardMap) -> bool:
        """Use `new_map` if it is newer than the one in use. True when swapped.

        An older epoch is ignored (a slow writer or a stale cache must never move
        queues back); the same epoch with different content is taken, so a hand
        edit that forgot the epoch still applies.
        """
        async with self._reload_lock:
            old = self.map
            if new_map.epoch < old.epoch and new_map.fleet == old.fleet:
                log.warning("ignoring shard map epoch %d: epoch %d is in use", new_map.epoch, old.epoch)
                return False
            if new_map == old:
                return False
            await self._open_shards(new_map)
            self.map = new_map
            self._routes.clear()
            for name in set(old.shards) - set(new_map.shards):
                store, hub = self.stores.pop(name), self.hubs.pop(name)
                self._retire(store, hub)
            metrics.SHARD_MAP_EPOCH.set(new_map.epoch)
            metrics.SHARD_MAP_RELOADS.inc()
            log.info("shard map epoch %d in use (%d shards)", new_map.epoch, len(new_map.shards))
            # Waiters re-wait wherever their queue lives now. A waiter checks its
            # route after every wakeup, so waking one whose queue stayed put costs
            # only a re-read.
            for hub in self.hubs.values():
                hub.wake_all()
            return True

    async def refresh(self) -> bool:
        """Reload from the source now (after a MOVED answer). True when the map changed.

        Concurrent callers (a burst of requests that all met MOVED) share one
        reload instead of each reading the source.
        """
        if self._source is None:
            return False
        if self._refreshing is not None:
            return await asyncio.shield(self._refreshing)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._refreshing = fut
        try:
            changed = await self._reload()
        except BaseException:
            fut.set_result(False)
            raise
        else:
            fut.set_result(changed)
            return changed
        finally:
            self._refreshing = None

    async def _reload(self) -> bool:
        assert self._source is not None
        try:
            new_map = await self._source()
        except (OSError, ShardMapError) as exc:
            log.warning("shard map reload failed: %s", exc)
            return False
        return new_map is not None and await self.install(new_map)

    async def reread_credentials(self) -> bool:
        """Open new connections for the shards whose credentials file appeared or changed since
        it was read, or whose login Redis refused (a Secret reaches a Pod's volume well after
        the shard map names the shard, and passwords rotate). True when a shard's URL changed."""
        if not self.credentials_dir:
            return False
        async with self._reload_lock:
            failed, self._auth_failed = self._auth_failed, set()
            names = [n for n in self.map.shards if n in failed or self._stamp(n) != self._stamps.get(n)]
            if not names:
                return False
            before = {n: self.stores[n] for n in names if n in self.stores}
            try:
                await self._open_shards(self.map)
            except CredentialsError as exc:
                log.warning("%s", exc)
                return False
            changed = sorted(n for n in names if self.stores.get(n) is not before.get(n))
            for name in changed:
                log.info("shard %s: credentials changed, reconnecting", name)
            return bool(changed)

    async def _watch(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            await self.refresh()
            await self.reread_credentials()


def file_source(path: str) -> MapSource:
    """Reads the map file when it changed (cheap enough to poll each second).

    A change is a new (inode, mtime_ns, size): writers replace the file by rename,
    so even two writes within one clock tick differ by inode.
    """
    last: list[tuple[int, int, int] | None] = [None]

    async def read() -> ShardMap | None:
        st = os.stat(path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == last[0]:
            return None
        # a small local file: reading it inline is cheaper than a thread hop
        shard_map = load_file(path)
        last[0] = stamp
        return shard_map

    return read


def load_file(path: str) -> ShardMap:
    with open(path, "rb") as f:
        return loads_shard_map(f.read())
