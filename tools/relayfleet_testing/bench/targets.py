"""The systems under test: how each is started, stopped, and addressed.

Every HTTP target is described by a :class:`Target`, so a scenario is written once and runs
against the relay (this checkout's or --baseline's) and nginx + nchan alike.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from relayfleet_testing.bench.cputime import CpuWindow, total_cpu_seconds
from relayfleet_testing.bench.loadgen import Conn, HttpError
from relayfleet_testing.bench.procs import (
    DEFAULT_GROUP_NICE,
    GROUP_NICE_ENV,
    BenchError,
    Child,
    Procs,
    child_pids,
    rss_kib,
    wait_port,
)
from relayfleet_testing.localredis import free_port, redis_server_binary

from relay.retrying import READY_POLL, retrying
from relay.storage.keys import b64

NGINX = "/usr/sbin/nginx"
NCHAN_MODULE = "/usr/lib/nginx/modules/ngx_nchan_module.so"
REPO = Path(__file__).resolve().parents[3]
# The peer's nginx + nchan config is shared with the other systems measured against it, so it
# lives in the shared folder beside the checkout (../shared/peers/nchan.conf), not in the repo;
# the variable points at it from anywhere else (e.g. an installed relayfleet-testing).
NCHAN_CONF_ENV = "RELAYFLEET_BENCH_NCHAN_CONF"
SHARED_NCHAN_CONF = REPO.parent / "shared" / "peers" / "nchan.conf"
# for the bench commands' --help (every variable documented)
ENV_HELP = f"""environment:
  {NCHAN_CONF_ENV}  the nchan peer config to render [default {SHARED_NCHAN_CONF}]
  {GROUP_NICE_ENV}  the scheduling-group nice of every process the bench starts, 0 = unchanged
    [default {DEFAULT_GROUP_NICE}]"""


@dataclass
class Target:
    """One HTTP server under test: the relay (one process) or nginx + nchan (one worker)."""

    name: str  # the id in tables: relay-1p, baseline-1p, nchan-redis
    kind: str  # relay | nchan
    port: int
    children: list[Child] = field(default_factory=list)
    # nginx serves from worker processes; their pids are looked up when RSS is wanted
    master_pid: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def enqueue_path(self, recipient: bytes) -> str:
        return f"/rpub/{recipient.hex()}" if self.kind == "nchan" else f"/v1/queues/{b64(recipient)}/messages"

    def poll_path(self, recipient: bytes, wait_s: int) -> str:
        return (
            f"/rsub/{recipient.hex()}"
            if self.kind == "nchan"
            else f"/v1/queues/{b64(recipient)}/messages?wait={wait_s}"
        )

    def live_path(self, recipient: bytes) -> str:
        # nchan's /rws/ is added when rendering the shared config
        return f"/rws/{recipient.hex()}" if self.kind == "nchan" else f"/v1/queues/{b64(recipient)}/live"

    def rss_kib(self) -> int:
        pids = child_pids(self.master_pid) if self.master_pid else [c.pid for c in self.children]
        return sum(rss_kib(p) for p in pids)

    def cpu_seconds(self) -> float:
        """CPU of every server process (nginx: master and workers) so far."""
        return total_cpu_seconds(c.pid for c in self.children)

    def check_alive(self) -> None:
        for c in self.children:
            if not c.alive():
                raise BenchError(f"{c.name} exited with status {c.popen.returncode}:\n{c.log_tail()}")


@dataclass
class RedisServer:
    port: int
    child: Child

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_seconds(self) -> float:
        """redis-server's CPU so far, its background threads and forks (AOF rewrites) included."""
        return total_cpu_seconds([self.child.pid])

    async def flushall(self) -> None:
        """Empty Redis between runs, and leave nothing of the last run running or pending.

        The AOF is also rewritten (now nearly empty), so every run starts from the same AOF size
        and an automatic rewrite during a run is caused by that run's writes alone; the
        rewrite's fork is waited for, so its CPU stays out of the next run's window.
        """
        client = aioredis.Redis(port=self.port)
        try:
            await _settle(client)
            await client.flushall()
            await _rewrite_aof(client)
        finally:
            await client.aclose()

    async def settle(self, within: float = 60.0) -> None:
        """Wait until no AOF rewrite or snapshot fork is running or scheduled."""
        client = aioredis.Redis(port=self.port)
        try:
            await _settle(client, within)
        finally:
            await client.aclose()


class CpuMeter:
    """The CPU a server and its Redis spend over one window of a run (cputime.CpuWindow).

    The window opens once Redis has no fork running or scheduled; the server's reading
    closes at ``close``, Redis's after any fork the window started has finished, so an AOF
    rewrite the run caused is counted and one before it is not.
    """

    def __init__(self, target: Target, redis: RedisServer) -> None:
        self.target, self.redis = target, redis
        self._server0, self._redis0 = target.cpu_seconds(), redis.cpu_seconds()

    @classmethod
    async def open(cls, target: Target, redis: RedisServer) -> CpuMeter:
        await redis.settle()
        return cls(target, redis)

    async def close(self, messages: int) -> CpuWindow:
        server_s = self.target.cpu_seconds() - self._server0
        await self.redis.settle()
        return CpuWindow(server_s, self.redis.cpu_seconds() - self._redis0, messages)


