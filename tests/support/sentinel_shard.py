"""A replicated shard on loopback for the failover tests: a primary, two replicas and
three Sentinels, all real processes (/usr/bin/redis-server, /usr/bin/redis-sentinel)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.fleet.sharding import SentinelTarget
from tests.support.procs import stop_process

DEBIAN_REDIS = "/usr/bin/redis-server"
DEBIAN_SENTINEL = "/usr/bin/redis-sentinel"
SERVICE = "shard-a"
DOWN_AFTER_MS = 1500  # small, yet above most stalls of a loaded 2-core CI box (spurious failovers)
# Smaller still, for the minReplicas fault test: stalls longer than this make the Sentinels
# fail a live primary over, and the relays must not lose what they acknowledged then either
# (they hold minReplicas writes unconfirmed while any Sentinel holds the primary down).
SPURIOUS_DOWN_AFTER_MS = 1000

needs_sentinel = pytest.mark.skipif(
    not (os.path.exists(DEBIAN_REDIS) and os.path.exists(DEBIAN_SENTINEL)),
    reason="needs Debian's redis-server and redis-sentinel (apt-get install redis-server redis-sentinel)",
)


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2) as s:
            s.sendall(b"PING\r\n")
            return b"PONG" in s.recv(64)
    except OSError:
        return False


@dataclass
class SentinelProc:
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(
        self, primary_port: int, service: str, quorum: int = 2, down_after_ms: int = DOWN_AFTER_MS
    ) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {service} 127.0.0.1 {primary_port} {quorum}\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} 2000\n"
            f"sentinel parallel-syncs {service} 2\n"
        )
        self.proc = subprocess.Popen(
            [DEBIAN_SENTINEL, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _ping(self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-sentinel on {self.port} did not start; see {self.dir}")
            time.sleep(0.02)

    def stop(self) -> None:
        stop_process(self.proc, 5)


@dataclass
class ReplicatedShard:
    """Primary + 2 replicas + 3 Sentinels watching them as service `shard-a` (fewer
    replicas with `replicas`; `node_args`: extra redis-server flags of every node)."""

    root: Path
    replicas: int = 2
    node_args: list[str] = field(default_factory=list)
    down_after_ms: int = DOWN_AFTER_MS
    nodes: list[LocalRedis] = field(default_factory=list)
    sentinels: list[SentinelProc] = field(default_factory=list)

    def start(self) -> ReplicatedShard:
        common = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0", *self.node_args]
        primary = LocalRedis(binary=DEBIAN_REDIS, dir=str(self.root / "n0"), extra_args=list(common)).start()
        self.nodes = [primary]
        for i in range(1, self.replicas + 1):
            replica_args = [*common, "--replicaof", "127.0.0.1", str(primary.port)]
            node = LocalRedis(binary=DEBIAN_REDIS, dir=str(self.root / f"n{i}"), extra_args=replica_args)
            self.nodes.append(node.start())
        self.wait_replicas(self.replicas)
        for i in range(3):
            s = SentinelProc(free_port(), self.root / f"s{i}")
            s.start(primary.port, SERVICE, down_after_ms=self.down_after_ms)
            self.sentinels.append(s)
        self.wait_sentinels_know(primary.port)
        return self

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for n in self.nodes:
            n.stop(signal.SIGKILL)

    def target(self, min_replicas: int = 0) -> SentinelTarget:
        return SentinelTarget(
            tuple(("127.0.0.1", s.port) for s in self.sentinels), SERVICE, min_replicas=min_replicas
        )

    def url(self, min_replicas: int = 0) -> str:
        return self.target(min_replicas).url()

    def primary_port(self) -> int | None:
        """The primary as the Sentinels name it (None while none answers)."""
        for s in self.sentinels:
            if s.proc is None or s.proc.poll() is not None:
                continue
            try:
                with redis.Redis(port=s.port, socket_timeout=0.5, socket_connect_timeout=0.5) as r:
                    addr = r.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    def node(self, port: int) -> LocalRedis:
        return next(n for n in self.nodes if n.port == port)

    def wait_replicas(self, n: int, timeout: float = 20.0) -> None:
        """Until the primary has `n` replicas online and caught up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.primary_port() if self.sentinels else self.nodes[0].port
            if port is not None:
                try:
                    with redis.Redis(port=port, socket_timeout=1) as r:
                        info = r.info("replication")
                        online = [
                            v
                            for k, v in info.items()
                            if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
                        ]
                        if info.get("role") == "master" and len(online) >= n:
                            return
                except redis.RedisError:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"the primary did not get {n} replicas online in {timeout}s")

    def wait_sentinels_know(self, primary_port: int, timeout: float = 15.0) -> None:
        """Until every Sentinel names `primary_port` and knows every replica and its peers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for s in self.sentinels:
                try:
                    with redis.Redis(port=s.port, socket_timeout=0.5) as r:
                        m = r.execute_command("SENTINEL", "master", SERVICE)
                        info = dict(zip(m[::2], m[1::2], strict=True)) if isinstance(m, list) else m
                        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in info.items()}
                        ok &= int(fields["port"]) == primary_port
                        ok &= (
                            int(fields["num-slaves"]) >= self.replicas
                            and int(fields["num-other-sentinels"]) >= 2
                        )
                except (redis.RedisError, KeyError):
                    ok = False
            if ok:
                return
            time.sleep(0.1)
        raise AssertionError("the Sentinels did not settle on the primary in time")

    def kill_primary(self) -> LocalRedis:
        port = self.primary_port()
        assert port is not None
        node = self.node(port)
        node.stop(signal.SIGKILL)
        return node

    def wait_failover(self, old_port: int, timeout: float = 75.0) -> int:
        """Until the Sentinels name a new primary that answers as one; its port.

        The bound is not the failover time under test (callers measure that): a Sentinel whose
        process stalled 2 s on a loaded machine goes into TILT and acts on nothing for 30 s, so
        a bound below TILT plus a vote retry fails the run on scheduling, not on the product."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != old_port:
                try:
                    with redis.Redis(port=port, socket_timeout=0.5) as r:
                        if r.execute_command("ROLE")[0] == b"master":
                            return port
                except redis.RedisError:
                    pass
            time.sleep(0.02)
        raise AssertionError(f"no failover within {timeout}s\n{self.describe()}")

    def describe(self) -> str:
        """What each Sentinel and node says now, and each Sentinel's last log lines: a failed
        wait says why (its directory is gone by the time anyone reads a CI log)."""
        out = []
        for s in self.sentinels:
            try:
                with redis.Redis(port=s.port, socket_timeout=0.5, decode_responses=True) as r:
                    m = r.execute_command("SENTINEL", "master", SERVICE)
                    seen = dict(zip(m[::2], m[1::2], strict=True)) if isinstance(m, list) else m
                    view = {k: seen.get(k) for k in ("port", "flags", "num-slaves", "failover-state")}
            except redis.RedisError as exc:
                view = {"error": str(exc)}
            log = s.dir / "sentinel.log"
            tail = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else []
            out += [f"sentinel {s.port}: {view}", *(f"  {line}" for line in tail)]
        for n in self.nodes:
            try:
                with redis.Redis(port=n.port, socket_timeout=0.5) as r:
                    role = r.execute_command("ROLE")[:2]
            except redis.RedisError as exc:
                role = [type(exc).__name__]
            out.append(f"node {n.port}: {role}")
        return "\n".join(out)

    def rejoin(self, node: LocalRedis, primary_port: int) -> None:
        """Start a killed node again as a replica of the current primary (as Sentinel would
        reconfigure it), and wait until it is in sync."""
        args = [a for a in node.extra_args]
        if "--replicaof" in args:
            i = args.index("--replicaof")
            del args[i : i + 3]
        node.extra_args = [*args, "--replicaof", "127.0.0.1", str(primary_port)]
        node.start()
        self.wait_replicas(self.replicas)
