"""The attacker suite's harness: a relay started as users start it, and raw-socket HTTP.

`relayfleet relay --redis-url ...` runs as a subprocess on a real /usr/bin/redis-server,
logging at DEBUG into a file the tests grep for planted secrets. Attacks speak HTTP
over raw sockets (aiohttp's client refuses to send most of them); `request` answers
what came back, or status 0 when the relay closed the connection without an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from relayfleet_testing.localredis import LocalRedis, free_port

from tests.support.procs import stop_process

DEBIAN_REDIS = "/usr/bin/redis-server"

# Planted by the attacks: none of these may appear in the relay's log, at any level.
SECRET_PAYLOAD = b"PLANTED-PAYLOAD-7f3a9c"
SECRET_INBOX_ID = "PLANTED-INBOX-ID-51d0e2"
SECRET_HEADER = "PLANTED-HEADER-VALUE-b8c4"
SECRET_KEY = "PLANTED-IDEMPOTENCY-KEY-93aa"
# a recipient key whose base64url text is recognisable in a log
SECRET_RECIPIENT = "UExBTlRFRC1SRUNJUElFTlQtS0VZLTAxMjM0NTY3ODk"  # "PLANTED-RECIPIENT-KEY-0123456789"
SECRETS: tuple[bytes, ...] = (
    SECRET_PAYLOAD,
    SECRET_INBOX_ID.encode(),
    SECRET_HEADER.encode(),
    SECRET_KEY.encode(),
    SECRET_RECIPIENT.encode(),
)


def relay_command() -> list[str]:
    """The `relayfleet` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("relayfleet")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "relay"]  # same entry point, when no script is installed


@dataclass
class Relay:
    """One `relayfleet relay` process and what the attacks need to know about it."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    redis: LocalRedis
    env: dict[str, str] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_bytes(self) -> bytes:
        return self.log_path.read_bytes()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS for the relay")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def assert_log_clean(self) -> None:
        """No planted secret in the relay's log, and the log was written at DEBUG."""
        text = self.log_bytes()
        leaked = [s.decode() for s in SECRETS if s in text]
        assert not leaked, f"planted secrets in the relay log: {leaked}"
        assert b"Traceback" not in text, "a traceback reached the relay log"
        assert b"unhandled exception in a request handler" not in text, "an attack got a 500"

    def stop(self) -> None:
        stop_process(self.proc, 15)


def start_redis() -> LocalRedis:
    return LocalRedis(binary=DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else "").start()


def start_relay(
    redis: LocalRedis,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    nofile: int | None = None,
    args: tuple[str, ...] = ("--auth", "none"),
) -> Relay:
    """`relayfleet relay --redis-url URL` as users start it, logging at DEBUG; ready when returned.

    `nofile` sets the process's open-files limit (soft and hard), as a container's would.
    """
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"relay-{port}.log"
    full_env = {**os.environ, **(env or {})}
    command = [*relay_command(), "relay", "--redis-url", redis.url, "--port", str(port)]
    command += ["--log-level", "DEBUG", *args]

    def limit_fds() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=limit_fds if nofile is not None else None,
        )
    relay = Relay(proc, port, log_path, redis, dict(env or {}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"relay exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        if _ready(port):
            return relay
        time.sleep(0.1)
    relay.stop()
    raise RuntimeError(f"relay on port {port} not ready in 30 s: {log_path.read_text()[-2000:]}")


def _ready(port: int) -> bool:
    """GET /readyz answered 200 (blocking: also called from async tests' fixtures)."""
    try:
        with socket.create_connection(("127.0.0.1", port), 1.0) as s:
            s.settimeout(2.0)
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


@dataclass
class Answer:
    status: int  # 0: the connection closed without a response
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


async def read_response(reader: asyncio.StreamReader) -> Answer:
    """One HTTP/1.1 response (Content-Length or close-delimited); status 0 on a bare close."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return Answer(0, {}, b"")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if status < 200 or status in (204, 304):
        body = b""  # no body (101: the connection now speaks WebSocket)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return Answer(status, headers, body)


async def request_answer(relay: Relay, data: bytes, timeout: float = 10.0) -> Answer:
    """Send raw bytes on a fresh connection; the first response (or status 0)."""
    reader, writer = await asyncio.open_connection(relay.host, relay.port)
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def request(relay: Relay, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    answer = await request_answer(relay, data, timeout)
    return answer.status, answer.headers, answer.body


def http(
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    version: str = "1.1",
    length: bool = True,
) -> bytes:
    """A request's bytes, written by hand (aiohttp's client would normalise it)."""
    lines = [f"{method} {path} HTTP/{version}", "Host: relay"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if (
        length
        and body
        and not any(k.lower() in ("content-length", "transfer-encoding") for k in headers or {})
    ):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def report(name: str, **numbers: object) -> None:
    """A figure of an attack, printed as `HOSTILE <attack>: k=v ...` (docs/reliability.md)."""
    print(f"HOSTILE {name}: " + " ".join(f"{k}={v}" for k, v in numbers.items()))


async def metric(relay: Relay, line_start: str) -> float:
    """The value of the first /metrics line starting with `line_start` (0 when none)."""
    answer = await request_answer(relay, http("GET", "/metrics"))
    assert answer.status == 200, answer
    for line in answer.body.decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def recipient(n: int) -> str:
    """A distinct valid recipient key (base64url of 32 bytes) per n."""
    from relay.protocol import b64encode

    return b64encode(n.to_bytes(4, "big") * 8)


# The suite relay's header timeout (tests/hostile/conftest.py): short, so slowloris tests finish quickly.
HEADER_TIMEOUT_S = 2.0

# For attacks on something else that store far more than one client's quota from 127.0.0.1 (big
# prefills, floods of pipelined enqueues): the per-client quota off, so the attack meets only
# the bound it is about (the quota's own attack: tests/hostile/test_client_quota_flood.py).
NO_CLIENT_QUOTA = {"RELAY_CLIENT_RATE_MESSAGES": "0", "RELAY_CLIENT_RATE_BYTES": "0"}

# The `relay_with(env, nofile)` fixture: a relay of its own with other settings.
RelayWith = Callable[..., Relay]