async def _rewrite_aof(client: aioredis.Redis) -> None:
    """Rewrite the AOF and wait for it; an automatic rewrite Redis started between our settle
    and BGREWRITEAOF ("already in progress") is waited for, then ours runs on the empty data."""
    for _ in range(3):
        try:
            await client.bgrewriteaof()
        except aioredis.ResponseError as exc:
            if "already in progress" not in str(exc):
                raise
            await _settle(client)
            continue
        await _settle(client)
        return
    raise BenchError("redis-server: an AOF rewrite kept running, so the AOF could not be emptied")


async def _settle(client: aioredis.Redis, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    busy = ("aof_rewrite_in_progress", "aof_rewrite_scheduled", "rdb_bgsave_in_progress")
    while True:
        info = await client.info("persistence")
        if not any(int(info.get(k, 0)) for k in busy):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"redis-server: a background save or AOF rewrite still ran after {within:.0f} s")
        await asyncio.sleep(0.02)


async def start_redis(procs: Procs) -> RedisServer:
    port = free_port()
    data = procs.workdir / f"redis-{port}"
    data.mkdir()
    argv = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data)]
    argv += ["--save", "", "--maxmemory-policy", "noeviction", "--daemonize", "no"]
    # as production shards run (docs/operator.md): AOF, fsync every second
    argv += ["--appendonly", "yes", "--appendfsync", "everysec"]
    child = procs.start("redis-server", argv)
    await wait_port(port, child)
    return RedisServer(port, child)


async def wait_http(
    port: int, path: str, child: Child, within: float = 30.0, method: str = "GET", body: bytes = b""
) -> None:
    """Wait until `method path` answers 2xx (readiness, or a first publish that works), failing
    fast if the child exits."""
    await wait_port(port, child, within)

    async def answered() -> None:
        if not child.alive():  # not retried: fails at once
            raise BenchError(f"{child.name} exited with status {child.popen.returncode}:\n{child.log_tail()}")
        conn = await Conn.open("127.0.0.1", port)
        try:
            resp = await asyncio.wait_for(conn.request(method, path, body), 2.0)
        finally:
            conn.close()
        if not 200 <= resp.status < 300:
            raise _NotReady(f"status {resp.status}")

    not_ready = (OSError, HttpError, TimeoutError, _NotReady)
    try:
        await retrying(READY_POLL, not_ready, deadline=asyncio.get_running_loop().time() + within)(answered)
    except not_ready as exc:
        last = str(exc) if isinstance(exc, _NotReady) else type(exc).__name__
        raise BenchError(f"{child.name}: {method} {path} not ready within {within:.0f} s ({last})") from None


class _NotReady(Exception):
    """A server that answered, but not 2xx yet."""


def nchan_conf() -> Path:
    """The shared nchan config: $RELAYFLEET_BENCH_NCHAN_CONF, else ../shared/peers/nchan.conf
    beside the checkout; BenchError naming both when it is not there."""
    given = os.environ.get(NCHAN_CONF_ENV)
    path = Path(given).expanduser() if given else SHARED_NCHAN_CONF
    if not path.is_file():
        where = f"{NCHAN_CONF_ENV} names {path}" if given else f"expected beside the checkout at {path}"
        raise BenchError(
            f"the nchan peer config is missing ({where}): point {NCHAN_CONF_ENV} at the shared nchan.conf"
        )
    return path


# The bench's own limits (docs/benchmarks.md): one load generator on 127.0.0.1 is one client,
# so the per-client quota's defaults (10,000 messages / 32 MiB per 5 s) would throttle every
# throughput run. It stays on, so its check is in every measured enqueue, with buckets no run
# can empty.
BENCH_RELAY_ENV = {"RELAY_CLIENT_RATE_MESSAGES": str(1 << 40), "RELAY_CLIENT_RATE_BYTES": str(1 << 60)}


# The relay of an older checkout, measured beside this one's (`relayfleet bench --baseline DIR`).
BASELINE = "baseline"


def relay_tree(path: Path) -> Path:
    """A checkout to run a relay from: a folder holding the ``relay`` package; BenchError if not."""
    tree = path.expanduser().resolve()
    if not (tree / "relay" / "__init__.py").is_file():
        raise BenchError(f"{tree} holds no relay package (relay/__init__.py)")
    return tree


def tree_env(tree: Path) -> dict[str, str]:
    """The relay's environment for ``tree``: its own operator package (the relay's CLI imports
    it) ahead of the installed one, else an older tree's relay meets this tree's operator."""
    operator = tree / "operator"
    if not operator.is_dir():
        return dict(BENCH_RELAY_ENV)
    return {**BENCH_RELAY_ENV, "PYTHONPATH": os.pathsep.join([str(tree), str(operator)])}


