"""TEST-ONLY (e2e pod runner): resolve Kubernetes Service names to the loopback ports of the
local processes that stand in for their pods.

The pod runner (e2e/podrunner/services.py) writes a JSON table {"host:port": ["127.0.0.1:P", ...]} to
the file named by RELAYFLEET_E2E_ADDRESSES and puts this directory first on PYTHONPATH of
every process it starts, so `relayfleet-a-redis.ns.svc:6379` reaches the redis-server
standing in for that StatefulSet's pod, the way cluster DNS plus kube-proxy would. Two
places resolve names outside socket.getaddrinfo and are adjusted too: uvloop (replaced by
asyncio's loop) and the MIGRATE target that redis-server connects to itself.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import json
import os
import random
import socket
import sys
from typing import Any

_FILE = os.environ.get("RELAYFLEET_E2E_ADDRESSES", "")
_original = socket.getaddrinfo
_cache: tuple[float, dict[str, list[str]]] = (-1.0, {})


def _table() -> dict[str, list[str]]:
    global _cache
    try:
        mtime = os.stat(_FILE).st_mtime
    except OSError:
        return {}
    if mtime != _cache[0]:
        try:
            with open(_FILE, encoding="utf-8") as f:
                _cache = (mtime, json.load(f))
        except (OSError, ValueError):
            return _cache[1]
    return _cache[1]


def _getaddrinfo(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0) -> Any:
    name = host.decode() if isinstance(host, bytes) else host
    targets = _table().get(f"{name}:{port}") if name else None
    if targets:
        target_host, _, target_port = random.choice(targets).rpartition(":")
        return _original(target_host, int(target_port), family, type, proto, flags)
    return _original(host, port, family, type, proto, flags)


class _MigrateTargets(importlib.abc.MetaPathFinder):
    """Redis's MIGRATE is issued by the operator but connected by redis-server itself, which
    resolves names in libc, past this table: translate the target address it is given."""

    MODULE = "relay.fleet.migration.shard_ops"

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            original = module.migrate_address

            def address(shard: str, url: str) -> Any:
                got = original(shard, url)
                targets = _table().get(f"{got.host}:{got.port}")
                if not targets:
                    return got
                host, _, port = random.choice(targets).rpartition(":")
                return dataclasses.replace(got, host=host, port=int(port))

            module.migrate_address = address

        loader.exec_module = exec_module
        return spec


def _without_uvloop() -> None:
    """uvloop resolves names inside libuv, past socket.getaddrinfo: under the runner, processes
    that would run on uvloop run on asyncio's own loop instead."""
    try:
        import uvloop
    except ImportError:
        return
    import asyncio

    def run(main: Any, *, debug: bool | None = None, **_: Any) -> Any:
        return asyncio.run(main, debug=debug)

    setattr(uvloop, "run", run)  # noqa: B010 - replacing the module's functions, typed differently
    setattr(uvloop, "new_event_loop", asyncio.new_event_loop)  # noqa: B010


if _FILE:
    socket.getaddrinfo = _getaddrinfo
    _without_uvloop()
    sys.meta_path.insert(0, _MigrateTargets())
