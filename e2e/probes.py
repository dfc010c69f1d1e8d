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
SHARD_IMAGE = os.environ.get("RELAYFLEET_E2E_SHARD_IMAGE", "")
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


def shard(name: str, **spec: Any) -> str:
    """A RelayShard of the fleet, small enough for the test machine, as JSON for kubectl apply."""
    small: dict[str, Any] = {
        "replicas": 1,
        "redis": {"managed": {"storage": {"size": "64Mi"}}},
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        # kind: the image e2e/kind/run.sh built and loaded (ignored by the pod runner).
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
