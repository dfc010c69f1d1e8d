"""Relay configuration: one dataclass, read once from flags and the environment.

`Settings.from_env()` is the only place the relay reads its environment (docs/api.md, "Command line"):
every variable is listed in RELAY_ENV (shown by `relayfleet relay --help`), a bad value is
a ConfigError naming the variable (the CLI exits 2 with one line), and the names replaced
by the prefix policy (docs/design-decisions.md) still work, with a warning in the log.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relay.storage.limits import QueueLimits

T = TypeVar("T")
log = logging.getLogger("relay.settings")


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the variable, never a secret."""


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str  # as shown in --help
    help: str


_LIMITS = QueueLimits()

# Every variable the relay process reads, for --help and docs (flags list their own).
RELAY_ENV: tuple[EnvVar, ...] = (
    EnvVar("RELAY_FLEET", "default", "fleet name (metrics, a single --redis-url map)"),
    EnvVar("RELAY_ENQUEUE_TOKENS", "none", "bearer tokens for enqueue (comma/newline separated)"),
    EnvVar("RELAY_ENQUEUE_TOKENS_FILE", "none", "file holding RELAY_ENQUEUE_TOKENS (a mounted Secret; wins)"),
    EnvVar("RELAY_PUSH_WEBHOOK", "none", "http(s) URL notified on enqueue to an offline recipient"),
    EnvVar("RELAY_PUSH_WEBHOOK_FILE", "none", "file holding RELAY_PUSH_WEBHOOK (a mounted Secret; wins)"),
    EnvVar("RELAY_REDIS_CREDENTIALS_DIR", "none", "one file per shard holding its full Redis URL"),
    EnvVar("RELAY_MAX_PAYLOAD", "5242880", "largest message payload, bytes"),
    EnvVar("RELAY_MAX_WAITERS", "20000", "concurrent long-polls before 503"),
    EnvVar("RELAY_RATE_LIMIT", "500", "enqueues per queue per window"),
    EnvVar("RELAY_RATE_WINDOW_MS", "5000", "rate-limit window, ms"),
    EnvVar("RELAY_QUEUE_MAX_MESSAGES", "10000", "messages per queue"),
    EnvVar("RELAY_QUEUE_MAX_BYTES", "268435456", "payload bytes per queue"),
    EnvVar(
        "RELAY_RECIPIENT_MAX_CHANNELS",
        str(_LIMITS.recipient_max_channels),
        "non-default channels one recipient may hold messages in (0: no cap)",
    ),
    EnvVar(
        "RELAY_RECIPIENT_MAX_MESSAGES",
        "2 x RELAY_QUEUE_MAX_MESSAGES",
        "messages held per recipient across its channels (0: no cap)",
    ),
    EnvVar(
        "RELAY_RECIPIENT_MAX_BYTES",
        "2 x RELAY_QUEUE_MAX_BYTES",
        "payload bytes held per recipient across its channels (0: no cap)",
    ),
    EnvVar(
        "RELAY_RECIPIENT_RATE_LIMIT",
        "2 x RELAY_RATE_LIMIT",
        "enqueues per recipient per RELAY_RATE_WINDOW_MS across its channels (0: no limit)",
    ),
    EnvVar(
        "RELAY_SHARD_RESERVE_FRACTION",
        str(_LIMITS.shard_reserve_fraction),
        "within this share of a shard's maxmemory only small queues store (0: no reserve)",
    ),
    EnvVar(
        "RELAY_SHARD_RESERVE_QUEUE_BYTES",
        str(_LIMITS.shard_reserve_queue_bytes),
        "in a shard's reserve, a message taking its queue past this is 507 storage_reserve",
    ),
    EnvVar("RELAY_RETENTION_SECONDS", "604800", "how long an unacknowledged message is kept"),
    EnvVar("RELAY_MAX_RESPONSE_BYTES", "8388608", "payload bytes per read/drain/live batch"),
    EnvVar("RELAY_REDIS_WRITE_TIMEOUT_S", str(_LIMITS.write_timeout_s), "enqueue/ack/status reply deadline"),
    EnvVar("RELAY_REDIS_READ_TIMEOUT_S", str(_LIMITS.read_timeout_s), "reply deadline of read/drain"),
    EnvVar(
        "RELAY_WAIT_TIMEOUT_MS",
        str(_LIMITS.wait_timeout_ms),
        "minReplicas shards: WAIT timeout before a write is 503 replication_timeout",
    ),
    EnvVar("RELAY_LIVE_SEND_TIMEOUT_S", "30", "drop a live client whose socket accepts nothing this long"),
    EnvVar("RELAY_BODY_TIMEOUT_S", "30", "a request body must arrive within this long"),
    EnvVar("RELAY_HEADER_TIMEOUT_S", "10", "request headers must arrive within this long"),
    EnvVar("RELAY_KEEPALIVE_TIMEOUT_S", "75", "idle keep-alive connections close after this long"),
    EnvVar("RELAY_HTTP_FASTPATH", "1", "serve clean enqueues without aiohttp's request machinery (0: off)"),
    EnvVar("RELAY_MAX_CONNECTIONS", "0", "open client connections (0: open-files limit - 128)"),
    EnvVar("RELAY_MAX_FANOUT_BYTES", "33554432", "fan-out recipients x payload bytes"),
    EnvVar("RELAY_MAX_RSS_MB", "0", "refuse new work above this RSS (0: the cgroup limit, if any)"),
    EnvVar("RELAY_SHARD_HEALTH_INTERVAL_S", "5", "shard INFO probe period, s"),
    EnvVar("RELAY_SHARD_STATS_INTERVAL_S", "30", "slot statistics period, s"),
    EnvVar(
        "RELAY_GC_YOUNG_THRESHOLD",
        "10000",
        "net allocations between young garbage-collector passes (CPython's default: 700)",
    ),
    EnvVar("RELAY_SHUTDOWN_DELAY_SECONDS", "0", "keep serving this long after SIGTERM before draining"),
    EnvVar("RELAY_DIDCOMM_REDELIVER_S", "10", "a Pickup delivery not acknowledged goes out again after"),
    EnvVar(
        "RELAY_DIDCOMM_MAX_KEYS_PER_CONNECTION", "100", "keys one DIDComm connection may register (0: no cap)"
    ),
    EnvVar(
        "RELAY_DIDCOMM_IDLE_EXPIRY_S",
        "2592000",
        "a DIDComm connection and its key registrations expire after this long without its activity",
    ),
    EnvVar(
        "RELAY_DIDCOMM_SWEEP_INTERVAL_S",
        "600",
        "expired DIDComm records are removed from Redis at most this long after expiry (0: only on writes)",
    ),
    EnvVar(
        "RELAY_DIDCOMM_MAX_CONNECTIONS_PER_CLIENT",
        "100",
        "new DIDComm connections one client (source address) may open per hour, per relay (0: off)",
    ),
    EnvVar(
        "RELAY_CLIENT_RATE_MESSAGES",
        "10000",
        "messages one client may store per RELAY_CLIENT_RATE_WINDOW_MS, all recipients together (0: off)",
    ),
    EnvVar(
        "RELAY_CLIENT_RATE_BYTES",
        str(32 << 20),
        "payload bytes one client may store per RELAY_CLIENT_RATE_WINDOW_MS (0: off)",
    ),
    EnvVar("RELAY_CLIENT_RATE_WINDOW_MS", "5000", "per-client quota window (token bucket refill), ms"),
    EnvVar(
        "RELAY_TRUSTED_PROXIES",
        "none",
        "CIDRs of proxies whose X-Forwarded-For names the client (comma separated; behind an ingress)",
    ),
)

