"""Operator phase: N RelayShards on a real kube-apiserver with kwok nodes, the operator as a
subprocess with its production settings (resync 30 s), every shard on its own redis-server
(external Redis, one relay replica: a kwok Pod).

Figures, each against an anchor from the same run:
- time until all N are Ready (they join in batches of 1, N/10 - 1 and the rest, all applied at
  once) against the founder's time to Ready alone;
- API requests per minute at rest, the operator's (apiserver_request_total deltas with the
  operator running, less the control plane's own in an equal window before it started): a hot
  loop shows here; per shard and minute against the control plane's own rate;
- operator RSS with N shards against its RSS with one;
- slot migrations among the N (auto-approved RelayRebalances with explicit moves of 64 of the
  founder's slots each): one against the same among the first tenth, eight at once against
  eight times one; API requests per minute during one; RSS after them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from relayfleet_testing.bench.procs import rss_kib
from relayfleet_testing.bench.scale.report import Figure, Growth, PhaseReport
from relayfleet_testing.kwok import Kwok, build_control_plane, kwok_cluster
from relayfleet_testing.localredis import LocalRedis, free_port, redis_server_binary

Say = Callable[[str], None]
REPO = Path(__file__).resolve().parents[4]
FLEET = "main"
MOVES = 8  # moves of the several-moves rebalance, all at once (the CRD allows 16 at once)
_REQUESTS = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$", re.M)
# the operator's own log line when a shard's phase leaves Ready (shards.reconcile's PhaseChanged)
_LEFT_READY = re.compile(r"PhaseChanged: phase Ready -> (?!Ready)")
_RECONCILE = re.compile(
    r"^relayfleet_operator_reconcile_duration_seconds_(?P<what>sum|count)"
    r'\{kind="RelayShard"\} (?P<v>\S+)$',
    re.M,
)
_RESOURCE = re.compile(r'resource="([^"]*)"')


def shard_doc(name: str, url: str) -> dict[str, Any]:
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayShard",
        "metadata": {"name": name},
        "spec": {"fleet": FLEET, "redis": {"external": {"url": url}}, "replicas": 1},
    }


def rebalance_doc(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayRebalance",
        "metadata": {"name": name},
        "spec": {"fleet": FLEET, "autoApprove": True, **spec},
    }


def api_requests(k: Kwok) -> dict[str, float]:
    """apiserver_request_total summed per resource (the /metrics read itself has none)."""
    text = k.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, float] = {}
    for m in _REQUESTS.finditer(text):
        res = _RESOURCE.search(m.group("labels"))
        name = res.group(1) if res and res.group(1) else "(non-resource)"
        out[name] = out.get(name, 0.0) + float(m.group("value"))
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # it answers
    except OSError:
        return False


class Scene:
    """The namespace, the shards' redis-servers and the operator of one run."""

    def __init__(self, k: Kwok, workdir: Path, say: Say, env: dict[str, str]) -> None:
        self.k, self.workdir, self.say, self.env = k, workdir, say, env
        self.ns = f"rf-scale-{uuid.uuid4().hex[:6]}"
        self.servers: dict[str, LocalRedis] = {}
        self.operator: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.next_slot = 0  # the founder's slots from here on have not moved
        self.stuck: list[str] = []  # migrations that did not finish in time
        # outside the work folder, which goes with the cluster: kept for a failed run's reader
        fd, log = tempfile.mkstemp(prefix="relayfleet-scale-operator-", suffix=".log")
        os.close(fd)
        self.log = Path(log)

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        proc = subprocess.run(
            [str(self.k.bin_dir / "kubectl"), "--kubeconfig", str(self.k.kubeconfig), "-n", self.ns, *args],
            input=stdin, capture_output=True, text=True, check=False, timeout=300,
            env={**os.environ, **self.k.env},
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:3])} failed: {proc.stderr.strip()[-400:]}")
        return proc.stdout

    def apply(self, *docs: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(list(docs)))

    def setup(self) -> None:
        self.k.kubectl("create", "namespace", self.ns)
        self.k.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        self.k.kubectl(
            "wait", "--for=condition=Established", "crd/relayshards.relayfleet.dev",
            "crd/relayrebalances.relayfleet.dev", "--timeout=60s",
        )  # fmt: skip

    def redis(self, names: list[str]) -> None:
        for name in names:
            self.servers[name] = LocalRedis(
                binary=redis_server_binary(),
                dir=tempfile.mkdtemp(prefix="relayfleet-scale-op-", dir=self.workdir),
                extra_args=["--appendonly", "no"],
            ).start(30)

    def start_operator(self) -> float:
        """Start the operator; seconds until its liveness endpoint answers (kopf is up)."""
        health, self.metrics_port = free_port(), free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(self.k.kubeconfig),
            **self.env,
            "RELAYFLEET_OPERATOR_HEALTH_PORT": str(health),
            "RELAYFLEET_OPERATOR_METRICS_PORT": str(self.metrics_port),
        }
        with self.log.open("ab") as log:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "relayfleet_operator", "--namespace", self.ns],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            )  # fmt: skip
        return self.wait("the operator's liveness endpoint", partial(_answers, health), 300)

    def rss(self) -> int:
        assert self.operator is not None
        if self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited ({self.operator.returncode}); see {self.log}")
        return rss_kib(self.operator.pid) * 1024

    def flaps(self) -> int:
        """Times a shard left Ready so far (the operator's log)."""
        return len(_LEFT_READY.findall(self.log.read_text(errors="replace")))

    def reconciles(self) -> tuple[float, float]:
        """(seconds, count) of the RelayShard reconciles so far (the operator's /metrics)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        got = {m.group("what"): float(m.group("v")) for m in _RECONCILE.finditer(text)}
        return got.get("sum", 0.0), got.get("count", 0.0)

    def wait(self, what: str, done: Callable[[], bool], timeout: float) -> float:
        """Seconds until `done()`; polled every second (the poll's own requests are not in the
        at-rest windows)."""
        t0 = time.monotonic()
        while not done():
            self.rss()  # the operator is still alive
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{what}: not within {timeout:.0f} s; see {self.log}")
            time.sleep(1.0)
        return time.monotonic() - t0

    def ready_count(self) -> int:
        items = json.loads(self.kubectl("get", "rshard", "-o", "json"))["items"]
        return sum(1 for i in items if (i.get("status") or {}).get("phase") == "Ready")

    def move(self, name: str, pairs: list[tuple[str, str]], timeout: float) -> float:
        """Seconds until an approved RelayRebalance moving 64 of the founder's slots to each
        `to` is Ready (each call moves slots no call moved before); NaN when it is not Ready
        within `timeout` (said in the notes: the run goes on, the figures after it still count)."""
        moves = []
        for src, dst in pairs:
            moves.append({"slots": f"{self.next_slot}-{self.next_slot + 63}", "from": src, "to": dst})
            self.next_slot += 64
        self.apply(rebalance_doc(name, concurrency=len(pairs), proposal={"moves": moves}))
        try:
            return self.wait(f"rebalance {name}", partial(self.rebalance_ready, name), timeout)
        except RuntimeError:
            phase = self.rebalance_phase(name)
            self.stuck.append(f"rebalance {name} was still {phase} after {timeout:.0f} s")
            self.say(f"operator: {self.stuck[-1]}")
            return math.nan

    def rebalance_ready(self, name: str) -> bool:
        return self.rebalance_phase(name) == "Ready"

    def all_ready(self, n: int) -> bool:
        return self.ready_count() >= n

    def rebalance_phase(self, name: str) -> str:
        got = json.loads(self.kubectl("get", "rrebalance", name, "-o", "json"))
        return str((got.get("status") or {}).get("phase") or "")

    def slot_counts(self) -> dict[str, int]:
        cm = json.loads(self.kubectl("get", "configmap", f"relayfleet-{FLEET}-shardmap", "-o", "json"))
        from relay.fleet.sharding import loads_shard_map

        return loads_shard_map(cm["data"]["shardmap.json"]).slot_counts()

    def rest_rate(self, seconds: float) -> tuple[float, dict[str, float]]:
        """API requests per minute over a quiet window of `seconds`, and per resource."""
        before = api_requests(self.k)
        time.sleep(seconds)
        d = delta(api_requests(self.k), before)
        return sum(d.values()) * 60 / seconds, d

    def close(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(10)
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
            for name in self.kubectl("get", "rshard", "-o", "name").split():
                self.kubectl("patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
            self.k.kubectl("delete", "namespace", self.ns, "--wait=false")
        for s in self.servers.values():
            s.stop()


@contextlib.contextmanager
def cluster(kubeconfig: Path | None, workdir: Path, nodes: int, say: Say) -> Iterator[Kwok]:
    bin_dir = build_control_plane(REPO)
    if kubeconfig is not None:
        yield Kwok("given", kubeconfig, bin_dir)
        return
    say(f"operator: starting a kwok cluster with {nodes} nodes")
    with kwok_cluster(bin_dir, workdir, nodes) as k:
        yield k


def run(
    shards: int,
    rest_seconds: float,
    kubeconfig: Path | None,
    env: dict[str, str],
    say: Say,
    migration_timeout: float = 600.0,
) -> PhaseReport:
    report = PhaseReport("operator", {"RelayShards": shards, "rest window s": rest_seconds})
    resync = float(env.get("RELAYFLEET_OPERATOR_RESYNC_SECONDS", 30.0))
    names = [f"s{i:03d}" for i in range(shards)]
    # joined in batches: the founder (all slots), up to a tenth, the rest
    batches = [b for b in (1, shards // 10 - 1) if b > 0]
    batches = [*batches, shards - sum(batches)] if shards > sum(batches) else batches
    # the work folder goes after the cluster (its state, the shards' Redis data, the logs)
    with (
        tempfile.TemporaryDirectory(prefix="relayfleet-scale-operator-") as tmp,
        cluster(kubeconfig, Path(tmp), max(2, shards // 50 + 1), say) as k,
    ):
        workdir = Path(tmp)
        scene = Scene(k, workdir, say, env)
        try:
            scene.setup()
            scene.redis(names)
            say(f"operator: {shards} redis-servers up; the control plane alone for {rest_seconds:.0f} s")
            background, _ = scene.rest_rate(rest_seconds)
            started = scene.start_operator()
            say(f"operator: the operator answers after {started:.1f} s")
            times: list[float] = []
            done = rss_one = anchor_shards = 0
            anchor_move = 0.0
            for size in batches:
                batch = names[done : done + size]
                scene.apply(*(shard_doc(n, scene.servers[n].url) for n in batch))
                done += size
                times.append(
                    scene.wait(f"{done} shards Ready", partial(scene.all_ready, done), 300 + 6 * size)
                )
                say(f"operator: {done}/{shards} RelayShards Ready ({times[-1]:.1f} s for {size})")
                if done == 1:
                    rss_one = scene.rss()
                elif not anchor_shards:  # one migration in the small fleet: the anchor of the big one's
                    anchor_shards = done
                    anchor_move = scene.move("anchor", [(names[0], names[done - 1])], migration_timeout)
            say(f"operator: at rest for {rest_seconds:.0f} s")
            time.sleep(min(10.0, rest_seconds))  # the last status writes settle
            reconciled = scene.reconciles()
            at_rest, per_resource = scene.rest_rate(rest_seconds)
            after_rest = scene.reconciles()
            spent, count = after_rest[0] - reconciled[0], after_rest[1] - reconciled[1]
            rss_rest = scene.rss()
            before, t0 = api_requests(k), time.monotonic()
            one = scene.move("one", [(names[0], names[-1])], migration_timeout)
            during = sum(delta(api_requests(k), before).values()) * 60 / (time.monotonic() - t0)
            several = math.nan  # not tried after one that did not finish: it would wait as long
            if not math.isnan(one):
                pairs = [(names[0], names[-2 - i]) for i in range(min(MOVES, shards - 2))]
                several = scene.move("several", pairs, 2 * migration_timeout)
            flaps = scene.flaps()
            rss_migrated = scene.rss()
            say(f"operator: one migration {one:.1f} s ({anchor_move:.1f} s with {anchor_shards} shards), "
                f"{MOVES} at once {several:.1f} s")  # fmt: skip
        finally:
            scene.close()
    operator_rate = max(0.0, at_rest - background)
    top = sorted(per_resource.items(), key=lambda kv: -kv[1])[:5]
    moves = min(MOVES, shards - 2)
    mib = 2**20
    report.figures += [
        Figure(f"time until all {shards} RelayShards are Ready", sum(times), "s",
               "the founder alone", times[0]),
        Figure("operator API requests per minute at rest", operator_rate, "req/min",
               "the control plane's own (kwok, controllers)", background),
        Figure("operator API requests per minute per shard at rest", operator_rate / shards, "req/min",
               "a status read and write per shard per resync (30 s): 4/min", 4.0),
        Figure(f"operator RSS with {shards} shards", rss_rest / mib, "MiB", "with one shard", rss_one / mib),
        Figure(f"one slot migration (64 slots) among {shards} shards", one, "s",
               f"the same among {anchor_shards} shards", anchor_move),
        Figure(f"{moves} migrations at once (concurrency {moves})", several, "s",
               f"one migration x {moves}", one * moves),
        Figure("API requests per minute during one migration", during, "req/min",
               "at rest, everything", at_rest),
        Figure("operator RSS after the migrations", rss_migrated / mib, "MiB",
               "at rest before them", rss_rest / mib),
        Figure("mean RelayShard reconcile time at rest (lock waits included)",
               spent / count if count else math.nan, "s", "the resync period", resync),
        Figure("shards that left Ready during the run (flaps)", float(flaps), "",
               "none: every Redis answered throughout", None),
    ]  # fmt: skip
    settings = ", ".join(f"{k}={v}" for k, v in env.items()) or "its production settings (resync 30 s)"
    report.growth.append(Growth("time to Ready per batch of shards", "s", tuple(batches), tuple(times)))
    report.notes.append(
        f"The operator with {settings}; its liveness endpoint answered "
        f"{started:.1f} s after start. Requests at rest by resource (operator and control plane, "
        f"{rest_seconds:.0f} s): " + ", ".join(f"{r} {v:.0f}" for r, v in top)
    )
    report.notes += [f"Not finished: {why}." for why in scene.stuck]
    return report
