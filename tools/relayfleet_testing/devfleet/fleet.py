"""`relayfleet dev`: local Redis shard(s) and a relay, with a short demo. Ctrl-C stops all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from relayfleet_testing.localredis import LocalRedis

from relay.fleet.sharding import even_split
from relay.retrying import READY_POLL, retrying


def _stop(signum: int, frame: object) -> None:
    # SIGTERM (a supervisor, a test's stop) ends the fleet as Ctrl-C does: Python's default
    # would exit at once and leave the relay and the Redis servers running as orphans
    raise KeyboardInterrupt


def port_taken(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:port (or it cannot be bound)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


async def _own_relay_ready(url: str, relay: subprocess.Popen[bytes], epoch: int, timeout: float) -> None:
    """Wait until the relay answers and is the child started here: it serves the shard map
    epoch only this run wrote (another process on the port would not). RuntimeError when
    the child exits first."""
    import aiohttp

    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:

        async def ours_ready() -> None:
            if relay.poll() is not None:
                raise RuntimeError(f"the relay exited with code {relay.returncode} (see its log above)")
            async with http.get(url + "/readyz") as ready, http.get(url + "/metrics") as metrics:
                if ready.status != 200 or not _serves_epoch(await metrics.text(), epoch):
                    raise _NotYet

        not_yet = (aiohttp.ClientError, TimeoutError, _NotYet)
        try:
            await retrying(READY_POLL, not_yet, deadline=deadline)(ours_ready)
        except not_yet:
            raise TimeoutError(f"relay at {url} not ready after {timeout:.0f}s") from None


class _NotYet(Exception):
    """The relay answers, not ready yet or not the one started here."""


def _serves_epoch(metrics_text: str, epoch: int) -> bool:
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name == "relayfleet_shard_map_epoch":
            return float(value) == epoch
    return False


def run_dev(port: int, shards: int, demo: bool, auth: str, redis_port: int = 0) -> int:
    signal.signal(signal.SIGTERM, _stop)
    if shards < 1 or shards > 64:
        print("relayfleet dev: --shards must be between 1 and 64", file=sys.stderr)
        return 2
    redis_ports = [redis_port + i for i in range(shards)] if redis_port else [0] * shards
    if redis_port and not 0 < redis_port <= 65536 - shards:
        print(f"relayfleet dev: --redis-port must leave room for {shards} ports", file=sys.stderr)
        return 2
    for p, what in [(port, "--port"), *((rp, "--redis-port") for rp in redis_ports if rp)]:
        if port_taken(p):
            print(f"relayfleet dev: {what}: port {p} is already in use", file=sys.stderr)
            return 2
    workdir = tempfile.mkdtemp(prefix="relayfleet-dev-")
    servers: list[LocalRedis] = []
    relay: subprocess.Popen[bytes] | None = None
    try:
        for i in range(shards):
            servers.append(LocalRedis(port=redis_ports[i], dir=os.path.join(workdir, f"shard-{i}")).start())
        names = [chr(ord("a") + i) if i < 26 else f"s{i}" for i in range(shards)]
        # an epoch of this run's own: the relay that serves it is the child started below
        epoch = secrets.randbelow(2**31) + 2
        shard_map = replace(
            even_split("dev", {n: s.url for n, s in zip(names, servers, strict=True)}), epoch=epoch
        )
        map_path = os.path.join(workdir, "shardmap.json")
        with open(map_path, "w") as f:
            f.write(shard_map.dumps())
        print(f"redis shard(s): {', '.join(f'{n}={s.url}' for n, s in zip(names, servers, strict=True))}")
        print(f"shard map: {map_path} (removed on exit)")
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay", "--port", str(port), "--shard-map", map_path, "--auth", auth],
            env={**os.environ, "RELAY_FLEET": "dev"},
        )
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_own_relay_ready(url, relay, epoch, 30))
        print(f"relay ready: {url}   (Ctrl-C stops everything)", flush=True)
        if demo:
            from relayfleet_testing.devfleet.demo import run_demo

            asyncio.run(run_demo(url))
            return 0
        with contextlib.suppress(KeyboardInterrupt):
            while relay.poll() is None:
                time.sleep(0.5)
        return 0 if relay.returncode in (None, 0) else 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, OSError, TimeoutError) as exc:
        print(f"relayfleet dev: {exc}", file=sys.stderr)
        return 1
    finally:
        if relay is not None and relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(15)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
        for s in servers:
            s.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the map and the Redis data: nothing left behind
