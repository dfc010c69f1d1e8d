"""What the e2e tests ask of a running fleet: waiting for a state (each wait's time recorded in
TIMINGS), a RelayShard document, the shard map and CRD phases read back, HTTP GETs of the relay Service."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from e2e.env import FLEET, Env
from relay.fleet.sharding import ShardMap, loads_shard_map
from tests.support.shard_specs import shard as relayshard

T = TypeVar("T")
FLEET_SERVICE = f"relayfleet-{FLEET}"
# The images of the test's RelayShards when not the operator's defaults (the relay's, and the
# managed Redis's): the names the cluster's node holds.
SHARD_IMAGE = os.environ.get("RELAYFLEET_E2E_SHARD_IMAGE", "")
REDIS_IMAGE = os.environ.get("RELAYFLEET_E2E_REDIS_IMAGE", "")
TIMINGS: dict[str, float] = {}


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 120.0, interval: float = 0.5) -> T:
    start = time.monotonic()
    last: object = None
    while True:
        try:
            result = check()
        except (LookupError, OSError, AssertionError) as exc:
            result, last = None, exc
        if result:
            TIMINGS[what] = round(time.monotonic() - start, 1)
            return result
        if time.monotonic() - start > timeout:
            pytest.fail(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last: {last})" if last else "")
            )
        time.sleep(interval)


def shard(name: str, ha: bool = False, **spec: Any) -> str:
    """A RelayShard of the fleet, small enough for a 2-CPU node, as JSON for kubectl apply.
    `ha`: two Redis replicas besides the primary, writes wait for one, three Sentinels."""
    managed: dict[str, Any] = {
        "storage": {"size": "64Mi"},
        "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}},
        **({"image": REDIS_IMAGE} if REDIS_IMAGE else {}),
        **({"replicas": 2, "minReplicas": 1} if ha else {}),
    }
    small: dict[str, Any] = {
        "replicas": 1,
        "redis": {"managed": managed},
        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}},
        **({"image": SHARD_IMAGE} if SHARD_IMAGE else {}),
    }
    return json.dumps(relayshard(name, FLEET, **{**small, **spec}))


def shard_map(e2e: Env) -> ShardMap | None:
    cm = e2e.get("configmap", f"relayfleet-{FLEET}-shardmap")
    if cm is None:
        return None
    data: Any = cm["data"]
    return loads_shard_map(data["shardmap.json"])


def slots_of(m: ShardMap) -> dict[str, int]:
    out = dict.fromkeys(m.shards, 0)
    for r in m.ranges:
        out[r.shard] += r.end - r.start + 1
    return out


def primary_pod(e2e: Env, shard: str) -> str:
    """The Pod of `shard`'s Redis that takes writes: the one a replicated shard's status names
    (as its Sentinels report it: a Pod DNS name or IP), else the only one."""
    pods = e2e.pods(f"relayfleet.dev/shard={shard},app.kubernetes.io/component=redis")
    if len(pods) == 1:  # one Redis (its status names the Service)
        return str(pods[0]["metadata"]["name"])
    obj: Any = e2e.get("rshard", shard)
    primary = (((obj or {}).get("status") or {}).get("redis") or {}).get("primary") or ""
    if not primary:
        raise LookupError(f"shard {shard} names no primary yet")
    host = primary.rsplit(":", 1)[0]
    for pod in pods:
        name = str(pod["metadata"]["name"])
        if host.split(".", 1)[0] == name or (pod.get("status") or {}).get("podIP") == host:
            return name
    raise LookupError(f"no Redis pod of shard {shard} is {host}")


def phase(e2e: Env, kind: str, name: str) -> str | None:
    obj: Any = e2e.get(kind, name)
    return None if obj is None else (obj.get("status") or {}).get("phase")


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def relay_url(e2e: Env) -> str:
    return e2e.service_url(FLEET_SERVICE, 80)
