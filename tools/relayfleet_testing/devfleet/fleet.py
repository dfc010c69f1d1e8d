"""`relayfleet dev`: local Redis shard(s) and a relay, with a short demo. Ctrl-C stops all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

from relayfleet_testing.localredis import LocalRedis

from relay.fleet.sharding import even_split


def _stop(signum: int, frame: object) -> None:
    # SIGTERM (a supervisor, a test's stop) ends the fleet as Ctrl-C does: Python's default
    # would exit at once and leave the relay and the Redis servers running as orphans
    raise KeyboardInterrupt


def run_dev(port: int, shards: int, demo: bool, auth: str) -> int:
    signal.signal(signal.SIGTERM, _stop)
    if shards < 1 or shards > 64:
        print("relayfleet: --shards must be between 1 and 64", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="relayfleet-dev-")
    servers: list[LocalRedis] = []
    relay: subprocess.Popen[bytes] | None = None
    try:
        for i in range(shards):
            servers.append(LocalRedis(dir=os.path.join(workdir, f"shard-{i}")).start())
        names = [chr(ord("a") + i) if i < 26 else f"s{i}" for i in range(shards)]
        shard_map = even_split("dev", {n: s.url for n, s in zip(names, servers, strict=True)})
        map_path = os.path.join(workdir, "shardmap.json")
        with open(map_path, "w") as f:
            f.write(shard_map.dumps())
        print(f"redis shard(s): {', '.join(f'{n}={s.url}' for n, s in zip(names, servers, strict=True))}")
        print(f"shard map: {map_path}")
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay", "--port", str(port), "--shard-map", map_path, "--auth", auth],
            env={**os.environ, "RELAY_FLEET": "dev"},
        )
        url = f"http://127.0.0.1:{port}"
        from relay.client import wait_ready

        asyncio.run(wait_ready(url, 30))
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
    except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
        print(f"relayfleet dev: {exc}", file=sys.stderr)
        return 1
    finally:
        if relay is not None and relay.poll() is None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(15)
            except subprocess.TimeoutExpired:
                relay.kill()
        for s in servers:
            s.stop()
