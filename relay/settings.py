"""Relay configuration: one dataclass, filled from flags with environment fallbacks."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from relay.storage.store import QueueLimits

T = TypeVar("T")


def _env(name: str, default: T, parse: Callable[[str], T], kind: str) -> T:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        raise SystemExit(f"relayfleet: {name} must be {kind}, got {raw!r}") from None


def env_secret(name: str) -> str | None:
    """A secret from NAME_FILE (a mounted Secret; wins) or NAME. The error names the variable
    and the path, never the content."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise SystemExit(f"relayfleet: {name}_FILE {path}: {reason}") from None
    value = os.environ.get(name)
    return (value.strip() or None) if value else None


def enqueue_tokens_from_env() -> tuple[str, ...]:
    """RELAY_ENQUEUE_TOKENS(_FILE): tokens separated by commas or newlines."""
    raw = env_secret("RELAY_ENQUEUE_TOKENS") or ""
    return tuple(t.strip() for t in raw.replace("\n", ",").split(",") if t.strip())


def env_float(name: str, default: float) -> float:
    return _env(name, default, float, "a number")


def env_int(name: str, default: int) -> int:
    return _env(name, default, int, "an integer")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None
    shard_map_file: str | None = None
    shard_map_configmap: str | None = None  # "namespace/name"
    auth: str = "ed25519"  # or "none" (local development only)
    enqueue_tokens: tuple[str, ...] = ()
    max_payload: int = 5_242_880
    limits: QueueLimits = field(default_factory=QueueLimits)
    max_limit: int = 1000
    default_limit: int = 100
    max_wait_s: float = 60.0
    max_waiters: int = 20_000
    request_deadline_s: float = 5.0  # internal retries (migrating slot, moved) stop here
    auth_skew_s: int = 300
    push_webhook: str | None = None
    shutdown_grace_s: float = 10.0
    live_queue_max: int = 256  # unacked frames in flight per WebSocket before we stop reading ahead
    # A live client whose socket accepts nothing for this long is dropped (its frames held in memory).
    live_send_timeout_s: float = field(
        default_factory=lambda: max(0.1, env_float("RELAY_LIVE_SEND_TIMEOUT_S", 30.0))
    )
    # A body must arrive within this long, or a slow sender (slowloris) holds a handler forever.
    body_timeout_s: float = field(default_factory=lambda: env_float("RELAY_BODY_TIMEOUT_S", 30.0))
    # Shard health (INFO) every this many seconds; slot statistics at most this often, after a scrape.
    shard_health_interval_s: float = field(
        default_factory=lambda: max(0.2, env_float("RELAYFLEET_SHARD_HEALTH_INTERVAL", 5.0))
    )
    shard_stats_interval_s: float = field(
        default_factory=lambda: max(0.2, env_float("RELAYFLEET_SHARD_STATS_INTERVAL", 30.0))
    )

    # Hostile clients (DESIGN §3 "Hostile traffic"): see docs/reliability.md.
    # Complete request headers within this long of connecting (or of a new request's first byte).
    header_timeout_s: float = field(default_factory=lambda: env_float("RELAY_HEADER_TIMEOUT_S", 10.0))
    # An idle keep-alive connection closes after this long.
    keepalive_timeout_s: float = field(default_factory=lambda: env_float("RELAY_KEEPALIVE_TIMEOUT_S", 75.0))
    # Open client connections at once; 0: the open-files limit minus a reserve of 128.
    max_connections: int = field(default_factory=lambda: env_int("RELAY_MAX_CONNECTIONS", 0))
    # Fan-out: recipients x payload bytes at most this, else 413 fanout_too_large.
    max_fanout_bytes: int = field(default_factory=lambda: env_int("RELAY_MAX_FANOUT_BYTES", 32 << 20))
    # Memory guard: refuse new work (503 overloaded) before RSS passes this many MiB;
    # 0: the cgroup's memory limit when there is one, else no guard.
    max_rss_mb: int = field(default_factory=lambda: env_int("RELAY_MAX_RSS_MB", 0))
    # The DIDComm mediator (relay/didcomm): off unless a seed file is given (a Secret mount; the
    # same seed on every relay of a fleet makes them one mediator). The public URL is what
    # agents reach the fleet at (invitation, DID document, mediate-grant endpoint).
    didcomm_seed_file: str | None = field(
        default_factory=lambda: os.environ.get("RELAY_DIDCOMM_SEED_FILE") or None
    )
    public_url: str | None = field(default_factory=lambda: os.environ.get("RELAY_PUBLIC_URL") or None)

    @property
    def fleet_name(self) -> str:
        return os.environ.get("RELAY_FLEET", "default")


def limits_from_env() -> QueueLimits:
    d = QueueLimits()
    return QueueLimits(
        rate_count=env_int("RELAY_RATE_LIMIT", d.rate_count),
        rate_window_ms=env_int("RELAY_RATE_WINDOW_MS", d.rate_window_ms),
        max_messages=env_int("RELAY_QUEUE_MAX_MESSAGES", d.max_messages),
        max_bytes=env_int("RELAY_QUEUE_MAX_BYTES", d.max_bytes),
        retention_ms=env_int("RELAY_RETENTION_SECONDS", d.retention_ms // 1000) * 1000,
        max_response_bytes=max(1, env_int("RELAY_MAX_RESPONSE_BYTES", d.max_response_bytes)),
        write_timeout_s=max(0.05, env_float("RELAY_REDIS_WRITE_TIMEOUT_S", d.write_timeout_s)),
        read_timeout_s=max(0.05, env_float("RELAY_REDIS_READ_TIMEOUT_S", d.read_timeout_s)),
    )
