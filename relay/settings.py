"""Relay configuration: every setting declared once (relay.envconfig.Setting), read once.

`Settings.from_env()` is the only place the relay reads its environment (docs/api.md, "Command
line"): it reads every setting of RELAY_SETTINGS that fills a field. The same declarations give the
flags (relay/cli.py), `relayfleet relay --help` and docs/configuration.md (`make docs`); a bad
value is a ConfigError naming the variable (the CLI exits 2 with one line), and the names replaced
by the prefix policy (docs/design-decisions.md) still work, with a warning in the log.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from relay.envconfig import (
    BOOL,
    DEPRECATED_ENV,
    FLOAT,
    INT,
    PORT_NUMBER,
    REMOVED_ENV,
    TEXT,
    BadItem,
    ConfigError,
    Kind,
    Setting,
    choice,
    env_secret,
    env_value,
    warn_removed_env,
)
from relay.storage.limits import FOLLOW_QUEUE, QueueLimits

__all__ = [
    "BY_ENV",
    "DEPRECATED_ENV",
    "RELAY_SETTINGS",
    "REMOVED_ENV",
    "ConfigError",
    "Settings",
    "env_secret",
    "env_value",
]

_LIMITS = QueueLimits()
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _tokens(raw: str) -> tuple[str, ...]:
    """Tokens separated by commas or newlines."""
    return tuple(t.strip() for t in raw.replace("\n", ",").split(",") if t.strip())


def _cidrs(raw: str) -> tuple[str, ...]:
    """CIDRs (or single addresses), comma or space separated; each checked."""
    out: list[str] = []
    for item in raw.replace(",", " ").split():
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise BadItem(item) from None
    return tuple(out)


TOKENS: Kind[tuple[str, ...]] = Kind(_tokens, "a list of tokens", show=lambda v: ",".join(v) or "none")
CIDRS: Kind[tuple[str, ...]] = Kind(_cidrs, "a list of CIDRs", show=lambda v: ",".join(v) or "none")
OPTIONAL: Kind[str | None] = Kind(str, "a string")

# fmt: off
# -- shared by every relayfleet command that takes them (relay, migrate, top, operator, tools) --
LOG_LEVEL = Setting(
    "RELAY_LOG_LEVEL", choice(*LOG_LEVELS, upper=True), "INFO", "log level", flag="--log-level",
    metavar="LEVEL",
)
URL = Setting("RELAY_URL", TEXT, "http://127.0.0.1:8080", "the relay's base URL", flag="--url")
KUBECONFIG = Setting(
    "KUBECONFIG", OPTIONAL, None,
    "kubeconfig file (the operator: a list's first file; else in-cluster, else ~/.kube/config)",
    flag="--kubeconfig",
)
SHARD_MAP = Setting(
    "RELAY_SHARD_MAP", OPTIONAL, None, "shard map JSON file (a relay reloads it when it changes)",
    flag="--shard-map", metavar="FILE",
)
SHARD_MAP_CONFIGMAP = Setting(
    "RELAY_SHARD_MAP_CONFIGMAP", OPTIONAL, None,
    "shard map ConfigMap, watched (Kubernetes: KUBECONFIG or in-cluster)",
    flag="--shard-map-configmap", metavar="NS/NAME",
)

# full shard URLs kept out of the map (relay/fleet/credentials.py): the relay reads the variable
# only; the Spark jobs and `relayfleet plan` take it as --credentials-dir too (spark_jobs/settings.py)
CREDENTIALS_DIR = Setting(
    "RELAY_REDIS_CREDENTIALS_DIR", OPTIONAL, None, "one file per shard holding its full Redis URL",
    metavar="DIR", field="credentials_dir",
)
# The device push providers' credentials: the operator mounts spec.relay.pushCredentialsSecretRef here.
PUSH_CREDENTIALS_DIR = Setting(
    "RELAY_PUSH_CREDENTIALS_DIR", OPTIONAL, None,
    "the push providers' credentials (a mounted Secret): fcm-service-account.json; "
    "apns-auth-key.p8, apns-key-id, apns-team-id, apns-topic",
    metavar="DIR", field="push_credentials_dir",
)
# Its files (relay/devicepush/credentials.py reads them; the operator hashes them to roll the relays)
PUSH_FCM_FILE = "fcm-service-account.json"
PUSH_APNS_FILES = ("apns-auth-key.p8", "apns-key-id", "apns-team-id", "apns-topic")

# -- the relay process: flags (and their variables) -------------------------------------------
HOST = Setting("RELAY_HOST", TEXT, "127.0.0.1", "address to listen on", flag="--host")
PORT = Setting(
    "RELAY_PORT", PORT_NUMBER, 8080, "HTTP port", flag="--port",
    lo=1, hi=65535, refuse="must be a port number, got '{value}'",
)
REDIS_URL = Setting(
    "RELAY_REDIS_URL", OPTIONAL, None,
    "one shard's Redis: redis://, rediss://?ssl_ca_certs=...&ssl_certfile=..., unix:// or redis+sentinel://",
    flag="--redis-url", metavar="URL",
)
AUTH = Setting(
    "RELAY_AUTH", choice("ed25519", "none"), "ed25519",
    "request authentication (none: local development only)",
    flag="--auth",
)
DIDCOMM_SEED_FILE = Setting(
    "RELAY_DIDCOMM_SEED_FILE", OPTIONAL, None,
    "turn the DIDComm mediator on: its 32-byte seed (raw, hex or base64; a Secret mount, the same "
    "for the whole fleet)",
    flag="--didcomm-seed-file", metavar="FILE", field="didcomm_seed_file",
)
PUBLIC_URL = Setting(
    "RELAY_PUBLIC_URL", OPTIONAL, None,
    "the URL agents reach the fleet at, for the mediator's invitation and DID (none: http://HOST:PORT)",
    flag="--public-url", metavar="URL", field="public_url",
)

# -- the relay process: environment only ------------------------------------------------------
_F, _C = "limits.", "2 x "
# named: the operator sets these two on every relay it runs (builders/deployments.py)
FLEET = Setting(
    "RELAY_FLEET", TEXT, "default", "fleet name (metrics, a single --redis-url map)", field="fleet",
)
RETENTION_SECONDS = Setting(
    "RELAY_RETENTION_SECONDS", INT, _LIMITS.retention_ms // 1000,
    "how long an unacknowledged message is kept", field=_F + "retention_s",
)
RELAY_ENV_ONLY: tuple[Setting[Any], ...] = (
    FLEET,
    Setting(
        "RELAY_ENQUEUE_TOKENS", TOKENS, (), "bearer tokens for enqueue (comma/newline separated)",
        secret=True, field="enqueue_tokens",
    ),
    Setting(
        "RELAY_PUSH_WEBHOOK", OPTIONAL, None, "http(s) URL notified on enqueue to an offline recipient",
        secret=True, field="push_webhook",
    ),
    # Push to the mediator's devices (RFC 0734/0699; relay/devicepush): docs/protocols.md
    PUSH_CREDENTIALS_DIR,
    Setting("RELAY_PUSH_FCM_URL", TEXT, "https://fcm.googleapis.com", "FCM HTTP v1 base URL",
            metavar="URL", field="push_fcm_url"),
    Setting("RELAY_PUSH_APNS_URL", TEXT, "https://api.push.apple.com", "APNs base URL (HTTP/2)",
            metavar="URL", field="push_apns_url"),
    Setting(
        "RELAY_PUSH_CA_FILE", OPTIONAL, None,
        "CA bundle (PEM) the push providers' TLS certificates are checked against (default: the system's)",
        metavar="FILE", field="push_ca_file",
    ),
    Setting(
        "RELAY_PUSH_COALESCE_S", FLOAT, 1.0,
        "a mediated recipient's stored messages within this long of the first make one notification",
        lo=0.0, hi=60.0, field="push_coalesce_s",
    ),
    Setting(
        "RELAY_PUSH_MIN_INTERVAL_S", FLOAT, 60.0,
        "a DIDComm connection's devices get at most one notification this often, fleet-wide",
        lo=0.0, hi=86400.0, field="push_min_interval_s",
    ),
    CREDENTIALS_DIR,
    Setting("RELAY_MAX_PAYLOAD", INT, 5_242_880, "largest message payload, bytes",
            lo=1, hi=536_870_912, field="max_payload", limit_key="maxPayloadBytes"),
    Setting("RELAY_MAX_WAITERS", INT, 20_000, "concurrent long-polls before 503", lo=0,
            field="max_waiters"),
    Setting("RELAY_RATE_LIMIT", INT, _LIMITS.rate_count, "enqueues per queue per window",
            lo=1, hi=1_000_000, field=_F + "rate_count", limit_key="rateLimitMessages"),
    Setting("RELAY_RATE_WINDOW_MS", INT, _LIMITS.rate_window_ms, "rate-limit window, ms",
            lo=1, field=_F + "rate_window_ms", limit_key="rateLimitWindowSeconds", limit_scale=1000),
    Setting("RELAY_QUEUE_MAX_MESSAGES", INT, _LIMITS.max_messages, "messages per queue",
            lo=1, field=_F + "max_messages", limit_key="maxQueueMessages"),
    Setting("RELAY_QUEUE_MAX_BYTES", INT, _LIMITS.max_bytes, "payload bytes per queue",
            lo=1, field=_F + "max_bytes", limit_key="maxQueueBytes"),
    # the per-client quota (relay/api/quota.py)
    Setting(
        "RELAY_CLIENT_RATE_MESSAGES", INT, 10_000,
        "messages one client may store per RELAY_CLIENT_RATE_WINDOW_MS, all recipients together (0: off)",
        lo=0, field="client_rate_messages", limit_key="clientRateMessages",
    ),
    Setting(
        "RELAY_CLIENT_RATE_BYTES", INT, 32 << 20,
        "payload bytes one client may store per RELAY_CLIENT_RATE_WINDOW_MS (0: off)", lo=0,
        field="client_rate_bytes", limit_key="clientRateBytes",
    ),
    Setting(
        "RELAY_CLIENT_RATE_WINDOW_MS", INT, 5000, "per-client quota window (token bucket refill), ms", lo=1,
        field="client_rate_window_ms", limit_key="clientRateWindowMs",
    ),
    Setting(
        "RELAY_RECIPIENT_MAX_CHANNELS", INT, _LIMITS.recipient_max_channels,
        "non-default channels one recipient may hold messages in (0: no cap)", lo=0,
        field=_F + "recipient_max_channels", limit_key="recipientMaxChannels",
    ),
    # the recipient-wide three follow their per-queue limit (twice it) unless set, so raising a
    # queue's limit (a benchmark, one busy queue) raises its recipient's with it
    Setting(
        "RELAY_RECIPIENT_MAX_MESSAGES", INT, FOLLOW_QUEUE,
        "messages held per recipient across its channels (0: no cap)", lo=0,
        shown=_C + "RELAY_QUEUE_MAX_MESSAGES", field=_F + "recipient_max_messages",
        limit_key="recipientMaxMessages",
    ),
    Setting(
        "RELAY_RECIPIENT_MAX_BYTES", INT, FOLLOW_QUEUE,
        "payload bytes held per recipient across its channels (0: no cap)", lo=0,
        shown=_C + "RELAY_QUEUE_MAX_BYTES", field=_F + "recipient_max_bytes", limit_key="recipientMaxBytes",
    ),
    Setting(
        "RELAY_RECIPIENT_RATE_LIMIT", INT, FOLLOW_QUEUE,
        "enqueues per recipient per RELAY_RATE_WINDOW_MS across its channels (0: no limit)", lo=0,
        shown=_C + "RELAY_RATE_LIMIT", field=_F + "recipient_rate_count", limit_key="recipientRateLimit",
    ),
    Setting(
        "RELAY_SHARD_RESERVE_FRACTION", FLOAT, _LIMITS.shard_reserve_fraction,
        "within this share of a shard's maxmemory only small queues store (0: no reserve)", lo=0.0, hi=0.9,
        field=_F + "shard_reserve_fraction", limit_key="shardReserveFraction",
    ),
    Setting(
        "RELAY_SHARD_RESERVE_QUEUE_BYTES", INT, _LIMITS.shard_reserve_queue_bytes,
        "in a shard's reserve, a message taking its queue past this is 507 storage_reserve", lo=0,
        field=_F + "shard_reserve_queue_bytes", limit_key="shardReserveQueueBytes",
    ),
    RETENTION_SECONDS,
    Setting("RELAY_MAX_RESPONSE_BYTES", INT, _LIMITS.max_response_bytes,
            "payload bytes per read/drain/live batch", lo=1, field=_F + "max_response_bytes"),
    Setting("RELAY_REDIS_WRITE_TIMEOUT_S", FLOAT, _LIMITS.write_timeout_s,
            "enqueue/ack/status reply deadline", lo=0.05, field=_F + "write_timeout_s"),
    Setting("RELAY_REDIS_READ_TIMEOUT_S", FLOAT, _LIMITS.read_timeout_s, "reply deadline of read/drain",
            lo=0.05, field=_F + "read_timeout_s"),
    # at least 1: WAIT 0 would mean "wait forever"
    Setting(
        "RELAY_WAIT_TIMEOUT_MS", INT, _LIMITS.wait_timeout_ms,
        "minReplicas shards: WAIT timeout before a write is 503 replication_timeout", lo=1,
        field=_F + "wait_timeout_ms",
    ),
    Setting("RELAY_LIVE_SEND_TIMEOUT_S", FLOAT, 30.0,
            "drop a live client whose socket accepts nothing this long", lo=0.1, field="live_send_timeout_s"),
    Setting("RELAY_PRESENCE_TTL_S", FLOAT, 8.0,
            "fleet-wide presence lease of a live socket or waiting poll (renewed every third of it)",
            lo=0.5, hi=300.0, field="presence_ttl_s"),
    Setting("RELAY_BODY_TIMEOUT_S", FLOAT, 30.0, "a request body must arrive within this long",
            field="body_timeout_s"),
    Setting("RELAY_HEADER_TIMEOUT_S", FLOAT, 10.0, "request headers must arrive within this long",
            field="header_timeout_s"),
    Setting("RELAY_KEEPALIVE_TIMEOUT_S", FLOAT, 75.0, "idle keep-alive connections close after this long",
            field="keepalive_timeout_s"),
    Setting("RELAY_HTTP_FASTPATH", BOOL, True,
            "serve clean enqueues without aiohttp's request machinery (0: off)", field="http_fastpath"),
    Setting("RELAY_MAX_CONNECTIONS", INT, 0, "open client connections (0: open-files limit - 128)",
            field="max_connections"),
    Setting("RELAY_MAX_FANOUT_BYTES", INT, 32 << 20, "fan-out recipients x payload bytes",
            field="max_fanout_bytes"),
    Setting("RELAY_MAX_RSS_MB", INT, 0, "refuse new work above this RSS (0: the cgroup limit, if any)",
            field="max_rss_mb"),
    Setting("RELAY_SHARD_HEALTH_INTERVAL_S", FLOAT, 5.0, "shard INFO probe period, s", lo=0.2,
            field="shard_health_interval_s"),
    Setting("RELAY_SHARD_STATS_INTERVAL_S", FLOAT, 30.0, "slot statistics period, s", lo=0.2,
            field="shard_stats_interval_s"),
    Setting(
        "RELAY_GC_YOUNG_THRESHOLD", INT, 10_000,
        "net allocations between young garbage-collector passes (CPython's default: 700)", lo=1,
        field="gc_young_threshold",
    ),
    Setting("RELAY_SHUTDOWN_DELAY_SECONDS", FLOAT, 0.0,
            "keep serving this long after SIGTERM before draining", lo=0.0, field="shutdown_delay_s"),
    Setting("RELAY_DIDCOMM_REDELIVER_S", FLOAT, 10.0,
            "a Pickup delivery not acknowledged goes out again after", lo=0.0, field="didcomm_redeliver_s"),
    Setting(
        "RELAY_DIDCOMM_MAX_KEYS_PER_CONNECTION", INT, 100,
        "keys one DIDComm connection may register (0: no cap)", lo=0,
        field="didcomm_max_keys_per_connection", limit_key="didcommMaxKeysPerConnection",
    ),
    Setting(
        "RELAY_DIDCOMM_IDLE_EXPIRY_S", FLOAT, 30 * 86400.0,
        "a DIDComm connection and its key registrations expire after this long without its activity",
        lo=0.001, field="didcomm_idle_expiry_s", limit_key="didcommIdleExpirySeconds",
    ),
    Setting(
        "RELAY_DIDCOMM_SWEEP_INTERVAL_S", FLOAT, 600.0,
        "expired DIDComm records are removed from Redis at most this long after expiry (0: only on writes)",
        lo=0.0, field="didcomm_sweep_interval_s",
    ),
    Setting(
        "RELAY_DIDCOMM_MAX_CONNECTIONS_PER_CLIENT", INT, 100,
        "new DIDComm connections one client (source address) may open per hour, per relay (0: off)", lo=0,
        field="didcomm_max_connections_per_client", limit_key="didcommMaxConnectionsPerClient",
    ),
    Setting(
        "RELAY_TRUSTED_PROXIES", CIDRS, (),
        "CIDRs of proxies whose X-Forwarded-For names the client (comma separated; behind an ingress)",
        field="trusted_proxies", limit_key="trustedProxies",
    ),
)
RELAY_FLAGS: tuple[Setting[Any], ...] = (
    HOST, PORT, REDIS_URL, SHARD_MAP, SHARD_MAP_CONFIGMAP, AUTH, LOG_LEVEL, DIDCOMM_SEED_FILE, PUBLIC_URL,
)
# fmt: on
# Everything `relayfleet relay` reads: its flags' variables and the environment-only ones.
RELAY_SETTINGS: tuple[Setting[Any], ...] = (*RELAY_FLAGS, *RELAY_ENV_ONLY)
# The other commands' own (`top`, `demo`): the relay process does not read them.
COMMAND_SETTINGS: tuple[Setting[Any], ...] = (URL, KUBECONFIG)
BY_ENV: dict[str, Setting[Any]] = {s.env: s for s in RELAY_SETTINGS}
_BY_FIELD: dict[str, Setting[Any]] = {s.field: s for s in RELAY_SETTINGS if s.field}


def _d(name: str) -> Any:
    """The declared default of the Settings field `name` (the dataclass repeats no value)."""
    return _BY_FIELD[name].default


@dataclass(frozen=True)
class Settings:
    host: str = HOST.default
    port: int = PORT.default
    redis_url: str | None = None
    shard_map_configmap: str | None = None  # "namespace/name"
    auth: str = AUTH.default  # or "none" (local development only)
    enqueue_tokens: tuple[str, ...] = ()
    max_payload: int = _d("max_payload")
    limits: QueueLimits = field(default_factory=QueueLimits)
    # not settings: fixed by the API contract (docs/api.md)
    max_limit: int = 1000
    default_limit: int = 100
    max_wait_s: float = 60.0
    max_waiters: int = _d("max_waiters")
    request_deadline_s: float = 5.0  # internal retries (migrating slot, moved) stop here
    auth_skew_s: int = 300
    push_webhook: str | None = None
    # Device push (relay/devicepush): credentials, provider URLs, coalescing
    push_credentials_dir: str | None = None
    push_fcm_url: str = _d("push_fcm_url")
    push_apns_url: str = _d("push_apns_url")
    push_ca_file: str | None = None
    push_coalesce_s: float = _d("push_coalesce_s")
    push_min_interval_s: float = _d("push_min_interval_s")
    shutdown_grace_s: float = 10.0
    live_queue_max: int = 256  # unacked frames in flight per WebSocket before we stop reading ahead
    # A live client whose socket accepts nothing for this long is dropped (its frames held in memory).
    live_send_timeout_s: float = _d("live_send_timeout_s")
    # A live socket's or waiting poll's presence lease (relay/presence.py): status.live_delivery
    # and the push decision see it fleet-wide; a killed holder's lapses within this long.
    presence_ttl_s: float = _d("presence_ttl_s")
    # A body must arrive within this long, or a slow sender (slowloris) holds a handler forever.
    body_timeout_s: float = _d("body_timeout_s")
    # Shard health (INFO) every this many seconds; slot statistics at most this often, after a scrape.
    shard_health_interval_s: float = _d("shard_health_interval_s")
    shard_stats_interval_s: float = _d("shard_stats_interval_s")

    # Hostile clients (docs/api.md, "Hostile traffic"): see docs/reliability.md.
    # Complete request headers within this long of connecting (or of a new request's first byte).
    header_timeout_s: float = _d("header_timeout_s")
    # An idle keep-alive connection closes after this long.
    keepalive_timeout_s: float = _d("keepalive_timeout_s")
    # Clean enqueues served by relay/http/fastpath.py, everything else by aiohttp (off: all by aiohttp).
    http_fastpath: bool = _d("http_fastpath")
    # Open client connections at once; 0: the open-files limit minus a reserve of 128.
    max_connections: int = _d("max_connections")
    # Fan-out: recipients x payload bytes at most this, else 413 fanout_too_large.
    max_fanout_bytes: int = _d("max_fanout_bytes")
    # Memory guard: refuse new work (503 overloaded) before RSS passes this many MiB;
    # 0: the cgroup's memory limit when there is one, else no guard.
    max_rss_mb: int = _d("max_rss_mb")
    # Young garbage-collector passes every this many net allocations (relay/gc_tuning.py).
    gc_young_threshold: int = _d("gc_young_threshold")
    fleet: str = _d("fleet")
    shutdown_delay_s: float = _d(
        "shutdown_delay_s"
    )  # keep serving after SIGTERM (endpoints catch up), then drain
    credentials_dir: str | None = None  # RELAY_REDIS_CREDENTIALS_DIR: full shard URLs, one file each
    # The DIDComm mediator (relay/didcomm): off unless a seed file is given (a Secret mount; the
    # same seed on every relay of a fleet makes them one mediator). The public URL is what
    # agents reach the fleet at (invitation, DID document, mediate-grant endpoint).
    didcomm_seed_file: str | None = None
    public_url: str | None = None
    # A message a Pickup delivery handed out is offered again only after this long without
    # its messages-received (an agent that died before acking gets it back then).
    didcomm_redeliver_s: float = _d("didcomm_redeliver_s")
    # The mediator's record limits (relay/didcomm/records.py, docs/protocols.md "Limits").
    didcomm_max_keys_per_connection: int = _d("didcomm_max_keys_per_connection")
    didcomm_idle_expiry_s: float = _d("didcomm_idle_expiry_s")
    didcomm_max_connections_per_client: int = _d("didcomm_max_connections_per_client")
    # How often the fleet sweeps each shard's expired DIDComm records (relay/didcomm/sweep.py;
    # 0: only the mediator's writes to a slot sweep it).
    didcomm_sweep_interval_s: float = _d("didcomm_sweep_interval_s")
    # Per-client quota across recipients (relay/api/quota.py, docs/api.md "Client quota"): a
    # token bucket per client of this many messages and payload bytes, refilled over the window.
    client_rate_messages: int = _d("client_rate_messages")
    client_rate_bytes: int = _d("client_rate_bytes")
    client_rate_window_ms: int = _d("client_rate_window_ms")
    # X-Forwarded-For is believed only from a TCP peer in one of these networks (CIDR text).
    trusted_proxies: tuple[str, ...] = ()

    @property
    def fleet_name(self) -> str:
        return self.fleet

    @classmethod
    def from_env(cls, **flags: Any) -> Settings:
        """Settings from the environment (read here, once: every declared setting with a field),
        `flags` (the CLI's) taking precedence."""
        warn_removed_env()
        values: dict[str, Any] = {}
        limits: dict[str, Any] = {}
        for s in RELAY_SETTINGS:
            if s.field is None or s.field in flags:
                continue
            if s.field.startswith(_F):
                limits[s.field.removeprefix(_F)] = s.read()
            else:
                values[s.field] = s.read()
        limits["retention_ms"] = limits.pop("retention_s") * 1000
        values["limits"] = QueueLimits(**limits)
        values.update(flags)
        return cls(**values)
