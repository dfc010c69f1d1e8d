"""The shard map in a Kubernetes ConfigMap (key ``shardmap.json``): relays watch it, the operator writes it.

`configmap_source` is a `MapSource` for `relay.fleet.routing.ShardRouter`: the first call
reads the ConfigMap directly (startup fails clearly when it is missing or invalid);
after that a background thread keeps a watch open and the source hands out each newer
map once. The thread is plain blocking I/O on purpose: the kubernetes client is
synchronous, and one thread per relay process costs nothing next to the event loop
it would otherwise block. An invalid update is logged and skipped, keeping the last
good map, so a bad edit never takes the fleet down.

`configmap_publisher` gives a `relay.fleet.migration.PublishMap` that replaces the map
with optimistic concurrency (resourceVersion), refusing a map that is not newer with
`MapConflict`; `configmap_reader` is the matching `current_map`, so concurrent
migrations of disjoint slots compose.

The client is the project's one Kubernetes client (relay/kubeapi.py: an explicit kubeconfig,
else in-cluster, else $KUBECONFIG or ~/.kube/config; retries on 429/5xx/connection errors).
The kubernetes package comes with the [operator] extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from relay.fleet.contract import (
    SHARDMAP_KEY,
    MapStore,
    MapWriteConflict,
    shard_map_configmap_data,
    shard_map_from_configmap_data,
    update_shard_map,
)
from relay.fleet.migration import MapConflict, MapPlace
from relay.fleet.sharding import ShardMap, ShardMapError, loads_shard_map
from relay.retrying import CONFIGMAP_WATCH, retrying_blocking

__all__ = [
    "ConfigMapSource",
    "configmap_place",
    "configmap_publisher",
    "configmap_reader",
    "configmap_source",
]

log = logging.getLogger("relay.configmap")


def _core_api(kubeconfig: str | None) -> Any:
    """A CoreV1Api of the project's one Kubernetes client (relay/kubeapi.py: in-cluster, else a
    kubeconfig; retries on transient errors)."""
    from relay import kubeapi

    try:
        api = kubeapi.api_client(kubeconfig)
    except kubeapi.KubeConfigError as exc:
        raise ShardMapError(str(exc)) from None
    from kubernetes import client

    return client.CoreV1Api(api)


def _parse(cm: Any, where: str) -> ShardMap:
    return shard_map_from_configmap_data(getattr(cm, "data", None), where)


class ConfigMapSource:
    """A MapSource over one ConfigMap; call it for the newest map not handed out yet (None: no change)."""

    def __init__(
        self, namespace: str, name: str, *, kubeconfig: str | None = None, watch_timeout_s: int = 290
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.where = f"{namespace}/{name}"
        self.kubeconfig = kubeconfig
        self.watch_timeout_s = watch_timeout_s
        self._api: Any = None
        self._latest: tuple[str, ShardMap] | None = None  # (resourceVersion, map); swapped whole
        self._handed_out = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    async def __call__(self) -> ShardMap | None:
        if self._latest is None:
            await asyncio.to_thread(self._first_read)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch_loop, name=f"configmap-watch {self.where}", daemon=True
            )
            self._thread.start()
        latest = self._latest
        if latest is None or latest[0] == self._handed_out:
            return None
        self._handed_out = latest[0]
        return latest[1]

    def close(self, join_s: float = 0.0) -> None:
        """Stop watching (the thread ends when its watch call returns)."""
        self._stop.set()
        if self._thread is not None and join_s > 0:
            self._thread.join(join_s)

    # -- the blocking side, on a worker thread ----------------------------------------
    def _first_read(self) -> None:
        from kubernetes.client.exceptions import ApiException

        if self._api is None:
            self._api = _core_api(self.kubeconfig)
        try:
            cm = self._api.read_namespaced_config_map(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise ShardMapError(f"ConfigMap {self.where} not found") from None
            raise ShardMapError(f"reading ConfigMap {self.where} failed: {exc.status} {exc.reason}") from None
        except OSError as exc:
            raise ShardMapError(f"reading ConfigMap {self.where} failed: {exc}") from None
        self._latest = (cm.metadata.resource_version, _parse(cm, self.where))

    def _watch_loop(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        failures = (ApiException, HTTPError, OSError, ValueError)

        def gone(exc: BaseException) -> bool:
            return isinstance(exc, ApiException) and exc.status == 410

        def wait_s(exc: BaseException, retry: int) -> float:
            # our version is too old for the watch: list again at once
            return 0.0 if gone(exc) else CONFIGMAP_WATCH.wait_s(retry)

        def failed(exc: BaseException, _: float) -> None:
            if not gone(exc):
                why = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else type(exc).__name__
                log.warning("watching ConfigMap %s failed: %s", self.where, why)

        rv = [self._latest[0] if self._latest else ""]
        while not self._stop.is_set():
            # each watch that ends well (its timeout) starts the backoff over
            watching = retrying_blocking(
                CONFIGMAP_WATCH, failures, wait=wait_s, on_retry=failed, stop=self._stop
            )
            with contextlib.suppress(*failures):  # raised only once stopped
                watching(self._watch_once, rv)

    def _watch_once(self, rv: list[str]) -> None:
        """List (when `rv[0]` is empty: no version to watch from), then watch until the watch
        times out; `rv[0]` follows the versions seen, emptied by a failure (list again)."""
        from kubernetes import watch

        if self._stop.is_set():
            return
        try:
            if not rv[0]:
                cm = self._api.read_namespaced_config_map(self.name, self.namespace)
                rv[0] = cm.metadata.resource_version
                self._offer(cm)
            w = watch.Watch()  # type: ignore[no-untyped-call]
            for event in w.stream(  # type: ignore[no-untyped-call]
                self._api.list_namespaced_config_map,
                self.namespace,
                field_selector=f"metadata.name={self.name}",
                resource_version=rv[0],
                timeout_seconds=self.watch_timeout_s,
                allow_watch_bookmarks=True,
            ):
                if self._stop.is_set():
                    w.stop()  # type: ignore[no-untyped-call]
                    break
                kind, obj = event.get("type"), event.get("object")
                if kind == "ERROR":
                    rv[0] = ""  # e.g. 410 Gone: our version is too old; list again
                    break
                if obj is not None and getattr(obj, "metadata", None) is not None:
                    rv[0] = obj.metadata.resource_version or rv[0]
                if kind in ("ADDED", "MODIFIED"):
                    self._offer(obj)
                elif kind == "DELETED":
                    log.warning(
                        "ConfigMap %s was deleted; keeping shard map epoch %s", self.where, self._epoch()
                    )
        except BaseException:
            rv[0] = ""  # list again
            raise

    def _epoch(self) -> str:
        return str(self._latest[1].epoch) if self._latest else "none"

    def _offer(self, cm: Any) -> None:
        try:
            shard_map = _parse(cm, self.where)
        except ShardMapError as exc:
            log.warning("ignoring an invalid shard map update (keeping epoch %s): %s", self._epoch(), exc)
            return
        latest = self._latest
        if latest is not None and shard_map.epoch < latest[1].epoch and shard_map.fleet == latest[1].fleet:
            return  # never hand out an older map than one already seen
        self._latest = (cm.metadata.resource_version, shard_map)


def configmap_source(namespace: str, name: str) -> ConfigMapSource:
    """The relay's `--shard-map-configmap NS/NAME` source (a `MapSource`)."""
    return ConfigMapSource(namespace, name)


