"""redis.conf text for a managed shard, and the password include file."""

from __future__ import annotations

from relayfleet_operator.builders.names import REDIS_PORT, REDIS_TLS_DIR

# How a managed shard's Redis lays out its streams (docs/memory.md). Nodes of up to 128 KiB:
# at Redis' default of 4 KiB every message of 4 KiB or more had a node of its own, which
# jemalloc rounds up to 5 KiB (1.27x its payload); 31 such messages share a 128 KiB node
# (1.05x). A new node still starts at most 4 KiB large, and smaller messages still share a node
# 100 at a time (stream-node-max-entries, left at its default). relayfleet_testing's LocalRedis
# starts with the same settings, so tests and benchmarks measure what the operator runs.
MEMORY_SETTINGS: tuple[tuple[str, str], ...] = (("stream-node-max-bytes", "131072"),)


def redis_conf(
    appendfsync: str = "everysec",
    maxmemory_bytes: int = 0,
    data_dir: str = "/data",
    auth_include: str | None = "/etc/redis-secret/auth.conf",
    tls: bool = False,
) -> str:
    """redis.conf for a managed shard: AOF on, never evict (a relay must refuse, not forget).
    With `tls`, TLS only on the usual port; MIGRATE to other TLS shards goes over TLS too."""
    if appendfsync not in ("everysec", "always"):
        raise ValueError(f"appendfsync must be everysec or always, not {appendfsync!r}")
    listen = [f"port {REDIS_PORT}"]
    if tls:
        listen = [
            "port 0",
            f"tls-port {REDIS_PORT}",
            f"tls-cert-file {REDIS_TLS_DIR}/tls.crt",
            f"tls-key-file {REDIS_TLS_DIR}/tls.key",
            f"tls-ca-cert-file {REDIS_TLS_DIR}/ca.crt",
            # the password stays the login; a client certificate is checked when one is sent
            "tls-auth-clients optional",
            "tls-replication yes",
            # Redis uses the cluster TLS setting for MIGRATE's own connection (slot migration)
            "tls-cluster yes",
        ]
    lines = [
        "# Written by relayfleet-operator; edits are reverted on the next reconcile.",
        "bind * -::*",
        *listen,
        f'dir "{data_dir}"',
        "appendonly yes",
        f"appendfsync {appendfsync}",
        'appenddirname "appendonlydir"',
        "aof-use-rdb-preamble yes",
        # AOF is the persistence; periodic RDB snapshots would only add fork pauses.
        'save ""',
        f"maxmemory {maxmemory_bytes}",
        "maxmemory-policy noeviction",
        *(f"{name} {value}" for name, value in MEMORY_SETTINGS),
        "tcp-keepalive 60",
        "timeout 0",
    ]
    if auth_include:
        lines.append(f"include {auth_include}")
    return "\n".join(lines) + "\n"


def redis_auth_conf(password: str) -> str:
    # quoted (redis.conf splits arguments on spaces): a supplied password may hold any character
    escaped = password.replace("\\", "\\\\").replace('"', '\\"')
    return f'requirepass "{escaped}"\n'
