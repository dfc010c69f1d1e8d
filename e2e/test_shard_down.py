"""A shard that is down costs only the queues in its slots (docs/api.md, `GET /readyz`).

Shards a and b are Ready with the slots split between them. Shard c joins whose Redis cannot
start (its claim names a StorageClass that does not exist): every relay stays Ready, the fleet
Service keeps all of them as endpoints, every queue of a and b is served under the recording
workload, `/readyz` of each relay names c, and c's status says why. Then b's Redis is cut off
from every relay (iptables DROP in its network namespace): a's queues are still served, b's
answer 503 `unavailable` with Retry-After, and `/readyz` names b as well.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from e2e.env import FLEET, Env
from e2e.node_faults import partitioned
from e2e.probes import FLEET_SERVICE, TIMINGS, phase, relay_url, shard, shard_map, slots_of, wait_for
from e2e.workload import Workload, window_figures
from relay.fleet.sharding import ShardMap
from relay.protocol import keypair, sign_headers

pytestmark = pytest.mark.timeout(420)
RELAY_PORT = 8080
NO_SUCH_CLASS = "e2e-no-such-storage-class"
FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> Iterator[None]:
    yield
    print(f"e2e shard-down figures: {json.dumps(FIGURES)}")


def relay_pods(e2e: Env) -> list[dict[str, Any]]:
    return e2e.pods("app.kubernetes.io/component=relay")


def pod_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def ready_endpoints(e2e: Env) -> int:
    """Ready endpoints of the fleet Service, as kube-proxy sees them."""
    doc = e2e.get("endpointslices", "-l", f"kubernetes.io/service-name={FLEET_SERVICE}")
    return sum(
        1
        for s in (doc or {}).get("items") or ()
        for ep in s.get("endpoints") or ()
        if (ep.get("conditions") or {}).get("ready")
    )


def every_relay_serving(e2e: Env, relays: int) -> bool:
    pods = relay_pods(e2e)
    return len(pods) == relays and all(map(pod_ready, pods)) and ready_endpoints(e2e) == relays


def request(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return int(resp.status), json.loads(resp.read() or b"{}"), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"{}"), dict(exc.headers)


def readyz_of_each_relay(e2e: Env) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each relay Pod's own /readyz (not one the Service picks)."""
    out = {}
    for pod in relay_pods(e2e):
        name = pod["metadata"]["name"]
        host, port = e2e.pod_address(name, RELAY_PORT)
        status, doc, _ = request(f"http://{host}:{port}/readyz")
        out[name] = (status, doc)
    return out


def every_readyz_names(e2e: Env, down: set[str]) -> dict[str, tuple[int, dict[str, Any]]] | None:
    """Every relay answers 200 and names exactly `down` as its down shards."""
    seen = readyz_of_each_relay(e2e)
    ok = seen and all(s == 200 and set(d.get("shardsDown") or ()) == down for s, d in seen.values())
    return seen if ok else None


def on_shards(m: ShardMap, per_shard: dict[str, int]) -> Callable[[bytes], bool]:
    """A Workload's `accept`: queues on the given shards, so many on each."""
    left = dict(per_shard)

    def accept(public: bytes) -> bool:
        owner = m.shard_for(public)
        if left.get(owner, 0) <= 0:
            return False
        left[owner] -= 1
        return True

    return accept


def not_ok(work: Workload) -> dict[str, int]:
    """Requests of the workload answered other than 200/201 (or not at all), by op and status."""
    failed: dict[str, int] = {}
    for e in work.history.events:
        if e["status"] not in (200, 201):
            key = f"{e['op']} {e['status']}"
            failed[key] = failed.get(key, 0) + 1
    return failed


def delivered_per_queue(work: Workload, since: float = 0.0, until: float = float("inf")) -> dict[str, int]:
    """Messages delivered per queue by reads begun in [since, until]."""
    counts = {q.name: 0 for q in work.qs}
    for e in work.history.events:
        if e["op"] == "deliver" and since <= e["t0"] <= until:
            counts[e["queue"]] += len(e["items"])
    return counts


def finish(e2e: Env, work: Workload, name: str) -> dict[str, Any]:
    work.stop(timeout=120)
    work.history.save(str(e2e.workdir / f"history-{name}.jsonl"))
    verdict = work.history.check()
    figures = {
        "stored": work.stored,
        "delivered": verdict.counts.get("messages_delivered", 0),
        "requests": len(work.history.events),
        "not_2xx": not_ok(work),
        "not_sent_no_endpoint": work.connect_failures,
        "delivered_per_queue": delivered_per_queue(work),
        "verdict": "ok" if verdict.ok else verdict.by_kind(),
    }
    FIGURES[name] = figures
    print(f"{name}: {json.dumps(figures)}")
    assert verdict.ok, verdict.render()
    assert verdict.counts.get("messages_delivered", 0) >= work.stored
    return figures


