"""The shard map from a ConfigMap, against a real kube-apiserver (tests/support/k8s_cluster.py).

The source's first read, its watch handing out each newer map once, invalid updates
skipped, the publisher's optimistic concurrency; and a relay process started with
`--shard-map-configmap NS/NAME` following a migration published to the ConfigMap.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
from kubernetes import client
from relayfleet_testing.localredis import LocalRedis

from relay.fleet.configmap import ConfigMapSource, configmap_publisher, configmap_reader
from relay.fleet.contract import SHARDMAP_KEY, shardmap_configmap_name
from relay.fleet.migration import MapConflict, migrate_slots
from relay.fleet.sharding import ShardMap, ShardMapError, even_split, slot_of
from tests.support.fleet_harness import b64, spawn_relay, stop_relays, wait_ready
from tests.support.k8s_cluster import KubeCluster

pytestmark = pytest.mark.k8s

NS = "default"


@pytest.fixture
def kubeconfig(kube_apiserver: KubeCluster) -> str:
    return str(kube_apiserver.kubeconfig)


@pytest.fixture
def cm_name() -> str:
    return shardmap_configmap_name(f"t{uuid.uuid4().hex[:8]}")


def _map(epoch: int) -> ShardMap:
    m = even_split("test", {"a": "redis://127.0.0.1:1/0", "b": "redis://127.0.0.1:2/0"})
    return ShardMap(m.fleet, epoch, dict(m.shards), m.ranges)


async def _next_map(source: ConfigMapSource, limit_s: float = 10.0) -> ShardMap:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = await source()
        if got is not None:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError("no new map from the watch")


async def test_source_reads_then_watches(kubeconfig: str, kube_apiserver: KubeCluster, cm_name: str) -> None:
    publish = configmap_publisher(NS, cm_name, kubeconfig=kubeconfig)
    await publish(_map(1))  # creates the ConfigMap
    source = ConfigMapSource(NS, cm_name, kubeconfig=kubeconfig, watch_timeout_s=3)
    try:
        first = await source()
        assert first is not None
        assert first.epoch == 1
        assert await source() is None
        await publish(_map(2))
        assert (await _next_map(source)).epoch == 2
        # an invalid edit is skipped: the relay keeps its last good map
        with kube_apiserver.api_client() as api:
            core = client.CoreV1Api(api)
            core.patch_namespaced_config_map(
                cm_name, NS, {"data": {SHARDMAP_KEY: '{"fleet": "test", "epoch": 3}'}}
            )
            await asyncio.sleep(1.0)
            assert await source() is None
            # an older epoch is never handed out either
            core.patch_namespaced_config_map(cm_name, NS, {"data": {SHARDMAP_KEY: _map(1).dumps()}})
            await asyncio.sleep(1.0)
            assert await source() is None
        await publish(_map(4))
        assert (await _next_map(source)).epoch == 4
        await asyncio.sleep(3.5)  # the server ends the watch: the source re-watches and still follows
        await publish(_map(5))
        assert (await _next_map(source)).epoch == 5
    finally:
        source.close(join_s=5)


async def test_publisher_refuses_stale_maps(kubeconfig: str, cm_name: str) -> None:
    publish = configmap_publisher(NS, cm_name, kubeconfig=kubeconfig)
    await publish(_map(3))
    with pytest.raises(MapConflict, match="already holds epoch 3"):
        await publish(_map(3))
    assert (await publish(_map(4))).epoch == 4
    assert (await configmap_reader(NS, cm_name, kubeconfig=kubeconfig)()).epoch == 4


async def test_missing_configmap_is_a_clear_error(kubeconfig: str) -> None:
    source = ConfigMapSource(NS, "relayfleet-nope-shardmap", kubeconfig=kubeconfig)
    with pytest.raises(ShardMapError, match="ConfigMap default/relayfleet-nope-shardmap not found"):
        await source()


async def test_relay_follows_a_migration_published_to_the_configmap(
    kubeconfig: str, cm_name: str, two_redis: dict[str, LocalRedis], tmp_path: Path
) -> None:
    publish = configmap_publisher(NS, cm_name, kubeconfig=kubeconfig)
    shard_map = even_split("test", {n: s.url for n, s in two_redis.items()})
    await publish(shard_map)
    relay = spawn_relay(["--shard-map-configmap", f"{NS}/{cm_name}"], tmp_path, {"KUBECONFIG": kubeconfig})
    try:
        await asyncio.to_thread(wait_ready, relay)
        recipient = next(r for r in (os.urandom(32) for _ in range(1000)) if shard_map.shard_for(r) == "a")
        url = f"{relay.url}/v1/queues/{b64(recipient)}/messages"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, data=b"before") as resp:
                assert resp.status == 201
            report = await migrate_slots(shard_map, [slot_of(recipient)], "b", publish)
            assert report.slots_moved == 1
            async with http.post(url, data=b"after") as resp:
                assert resp.status == 201
                assert (await resp.json())["seq"] == 2
            async with http.get(url) as resp:
                doc = await resp.json()
            assert [m["seq"] for m in doc["messages"]] == [1, 2]
            async with http.get(f"{relay.url}/metrics") as resp:
                text = await resp.text()
            assert f"relayfleet_shard_map_epoch {float(report.map_epoch)}" in text
    finally:
        stop_relays([relay])