# Old name -> new name (prefix policy, docs/design-decisions.md): read with a warning.
DEPRECATED_ENV: dict[str, str] = {
    "RELAYFLEET_SHARD_HEALTH_INTERVAL": "RELAY_SHARD_HEALTH_INTERVAL_S",
    "RELAYFLEET_SHARD_STATS_INTERVAL": "RELAY_SHARD_STATS_INTERVAL_S",
    "RELAY_OPERATOR_NAMESPACE": "RELAYFLEET_OPERATOR_NAMESPACE",
}
_OLD_NAMES: dict[str, tuple[str, ...]] = {}
for _old, _new in DEPRECATED_ENV.items():
    _OLD_NAMES[_new] = (*_OLD_NAMES.get(_new, ()), _old)
_warned: set[str] = set()

# Variables of removed features -> what replaced them (docs/upgrade.md): ignored, with a warning
# in the log. Refusing them would crash-loop a rolling upgrade over a tuning knob that changes
# no guarantee; ignoring them silently would hide that the pod spec asks for something gone.
REMOVED_ENV: dict[str, str] = {
    "RELAY_BUSY_POLL_US": "busy-polling was removed; the loop sleeps between events",
    "RELAY_BUSY_POLL_SHARE": "busy-polling was removed; the loop sleeps between events",
}


