"""Live presence and displacement on the real node: a RelayShard with two relay replicas, every
socket opened through the fleet Service (kube-proxy picks the Pod).

1. status.live_delivery asked of each relay Pod while a socket opened through the Service is
   open: true through both (the one holding it and the other); false through both after it closes.
2. 20 displacements under load (tests/support/live_displacement.py), each newer socket through the
   Service: 1,000 messages under the history checker, none lost, no frame on a displaced socket
   after its successor's first; the relays' own counts say how many of the takeovers crossed
   from one Pod to the other (relayfleet_live_displaced_total{via="notice"}).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest

from e2e.env import Env
from e2e.probes import http_get, phase, relay_url, shard, wait_for
from tests.support.live_displacement import (
    LiveQueue,
    displace_under_load,
    live_delivery,
    open_live,
    session,
    until_live,
)

pytestmark = pytest.mark.timeout(600)

SHARD = "p"
RELAY_PORT = 8080
FIGURES: dict[str, Any] = {}


def _relay_urls(e2e: Env) -> list[str] | None:
    """Both relay Pods' own URLs, once both are ready."""
    pods = e2e.pods(f"relayfleet.dev/shard={SHARD},app.kubernetes.io/component=relay")
    ready = [
        p
        for p in pods
        if p["metadata"].get("deletionTimestamp") is None
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (p.get("status") or {}).get("conditions") or ()
        )
    ]
    if len(ready) != 2:
        return None
    addresses = [e2e.pod_address(p["metadata"]["name"], RELAY_PORT) for p in ready]
    return [f"http://{host}:{port}" for host, port in addresses]


def _displaced_via(url: str) -> dict[str, float]:
    """The relay's relayfleet_live_displaced_total by `via`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("relayfleet_live_displaced_total{"):
            via = line.split('via="', 1)[1].split('"', 1)[0]
            out[via] = out.get(via, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_presence_and_displacement_through_the_fleet_service(e2e: Env) -> None:
    e2e.kubectl("apply", "-f", "-", input=shard(SHARD, replicas=2))
    wait_for("shard p Ready", lambda: phase(e2e, "rshard", SHARD) == "Ready", 300, 2)
    pods = wait_for("both relays ready", lambda: _relay_urls(e2e), 180, 1)
    url = wait_for("fleet service", lambda: relay_url(e2e), 60)
    wait_for("fleet /readyz", lambda: http_get(url + "/readyz")[0] == 200, 60)
    try:
        asyncio.run(_run(url, pods))
    finally:
        print(f"e2e presence figures: {json.dumps(FIGURES)}")


async def _run(url: str, pods: list[str]) -> None:
    q = LiveQueue()
    async with session() as http:
        ws = await open_live(http, url, q)
        FIGURES["status_true_after_s"] = [round(await until_live(http, p, q, True, 10), 3) for p in pods]
        await ws.close()
        FIGURES["status_false_after_close_s"] = [
            round(await until_live(http, p, q, False, 10), 3) for p in pods
        ]
        assert not any([await live_delivery(http, p, q) for p in pods])
    before = [_displaced_via(p) for p in pods]
    run = await displace_under_load([url, url], cycles=20, total=1000)
    after = [_displaced_via(p) for p in pods]
    crossed = sum(
        a.get(via, 0.0) - b.get(via, 0.0)
        for a, b in zip(after, before, strict=True)
        for via in ("notice", "lease")
    )
    verdict = run.verdict()
    FIGURES["displacement"] = run.figures()
    FIGURES["crossed_relays"] = crossed
    FIGURES["verdict"] = verdict.render()
    assert verdict.ok, verdict.render()
    assert verdict.counts["messages_acknowledged"] == 1000
    assert run.closes == [4409] * 20
    # kube-proxy picks a Pod per connection: 20 opens all on one Pod would be 2^-19 likely
    assert crossed >= 1, (before, after)