async def start_relay(procs: Procs, redis_url: str, tree: Path = REPO, name: str = "relay") -> Target:
    """A relay process run from ``tree``: ``python -m`` puts the working directory first on
    sys.path, so the tree's own relay package is the one imported (the interpreter and its
    installed dependencies are the same for every tree)."""
    port = free_port()
    argv = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--redis-url", redis_url, "--auth", "none"]
    child = procs.start(name, argv, env=tree_env(tree), cwd=tree)
    await wait_http(port, "/readyz", child)
    return Target(f"{name}-1p", "relay", port, [child])


def render_nchan_conf(
    template: str, prefix: Path, port: int, redis_url: str, connections: int, shm_mib: int
) -> str:
    """The shared peer config with its three variables filled in, plus bench-only changes.

    Changes (recorded in docs/benchmarks.md): worker_connections and worker_rlimit_nofile
    raised so 10,000 idle long-polls or WebSockets fit; nchan_max_reserved_memory raised so a
    few seconds of 4-64 KiB publishes fit in shared memory; request bodies up to 128 KiB
    buffered in memory (as aiohttp does) instead of temp files; a static ``/bench/static``
    location to calibrate the load generator; ``/rws/`` (a WebSocket subscriber with the
    ``/rsub/`` Redis storage) and ``/bench/nchan_status`` (nchan_stub_status: how many
    subscribers wait) for the wake head to head.
    """
    values = {"PREFIX": str(prefix), "PORT": str(port), "REDIS_URL": redis_url}

    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            raise BenchError(f"nchan.conf uses an unknown variable ${{{key}}}")
        return values[key]

    text = re.sub(r"\$\{(\w+)\}", sub, template)
    text, n = re.subn(r"worker_connections\s+\d+;", f"worker_connections {connections};", text)
    if n != 1:
        raise BenchError("nchan.conf: expected one worker_connections directive")
    text, n = re.subn(r"nchan_max_reserved_memory\s+\w+;", f"nchan_max_reserved_memory {shm_mib}M;", text)
    if n != 1:
        raise BenchError("nchan.conf: expected one nchan_max_reserved_memory directive")
    # the worker's own open-files limit: each connection holds a descriptor (Redis ones too)
    text = text.replace("events {", f"worker_rlimit_nofile {connections + 512};\nevents {{", 1)
    text = text.replace("http {", "http {\n  client_body_buffer_size 128k;", 1)
    listen = f"listen 127.0.0.1:{port};"
    if listen not in text:
        raise BenchError("nchan.conf: expected a 'listen 127.0.0.1:${PORT};' line")
    storage = re.search(r"nchan_redis_pass\s+(\w+);", text)
    if storage is None:
        raise BenchError("nchan.conf: expected a location with nchan_redis_pass (the Redis storage)")
    bench_only = (
        '    location = /bench/static { return 200 "ok"; }',
        "    location = /bench/nchan_status { nchan_stub_status; }",
        "    location ~ /rws/(\\w+)$ { nchan_subscriber websocket; nchan_channel_id $1; "
        f"nchan_redis_pass {storage.group(1)}; }}",
    )
    return text.replace(listen, "\n".join((listen, *bench_only)), 1)


def _nginx_prefix(workdir: Path, port: int, redis_url: str, connections: int, shm_mib: int) -> Path:
    """Create nginx's prefix folder with the rendered config; return the config's path."""
    for binary in (NGINX, NCHAN_MODULE):
        if not Path(binary).exists():
            raise BenchError(f"{binary} is missing (Debian: apt-get install nginx libnginx-mod-nchan)")
    template = nchan_conf().read_text()
    prefix = workdir / f"nginx-{port}"
    prefix.mkdir()
    temps = ("tmp-body", "tmp-proxy", "tmp-fcgi", "tmp-uwsgi", "tmp-scgi")
    for sub in (*temps, "logs"):
        (prefix / sub).mkdir()
    conf = prefix / "nginx.conf"
    conf.write_text(render_nchan_conf(template, prefix, port, redis_url, connections, shm_mib))
    # workers run as an unprivileged user when the bench runs as root: let them reach the prefix
    for path in (workdir, prefix):
        path.chmod(0o711)
    for sub in temps:
        (prefix / sub).chmod(0o777)
    return conf


async def start_nchan(procs: Procs, redis_url: str, shm_mib: int = 4096) -> Target:
    """One nginx (one worker, as the shared config says) with nchan's Redis storage."""
    # nginx cannot raise its own fd limit here (no CAP_SYS_RESOURCE): stay under ours
    connections = max(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 512)
    port = free_port()
    conf = _nginx_prefix(procs.workdir, port, redis_url, connections, shm_mib)
    child = procs.start("nginx", [NGINX, "-c", str(conf), "-p", str(conf.parent), "-g", "daemon off;"])
    await wait_http(port, "/bench/static", child)
    # nchan connects to Redis after it starts listening: wait until a Redis-backed publish works
    await wait_http(port, "/rpub/benchready", child, 20.0, "POST", b"ready")
    return Target("nchan-redis", "nchan", port, [child], master_pid=child.pid)