@pytest.fixture(scope="module")
def split(e2e: Env) -> ShardMap:
    """Shards a and b Ready, the slots split between them."""
    t0 = time.monotonic()
    for name in ("a", "b"):
        e2e.kubectl("apply", "-f", "-", input=shard(name))
    for name in ("a", "b"):
        wait_for(f"shard {name} Ready", partial(shard_ready, e2e, name), timeout=180)
    rebalance = {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayRebalance",
        "metadata": {"name": "split"},
        "spec": {"fleet": FLEET, "mode": "weight", "autoApprove": True},
    }
    e2e.kubectl("apply", "-f", "-", input=json.dumps(rebalance))
    wait_for("slots split between a and b", lambda: phase(e2e, "rrebalance", "split") == "Ready", timeout=120)
    m = shard_map(e2e)
    assert m is not None
    assert min(slots_of(m).values()) > 0, slots_of(m)
    wait_for("both relays serving", lambda: every_relay_serving(e2e, 2), timeout=60)
    FIGURES["a and b Ready, slots split (s)"] = round(time.monotonic() - t0, 1)
    return m


def shard_ready(e2e: Env, name: str) -> bool:
    return phase(e2e, "rshard", name) == "Ready"


def c_says_why(e2e: Env) -> str | None:
    obj: Any = e2e.get("rshard", "c")
    conds = ((obj or {}).get("status") or {}).get("conditions") or ()
    msg = next((str(c.get("message", "")) for c in conds if c.get("type") == "Ready"), "")
    return msg if "PersistentVolumeClaim" in msg and NO_SUCH_CLASS in msg else None


def test_a_shard_that_cannot_start_costs_no_other_queue(e2e: Env, split: ShardMap) -> None:
    storage = {"size": "64Mi", "storageClassName": NO_SUCH_CLASS}
    managed = json.loads(shard("c"))["spec"]["redis"]["managed"]
    e2e.kubectl("apply", "-f", "-", input=shard("c", redis={"managed": {**managed, "storage": storage}}))
    why = wait_for("c's status says why its Redis is not up", lambda: c_says_why(e2e), timeout=90)
    FIGURES["c status"] = why
    assert phase(e2e, "rshard", "c") != "Ready"
    # c's relay too: it serves a's and b's queues like the others
    wait_for("three relays Ready, all endpoints of the fleet Service", lambda: every_relay_serving(e2e, 3))
    seen = wait_for("every relay's /readyz names c", lambda: every_readyz_names(e2e, {"c"}), timeout=60)
    FIGURES["readyz with c down"] = next(iter(seen.values()))[1]

    work = Workload(lambda: relay_url(e2e), accept=on_shards(split, {"a": 4, "b": 4}), seed=31).start()
    try:
        wait_for("messages stored with c down", lambda: work.stored >= 60, timeout=90)
        assert every_relay_serving(e2e, 3)
    finally:
        figures = finish(e2e, work, "c cannot start")
    assert figures["not_2xx"] == {}, figures
    assert all(n > 0 for n in figures["delivered_per_queue"].values()), figures
    assert c_says_why(e2e)


def test_a_shard_whose_redis_is_cut_off_costs_only_its_own_queues(e2e: Env, split: ShardMap) -> None:
    b_redis = e2e.get("pod", "relayfleet-b-redis-0")
    assert b_redis is not None
    relay_ips = [p["status"]["podIP"] for p in relay_pods(e2e)]
    assert len(relay_ips) == 3
    b_queues: list[tuple[str, bytes]] = []
    while len(b_queues) < 2:
        public, private = keypair()
        if split.shard_for(public) == "b":
            b_queues.append((base64.urlsafe_b64encode(public).rstrip(b"=").decode(), private))

    work = Workload(lambda: relay_url(e2e), queues=6, accept=on_shards(split, {"a": 6}), seed=32).start()
    answers: list[dict[str, Any]] = []
    try:
        wait_for("messages stored on a before the cut", lambda: work.stored >= 20, timeout=60)
        with partitioned(b_redis, "redis", relay_ips):
            start = time.monotonic()
            seen = wait_for(
                "every relay's /readyz names b and c", lambda: every_readyz_names(e2e, {"b", "c"}), timeout=60
            )
            FIGURES["readyz with b cut off"] = next(iter(seen.values()))[1]
            mark = work.stored
            base = relay_url(e2e)
            for queue, private in b_queues:
                path = f"/v1/queues/{queue}/messages"
                t0 = time.monotonic()
                post = request(base + path, "POST", b"x", {"Content-Type": "application/octet-stream"})
                t1 = time.monotonic()
                get = request(base + path + "?wait=0", headers=sign_headers(private, "GET", path + "?wait=0"))
                t2 = time.monotonic()
                for (status, doc, headers), took in ((post, t1 - t0), (get, t2 - t1)):
                    answers.append({"status": status, "body": doc, "seconds": round(took, 2)})
                    assert status == 503, (status, doc)
                    assert doc.get("code") == "unavailable", doc
                    assert isinstance(doc.get("error"), str), doc
                    assert "Retry-After" in headers, headers
            wait_for("messages stored on a with b cut off", lambda: work.stored >= mark + 40, timeout=90)
            assert every_relay_serving(e2e, 3)
            end = time.monotonic()
        wait_for("b back in every /readyz", lambda: every_readyz_names(e2e, {"c"}), timeout=90)
    finally:
        FIGURES["b's queues while cut off"] = answers
        figures = finish(e2e, work, "b cut off")
    FIGURES["b cut off"]["window"] = window_figures(work.history, start, end)
    FIGURES["b cut off"]["delivered_in_window"] = delivered_per_queue(work, start, end)
    assert figures["not_2xx"] == {}, figures
    assert all(n > 0 for n in FIGURES["b cut off"]["delivered_in_window"].values()), FIGURES["b cut off"]
    TIMINGS["b cut off"] = round(end - start, 1)
