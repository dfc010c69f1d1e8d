"""TEST-ONLY (e2e pod runner): resolve Kubernetes Service names to the loopback ports of the
local processes that stand in for their pods.

The pod runner (e2e/podrunner.py) writes a JSON table {"host:port": ["127.0.0.1:P", ...]} to
the file named by RELAYFLEET_E2E_ADDRESSES and puts this directory first on PYTHONPATH of
every process it starts, so `relayfleet-a-redis.ns.svc:6379` reaches the redis-server
standing in for that StatefulSet's pod, the way cluster DNS plus kube-proxy would.
"""

from __future__ import annotations

import json
import os
import random
import socket
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

    uvloop.run = run  # type: ignore[assignment]
    uvloop.new_event_loop = asyncio.new_event_loop


if _FILE:
    socket.getaddrinfo = _getaddrinfo
    _without_uvloop()