def configmap_publisher(
    namespace: str, name: str, *, kubeconfig: str | None = None, retries: int = 5
) -> Callable[[ShardMap], Awaitable[ShardMap]]:
    """Writes maps to the ConfigMap (creating it if missing); refuses one that is not newer.

    The conditional-write loop is the fleet contract's (`relay.fleet.contract`), the
    same one the operator runs; this side supplies blocking API calls on a thread."""
    where = f"{namespace}/{name}"
    api_box: list[Any] = []

    def api() -> Any:
        if not api_box:
            api_box.append(_core_api(kubeconfig))
        return api_box[0]

    def failed(exc: Any) -> ShardMapError:
        return ShardMapError(f"writing ConfigMap {where} failed: {exc.status} {exc.reason}")

    def read_blocking() -> tuple[ShardMap | None, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            cm = api().read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None, None
            raise failed(exc) from None
        current = (cm.data or {}).get(SHARDMAP_KEY)
        return (loads_shard_map(current) if current else None), cm

    def write_blocking(new_map: ShardMap, cm: Any) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body_data = shard_map_configmap_data(new_map)
        try:
            if cm is None:
                meta = client.V1ObjectMeta(name=name, namespace=namespace)
                api().create_namespaced_config_map(
                    namespace, client.V1ConfigMap(metadata=meta, data=body_data)
                )
            else:
                cm.data = {**(cm.data or {}), **body_data}
                api().replace_namespaced_config_map(name, namespace, cm)  # carries resourceVersion
        except ApiException as exc:
            if exc.status == 409:
                raise MapWriteConflict from None
            raise failed(exc) from None

    async def read() -> tuple[ShardMap | None, Any]:
        return await asyncio.to_thread(read_blocking)

    async def write(new_map: ShardMap, cm: Any) -> None:
        await asyncio.to_thread(write_blocking, new_map, cm)

    async def publish(new_map: ShardMap) -> ShardMap:
        def change(old: ShardMap | None) -> ShardMap:
            if old is not None and old.epoch >= new_map.epoch and old.fleet == new_map.fleet:
                raise MapConflict(
                    f"ConfigMap {where} already holds epoch {old.epoch}; refusing epoch {new_map.epoch}"
                )
            return new_map

        try:
            await update_shard_map(MapStore(read, write), change, retries)
        except MapWriteConflict:
            raise ShardMapError(f"writing ConfigMap {where} kept conflicting") from None
        return new_map

    return publish


def configmap_reader(
    namespace: str, name: str, *, kubeconfig: str | None = None
) -> Callable[[], Awaitable[ShardMap]]:
    """The map in the ConfigMap now (a `relay.fleet.migration.CurrentMap`)."""
    source = ConfigMapSource(namespace, name, kubeconfig=kubeconfig)

    async def read() -> ShardMap:
        await asyncio.to_thread(source._first_read)  # one GET, no watch
        assert source._latest is not None
        return source._latest[1]

    return read


def configmap_place(namespace: str, name: str, *, kubeconfig: str | None = None) -> MapPlace:
    """The ConfigMap the relays watch (`--shard-map-configmap NS/NAME`), for `relayfleet migrate`."""
    return MapPlace(
        f"ConfigMap {namespace}/{name}",
        configmap_reader(namespace, name, kubeconfig=kubeconfig),
        configmap_publisher(namespace, name, kubeconfig=kubeconfig),
    )
