"""One redis-server per pytest worker, handed to one test at a time and put back as a fresh
server would be (tests/conftest.py's `redis_server`).

Starting and stopping a server for each of the ~250 tests that ask for one cost more than the
tests themselves; a worker runs one test at a time, so between two tests the server is reset
instead: other clients closed, every key, script, function and statistic dropped. A test that
stopped, killed or reconfigured it (CONFIG SET, ACL, REPLICAOF) gets it replaced: the next test
starts a new server.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import redis
from relayfleet_testing.localredis import LocalRedis

DEBIAN_REDIS = "/usr/bin/redis-server"


def _state(client: redis.Redis) -> tuple[object, ...]:
    """What a test may change and a reset does not undo: settings, users, role."""
    role = client.info("replication")["role"]
    return (role, sorted(client.config_get("*").items()), sorted(client.acl_list()))


@dataclass
class SharedRedis:
    """The worker's server; `take()` before a test, `give_back()` after it."""

    server: LocalRedis | None = None
    url: str = ""
    pid: int = 0
    fresh_state: tuple[object, ...] = ()
    starts: int = 0
    reused: int = 0
    replaced: list[str] = field(default_factory=list)

    def take(self) -> LocalRedis:
        if self.server is None:
            binary = DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else ""
            self.server = LocalRedis(binary=binary).start()
            self.starts += 1
            self.url = self.server.url
            assert self.server.proc is not None
            self.pid = self.server.proc.pid
            with redis.Redis.from_url(self.url, socket_timeout=10) as client:
                self.fresh_state = _state(client)
        else:
            self.reused += 1
        return self.server

    def give_back(self, test: str) -> None:
        server = self.server
        if server is None:
            return
        reason = self._reset(server)
        if reason:
            self.replaced.append(f"{test}: {reason}")
            self.close()

    def _reset(self, server: LocalRedis) -> str:
        """Empty if the server is as a fresh one again, else why it must be replaced."""
        proc = server.proc
        if proc is None or proc.poll() is not None or server.url != self.url:
            return "stopped or moved"
        if proc.pid != self.pid:
            return "restarted"  # same port and data dir, but an AOF replay may have left settings
        try:
            with redis.Redis.from_url(self.url, socket_timeout=10) as client:
                client.execute_command("CLIENT", "UNPAUSE")
                for kind in ("normal", "pubsub"):
                    client.client_kill_filter(_type=kind, skipme=True)
                client.flushall()  # synchronous: the next test sees no key of this one
                client.script_flush()
                client.execute_command("FUNCTION", "FLUSH")
                client.config_resetstat()
                client.execute_command("SLOWLOG", "RESET")
                if _state(client) != self.fresh_state:
                    return "settings changed"
        except redis.RedisError as exc:
            return f"reset failed: {type(exc).__name__}"
        return ""

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            shutil.rmtree(self.server.dir, ignore_errors=True)
        self.server = None
