"""redis.conf text for a managed shard, and the password include file."""

from __future__ import annotations

from relayfleet_operator.builders.names import REDIS_PORT, REDIS_TLS_DIR


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