def warn_removed_env() -> None:
    """One log line per removed variable still set (its name only, never its value)."""
    for name, why in REMOVED_ENV.items():
        if name in os.environ and name not in _warned:
            _warned.add(name)
            log.warning("%s is ignored: %s (docs/upgrade.md)", name, why)


def env_value(name: str) -> str | None:
    """The variable's value (empty counts as unset), or a deprecated name's, with a log line."""
    raw = os.environ.get(name)
    if raw:
        return raw
    for old in _OLD_NAMES.get(name, ()):
        raw = os.environ.get(old)
        if raw:
            if old not in _warned:
                _warned.add(old)
                # a log line, not a Python warning: deprecation must never fail a start-up
                log.warning("%s is deprecated: set %s instead (the old name still works)", old, name)
            return raw
    return None


def parse_env(name: str, default: T, parse: Callable[[str], T], kind: str) -> T:
    raw = env_value(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise ConfigError(f"{name} must be {kind}, got {shown!r}") from None


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
            raise ConfigError(f"{name}_FILE {path}: {reason}") from None
    value = os.environ.get(name)
    return (value.strip() or None) if value else None


def enqueue_tokens_from_env() -> tuple[str, ...]:
    """RELAY_ENQUEUE_TOKENS(_FILE): tokens separated by commas or newlines."""
    raw = env_secret("RELAY_ENQUEUE_TOKENS") or ""
    return tuple(t.strip() for t in raw.replace("\n", ",").split(",") if t.strip())


def _float(raw: str) -> float:
    value = float(raw)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(raw)
    return value


def env_float(name: str, default: float) -> float:
    return parse_env(name, default, _float, "a number")


def env_int(name: str, default: int) -> int:
    return parse_env(name, default, int, "an integer")


_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def _bool(raw: str) -> bool:
    value = _BOOLS.get(raw.strip().lower())
    if value is None:
        raise ValueError(raw)
    return value


def env_bool(name: str, default: bool) -> bool:
    return parse_env(name, default, _bool, "one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None
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
    live_send_timeout_s: float = 30.0
    # A body must arrive within this long, or a slow sender (slowloris) holds a handler forever.
    body_timeout_s: float = 30.0
    # Shard health (INFO) every this many seconds; slot statistics at most this often, after a scrape.
    shard_health_interval_s: float = 5.0
    shard_stats_interval_s: float = 30.0

    # Hostile clients (docs/api.md, "Hostile traffic"): see docs/reliability.md.
    # Complete request headers within this long of connecting (or of a new request's first byte).
    header_timeout_s: float = 10.0
    # An idle keep-alive connection closes after this long.
    keepalive_timeout_s: float = 75.0
    # Clean enqueues served by relay/http/fastpath.py, everything else by aiohttp (off: all by aiohttp).
    http_fastpath: bool = True
    # Open client connections at once; 0: the open-files limit minus a reserve of 128.
    max_connections: int = 0
    # Fan-out: recipients x payload bytes at most this, else 413 fanout_too_large.
    max_fanout_bytes: int = 32 << 20
    # Memory guard: refuse new work (503 overloaded) before RSS passes this many MiB;
    # 0: the cgroup's memory limit when there is one, else no guard.
    max_rss_mb: int = 0
    # Young garbage-collector passes every this many net allocations (relay/gc_tuning.py).
    gc_young_threshold: int = 10_000
    fleet: str = "default"
    shutdown_delay_s: float = 0.0  # keep serving after SIGTERM (endpoints catch up), then drain
    credentials_dir: str | None = None  # RELAY_REDIS_CREDENTIALS_DIR: full shard URLs, one file each
    # The DIDComm mediator (relay/didcomm): off unless a seed file is given (a Secret mount; the
    # same seed on every relay of a fleet makes them one mediator). The public URL is what
    # agents reach the fleet at (invitation, DID document, mediate-grant endpoint).
    didcomm_seed_file: str | None = None
    public_url: str | None = None
    # A message a Pickup delivery handed out is offered again only after this long without
    # its messages-received (an agent that died before acking gets it back then).
    didcomm_redeliver_s: float = 10.0
    # The mediator's record limits (relay/didcomm/records.py, docs/protocols.md "Limits").
    didcomm_max_keys_per_connection: int = 100
    didcomm_idle_expiry_s: float = 30 * 86400.0
    didcomm_max_connections_per_client: int = 100
    # How often the fleet sweeps each shard's expired DIDComm records (relay/didcomm/sweep.py;
    # 0: only the mediator's writes to a slot sweep it).
    didcomm_sweep_interval_s: float = 600.0
    # Per-client quota across recipients (relay/api/quota.py, docs/api.md "Client quota"): a
    # token bucket per client of this many messages and payload bytes, refilled over the window.
    client_rate_messages: int = 10_000
    client_rate_bytes: int = 32 << 20
    client_rate_window_ms: int = 5000
    # X-Forwarded-For is believed only from a TCP peer in one of these networks (CIDR text).
    trusted_proxies: tuple[str, ...] = ()

    @property
    def fleet_name(self) -> str:
        return self.fleet

    @classmethod
    def from_env(cls, **flags: Any) -> Settings:
        """Settings from the environment (read here, once), `flags` (the CLI's) taking precedence."""
        d = cls()
        warn_removed_env()
        values: dict[str, Any] = {
            "fleet": env_value("RELAY_FLEET") or d.fleet,
            "didcomm_seed_file": env_value("RELAY_DIDCOMM_SEED_FILE"),  # also flags of `relay`
            "public_url": env_value("RELAY_PUBLIC_URL"),
            "credentials_dir": env_value("RELAY_REDIS_CREDENTIALS_DIR"),
            "didcomm_redeliver_s": max(0.0, env_float("RELAY_DIDCOMM_REDELIVER_S", d.didcomm_redeliver_s)),
            "didcomm_max_keys_per_connection": max(
                0, env_int("RELAY_DIDCOMM_MAX_KEYS_PER_CONNECTION", d.didcomm_max_keys_per_connection)
            ),
            "didcomm_idle_expiry_s": max(
                0.001, env_float("RELAY_DIDCOMM_IDLE_EXPIRY_S", d.didcomm_idle_expiry_s)
            ),
            "didcomm_max_connections_per_client": max(
                0, env_int("RELAY_DIDCOMM_MAX_CONNECTIONS_PER_CLIENT", d.didcomm_max_connections_per_client)
            ),
            "didcomm_sweep_interval_s": max(
                0.0, env_float("RELAY_DIDCOMM_SWEEP_INTERVAL_S", d.didcomm_sweep_interval_s)
            ),
            "enqueue_tokens": enqueue_tokens_from_env(),
            "push_webhook": env_secret("RELAY_PUSH_WEBHOOK"),
            "max_payload": env_int("RELAY_MAX_PAYLOAD", d.max_payload),
            "max_waiters": env_int("RELAY_MAX_WAITERS", d.max_waiters),
            "limits": limits_from_env(),
            "live_send_timeout_s": max(0.1, env_float("RELAY_LIVE_SEND_TIMEOUT_S", d.live_send_timeout_s)),
            "body_timeout_s": env_float("RELAY_BODY_TIMEOUT_S", d.body_timeout_s),
            "shard_health_interval_s": max(
                0.2, env_float("RELAY_SHARD_HEALTH_INTERVAL_S", d.shard_health_interval_s)
            ),
            "shard_stats_interval_s": max(
                0.2, env_float("RELAY_SHARD_STATS_INTERVAL_S", d.shard_stats_interval_s)
            ),
            "header_timeout_s": env_float("RELAY_HEADER_TIMEOUT_S", d.header_timeout_s),
            "keepalive_timeout_s": env_float("RELAY_KEEPALIVE_TIMEOUT_S", d.keepalive_timeout_s),
            "http_fastpath": env_bool("RELAY_HTTP_FASTPATH", d.http_fastpath),
            "max_connections": env_int("RELAY_MAX_CONNECTIONS", d.max_connections),
            "max_fanout_bytes": env_int("RELAY_MAX_FANOUT_BYTES", d.max_fanout_bytes),
            "max_rss_mb": env_int("RELAY_MAX_RSS_MB", d.max_rss_mb),
            "shutdown_delay_s": max(0.0, env_float("RELAY_SHUTDOWN_DELAY_SECONDS", d.shutdown_delay_s)),
            "gc_young_threshold": max(1, env_int("RELAY_GC_YOUNG_THRESHOLD", d.gc_young_threshold)),
            "client_rate_messages": max(0, env_int("RELAY_CLIENT_RATE_MESSAGES", d.client_rate_messages)),
            "client_rate_bytes": max(0, env_int("RELAY_CLIENT_RATE_BYTES", d.client_rate_bytes)),
            "client_rate_window_ms": max(1, env_int("RELAY_CLIENT_RATE_WINDOW_MS", d.client_rate_window_ms)),
            "trusted_proxies": trusted_proxies_from_env(),
        }
        values.update(flags)
        return cls(**values)


def trusted_proxies_from_env() -> tuple[str, ...]:
    """RELAY_TRUSTED_PROXIES: CIDRs (or single addresses), comma or space separated; each checked."""
    raw = env_value("RELAY_TRUSTED_PROXIES") or ""
    out: list[str] = []
    for item in raw.replace(",", " ").split():
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            shown = item if len(item) <= 40 else item[:40] + "..."
            raise ConfigError(f"RELAY_TRUSTED_PROXIES must be a list of CIDRs, got {shown!r}") from None
    return tuple(out)


def limits_from_env() -> QueueLimits:
    d = QueueLimits()
    rate_count = env_int("RELAY_RATE_LIMIT", d.rate_count)
    max_messages = env_int("RELAY_QUEUE_MAX_MESSAGES", d.max_messages)
    max_bytes = env_int("RELAY_QUEUE_MAX_BYTES", d.max_bytes)
    return QueueLimits(
        rate_count=rate_count,
        rate_window_ms=env_int("RELAY_RATE_WINDOW_MS", d.rate_window_ms),
        max_messages=max_messages,
        max_bytes=max_bytes,
        # recipient-wide: twice the per-queue values unless set, so raising a queue's limit
        # (a benchmark, one busy queue) raises its recipient's with it
        recipient_max_channels=max(0, env_int("RELAY_RECIPIENT_MAX_CHANNELS", d.recipient_max_channels)),
        recipient_max_messages=max(0, env_int("RELAY_RECIPIENT_MAX_MESSAGES", 2 * max_messages)),
        recipient_max_bytes=max(0, env_int("RELAY_RECIPIENT_MAX_BYTES", 2 * max_bytes)),
        recipient_rate_count=max(0, env_int("RELAY_RECIPIENT_RATE_LIMIT", 2 * rate_count)),
        shard_reserve_fraction=min(
            0.9, max(0.0, env_float("RELAY_SHARD_RESERVE_FRACTION", d.shard_reserve_fraction))
        ),
        shard_reserve_queue_bytes=max(
            0, env_int("RELAY_SHARD_RESERVE_QUEUE_BYTES", d.shard_reserve_queue_bytes)
        ),
        retention_ms=env_int("RELAY_RETENTION_SECONDS", d.retention_ms // 1000) * 1000,
        max_response_bytes=max(1, env_int("RELAY_MAX_RESPONSE_BYTES", d.max_response_bytes)),
        write_timeout_s=max(0.05, env_float("RELAY_REDIS_WRITE_TIMEOUT_S", d.write_timeout_s)),
        read_timeout_s=max(0.05, env_float("RELAY_REDIS_READ_TIMEOUT_S", d.read_timeout_s)),
        # minReplicas shards only: WAIT's timeout (ms) before a write is answered 503
        # replication_timeout; at least 1 (WAIT 0 would mean "wait forever")
        wait_timeout_ms=max(1, env_int("RELAY_WAIT_TIMEOUT_MS", d.wait_timeout_ms)),
    )
