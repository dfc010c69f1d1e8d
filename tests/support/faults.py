"""Shared pieces of the fault suite (no tests here): relay processes on one Redis URL,
small HTTP probes, and a closing line each fault test prints for the suite's verdicts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.fleet_harness import RelayProc, spawn_relay, stop_relays, wait_ready
from tests.support.history import Verdict


def start_relay(workdir: Path, redis_url: str, env: dict[str, str] | None = None, port: int = 0) -> RelayProc:
    """`python -m relay --redis-url URL --auth none` as a subprocess, ready when returned."""
    relay = spawn_relay(["--redis-url", redis_url], workdir, env, port)
    try:
        wait_ready(relay)
    except BaseException:
        stop_relay(relay)
        raise
    return relay


def stop_relay(relay: RelayProc, sig: int = signal.SIGTERM) -> None:
    stop_relays([relay], sig)


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, Any], dict[str, str], float]:
    """(status, json body, headers, seconds taken); status 0 when no response came."""
    t0 = time.monotonic()
    try:
        async with http.request(method, url, data=body, headers=headers or None) as resp:
            doc = await resp.json(content_type=None) if resp.content_length != 0 else {}
            return resp.status, doc or {}, dict(resp.headers), time.monotonic() - t0
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return 0, {}, {}, time.monotonic() - t0


def report(name: str, verdict: Verdict | None = None, **numbers: object) -> str:
    """One line for the suite's closing note: the fault, the numbers, the verdict."""
    parts = [f"FAULTS {name}:"]
    parts += [f"{k}={v}" for k, v in numbers.items()]
    if verdict is not None:
        c = verdict.counts
        parts += [
            f"enqueue_attempts={c.get('enqueue_attempts', 0)}",
            f"acknowledged={c.get('messages_acknowledged', 0)}",
            f"delivered={c.get('messages_delivered', 0)}",
            f"violations={len(verdict.violations)}",
        ]
    line = " ".join(parts)
    print(line)
    out = os.environ.get("RELAY_FAULTS_REPORT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return line
