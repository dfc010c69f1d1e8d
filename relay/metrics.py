"""Prometheus metrics of the relay. No per-queue labels: queues are unbounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relay.loop_metrics import CounterSeries, LoopCounter, LoopGauge, LoopHistogram

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_WAKE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

# The hot-path series are Loop* families: plain numbers only the event loop updates
# (relay/loop_metrics.py); the rest are prometheus_client's own.
REQUESTS = LoopCounter(
    "relayfleet_http_requests_total",
    "HTTP requests by route and status",
    ["route", "method", "status"],
    registry=REGISTRY,
)
REQUEST_SECONDS = LoopHistogram(
    "relayfleet_http_request_duration_seconds",
    "HTTP request latency (long-polls include their wait)",
    ["route", "method"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
MESSAGES = LoopCounter(
    "relayfleet_messages_total", "Queue operations on messages", ["op"], registry=REGISTRY
)  # op: enqueued, duplicate, delivered, drained, acked, expired
BYTES = LoopCounter(
    "relayfleet_message_bytes_total", "Payload bytes by queue operation", ["op"], registry=REGISTRY
)
REJECTED = Counter(
    "relayfleet_rejected_total", "Requests rejected, by error code", ["code"], registry=REGISTRY
)
RATE_LIMITED = Counter(
    "relayfleet_rate_limited_total", "Enqueues refused by the per-queue rate limit", registry=REGISTRY
)
QUOTA_REFUSALS = Counter(
    "relayfleet_quota_refusals_total",
    "Storing requests refused by a quota (per client, per recipient, per connection, shard reserve),"
    " by route and reason",
    ["route", "reason"],  # route: a route template or "didcomm"; reason: one of QUOTA_REASONS
    registry=REGISTRY,
)
# The reasons a quota refusal is counted under (a closed set: no label takes a client's text).
QUOTA_REASONS = (
    "client_messages",  # RELAY_CLIENT_RATE_MESSAGES
    "client_bytes",  # RELAY_CLIENT_RATE_BYTES
    "recipient_channels",  # RELAY_RECIPIENT_MAX_CHANNELS
    "recipient_messages",  # RELAY_RECIPIENT_MAX_MESSAGES
    "recipient_bytes",  # RELAY_RECIPIENT_MAX_BYTES
    "recipient_rate",  # RELAY_RECIPIENT_RATE_LIMIT
    "shard_reserve",  # RELAY_SHARD_RESERVE_FRACTION / RELAY_SHARD_RESERVE_QUEUE_BYTES
    "didcomm_keys",  # RELAY_DIDCOMM_MAX_KEYS_PER_CONNECTION
    "didcomm_connections",  # RELAY_DIDCOMM_MAX_CONNECTIONS_PER_CLIENT
    "enqueue_token",  # a storing route without a valid enqueue token (401)
)


DIDCOMM_RECORDS_EXPIRED = Counter(
    "relayfleet_didcomm_records_expired_total",
    "DIDComm mediator records (connections with their keylists, key registrations) removed after"
    " their idle expiry (RELAY_DIDCOMM_IDLE_EXPIRY_S)",
    registry=REGISTRY,
)


def quota_refused(route: str, reason: str) -> None:
    """Count one quota refusal; `reason` must be one of QUOTA_REASONS (else "other")."""
    QUOTA_REFUSALS.labels(route, reason if reason in QUOTA_REASONS else "other").inc()


WAITERS = LoopGauge("relayfleet_waiters", "Long-polls currently waiting in this process", registry=REGISTRY)
LIVE_CONNECTIONS = Gauge("relayfleet_live_connections", "Open live WebSocket connections", registry=REGISTRY)
LIVE_FRAMES = LoopCounter(
    "relayfleet_live_frames_total", "Live WebSocket message frames written", ["sent_by"], registry=REGISTRY
)  # sent_by: wakeup (from the wakeup that carried the message), task (the socket's stream task)
LIVE_DROPPED = Counter(
    "relayfleet_live_dropped_total",
    "Live WebSocket clients dropped because their socket accepted nothing for RELAY_LIVE_SEND_TIMEOUT_S",
    registry=REGISTRY,
)
# Fleet-wide presence (relay/presence.py): the leases this relay holds and renews, and how
# live-socket takeovers across relays went. Labels from fixed sets only.
PRESENCE_LEASES = Gauge(
    "relayfleet_presence_leases", "Presence leases this relay holds, by kind", ["kind"], registry=REGISTRY
)  # kind: live (a live socket), poll (a waiting long-poll)
PRESENCE_WRITES = Counter(
    "relayfleet_presence_writes_total",
    "Presence lease writes to the shards, by operation and result",
    ["op", "result"],
    registry=REGISTRY,
)  # op: take, drop, renew; result: ok, failed
PRESENCE_CHECKS = Counter(
    "relayfleet_presence_checks_total",
    "Fleet-wide presence questions (status.live_delivery, push), by answer",
    ["answer"],
    registry=REGISTRY,
)  # answer: live, online (a waiting poll only), offline, unknown (the shard did not answer)
LIVE_DISPLACED = Counter(
    "relayfleet_live_displaced_total",
    "Live sockets closed 4409 because a newer one for their queue opened, by how it was learnt",
    ["via"],
    registry=REGISTRY,
)  # via: here (same relay), notice (the takeover notice), lease (a renewal found it taken)
LIVE_TAKEOVER_SECONDS = Histogram(
    "relayfleet_live_takeover_wait_seconds",
    "How long a new live socket waited for the displaced one's release before its first delivery",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
# every series of the presence counters from the start, at 0 (their label sets are fixed)
for _op in ("take", "drop", "renew"):
    for _result in ("ok", "failed"):
        PRESENCE_WRITES.labels(_op, _result)
for _answer in ("live", "online", "offline", "unknown"):
    PRESENCE_CHECKS.labels(_answer)
for _via in ("here", "notice", "lease"):
    LIVE_DISPLACED.labels(_via)
WAKEUP_SECONDS = LoopHistogram(
    "relayfleet_wakeup_latency_seconds",
    "From the waking enqueue being stored to the waiter being answered",
    buckets=_WAKE_BUCKETS,
    registry=REGISTRY,
)
REDIS_ERRORS = Counter(
    "relayfleet_redis_errors_total",
    "Redis calls that failed, by shard and kind",
    ["shard", "kind"],
    registry=REGISTRY,
)
SHARD_UP = Gauge("relayfleet_shard_up", "1 when the shard's Redis answers", ["shard"], registry=REGISTRY)
SUBSCRIBER_UP = Gauge(
    "relayfleet_wakeup_subscriber_up",
    "1 when the shard's wakeup subscription is alive",
    ["shard"],
    registry=REGISTRY,
)
SUBSCRIBER_RECONNECTS = Counter(
    "relayfleet_wakeup_reconnects_total", "Wakeup subscriber reconnects", ["shard"], registry=REGISTRY
)
SHARD_MAP_EPOCH = Gauge("relayfleet_shard_map_epoch", "Epoch of the shard map in use", registry=REGISTRY)
SHARD_MAP_RELOADS = Counter("relayfleet_shard_map_reloads_total", "Shard map reloads", registry=REGISTRY)
RETRIES = Counter(
    "relayfleet_internal_retries_total", "Requests retried inside the relay", ["reason"], registry=REGISTRY
)  # reason: moved, migrating, failover
PUSH_NOTIFICATIONS = Counter(
    "relayfleet_push_notifications_total", "Push webhook calls by outcome", ["outcome"], registry=REGISTRY
)
# Device push (relay/devicepush). provider: webhook, fcm, apns. outcome: sent, retried, failed,
# rejected, unregistered (the provider said the token is dead: the device is removed),
# coalesced (a burst inside the connection's minimum interval: nothing sent)
DEVICE_PUSH = Counter(
    "relayfleet_device_push_total",
    "Device notifications by provider and outcome",
    ["provider", "outcome"],
    registry=REGISTRY,
)
# What became of each offline burst of a mediated recipient before any provider. result:
# merged (a store folded into a burst already pending), dropped (the pending map was full),
# online (a live socket or waiting poll somewhere), no_device, notified
DEVICE_PUSH_BURSTS = Counter(
    "relayfleet_device_push_bursts_total",
    "Offline bursts of mediated recipients by result",
    ["result"],
    registry=REGISTRY,
)
# every series present at 0 from the start: a dashboard shows 0, not "no data", before the first burst
for _provider in ("webhook", "fcm", "apns"):
    for _outcome in ("sent", "retried", "failed", "rejected", "unregistered", "coalesced"):
        DEVICE_PUSH.labels(_provider, _outcome)
for _result in ("merged", "dropped", "online", "no_device", "notified"):
    DEVICE_PUSH_BURSTS.labels(_result)

# Per-shard figures, refreshed by relay.shard_health (one series per shard: shards are few).
SHARD_MEMORY_USED = Gauge(
    "relayfleet_shard_memory_used_bytes", "Redis used_memory", ["shard"], registry=REGISTRY
)
SHARD_MEMORY_MAX = Gauge(
    "relayfleet_shard_memory_max_bytes", "Redis maxmemory (0 = unlimited)", ["shard"], registry=REGISTRY
)
SHARD_AOF_ENABLED = Gauge(
    "relayfleet_shard_aof_enabled", "1 when the shard's Redis has AOF on", ["shard"], registry=REGISTRY
)
SHARD_PERSISTENCE_OK = Gauge(
    "relayfleet_shard_persistence_ok",
    "1 when the last AOF write/rewrite and RDB save of the shard's Redis succeeded",
    ["shard"],
    registry=REGISTRY,
)
SHARD_MESSAGES = Gauge(
    "relayfleet_shard_messages", "Messages held by the shard's owned slots", ["shard"], registry=REGISTRY
)
SHARD_BYTES = Gauge(
    "relayfleet_shard_bytes", "Payload bytes held by the shard's owned slots", ["shard"], registry=REGISTRY
)
SHARD_QUEUES = Gauge(
    "relayfleet_shard_queues", "Queues with keys on the shard's owned slots", ["shard"], registry=REGISTRY
)
SHARD_ENQUEUE_RATE = Gauge(
    "relayfleet_shard_enqueues_per_minute",
    "Enqueues in the last complete minute window",
    ["shard"],
    registry=REGISTRY,
)
SHARD_SLOTS = Gauge(
    "relayfleet_shard_slots", "Slots the shard map gives the shard", ["shard"], registry=REGISTRY
)
SHARD_SLOTS_MIGRATING = Gauge(
    "relayfleet_shard_slots_migrating",
    "Slots of the shard marked migrating or importing",
    ["shard"],
    registry=REGISTRY,
)
SHARD_STATS_SECONDS = Histogram(
    "relayfleet_shard_stats_duration_seconds",
    "Time to read one shard's health and slot statistics",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
SHARD_STATS_TIMESTAMP = Gauge(
    "relayfleet_shard_stats_last_success_timestamp_seconds",
    "Unix time of the shard's last complete statistics read",
    ["shard"],
    registry=REGISTRY,
)

HEADER_TIMEOUTS = Counter(
    "relayfleet_header_timeouts_total",
    "Connections closed for not sending complete request headers in time (RELAY_HEADER_TIMEOUT_S)",
    registry=REGISTRY,
)
CONNECTIONS_SHED = Counter(
    "relayfleet_connections_shed_total",
    "Connections closed to stay under the connection cap (RELAY_MAX_CONNECTIONS)",
    registry=REGISTRY,
)
RSS_BYTES = Gauge(
    "relayfleet_process_rss_bytes",
    "Resident memory of this relay process, as the memory guard sampled it",
    registry=REGISTRY,
)
OVERLOADED = Gauge(
    "relayfleet_overloaded",
    "1 while the memory guard refuses new work (RSS near RELAY_MAX_RSS_MB)",
    registry=REGISTRY,
)
HTTP_READ_PAUSES = Counter(
    "relayfleet_http_read_pauses_total",
    "Enqueue fast path flow control: reading stopped at the answers-owed bound (answers_owed),"
    " or the write buffer passed its high-water mark (write_buffer)",
    ["reason"],  # answers_owed | write_buffer
    registry=REGISTRY,
)
HTTP_HELD_BYTES = Gauge(
    "relayfleet_http_held_bytes",
    "Request bytes the enqueue fast path holds, read and not yet answered (counted by the memory guard)",
    registry=REGISTRY,
)

# Retry reasons start at 0, so the dashboard's retry panel has series before the first move.
for _reason in ("moved", "migrating", "failover"):
    RETRIES.labels(_reason)
for _reason in ("answers_owed", "write_buffer"):
    HTTP_READ_PAUSES.labels(_reason)


class RouteSeries:
    """A route's request metrics for one method, resolved once (the aiohttp route wrapper and
    the enqueue fast path count the same series): `count(status)` and `observe(seconds)`."""

    __slots__ = ("_by_status", "method", "observe", "route", "timer")

    def __init__(self, route: str, method: str) -> None:
        self.route = route
        self.method = method
        self._by_status: dict[int, CounterSeries] = {}
        self.timer = REQUEST_SECONDS.labels(route, method)
        self.observe = self.timer.observe  # one call per request, not two

    def count(self, status: int) -> None:
        series = self._by_status.get(status)
        if series is None:
            series = self._by_status[status] = REQUESTS.labels(self.route, self.method, str(status))
        series.value += 1


DIDCOMM_MESSAGES = Counter(
    "relayfleet_didcomm_messages_total",
    "DIDComm messages the mediator handled, by message type (family/version/name) and result",
    ["type", "result"],
    registry=REGISTRY,
)  # result: ok, problem (a problem-report or 4xx), undecryptable, unknown_connection, refused
