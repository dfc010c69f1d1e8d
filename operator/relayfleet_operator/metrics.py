"""The operator's own Prometheus metrics, in a registry of their own (not the process default,
so an operator started inside another process never collides with its metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "relayfleet_operator_reconciles_total",
    "Reconciliations run, by resource kind and result.",
    ["kind", "result"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "relayfleet_operator_errors_total",
    "Reconciliation errors, by resource kind and error class.",
    ["kind", "error"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "relayfleet_operator_reconcile_duration_seconds",
    "Time spent in one reconciliation.",
    ["kind"],
    registry=REGISTRY,
)
MIGRATIONS = Counter(
    "relayfleet_operator_migrations_total",
    "Slot-range moves attempted, by cause (drain, rebalance) and result.",
    ["cause", "result"],
    registry=REGISTRY,
)
SLOTS_MOVED = Counter(
    "relayfleet_operator_slots_moved_total",
    "Slots moved between shards.",
    ["fleet"],
    registry=REGISTRY,
)
BYTES_MOVED = Counter(
    "relayfleet_operator_bytes_moved_total",
    "Bytes moved between shards (as reported by the migration library).",
    ["fleet"],
    registry=REGISTRY,
)
SHARD_MAP_EPOCH = Gauge(
    "relayfleet_operator_shard_map_epoch",
    "Epoch of the shard map last written, per fleet.",
    ["namespace", "fleet"],
    registry=REGISTRY,
)
REBALANCES_ACTIVE = Gauge(
    "relayfleet_operator_rebalances_active",
    "RelayRebalances currently executing moves.",
    registry=REGISTRY,
)


REDIS_REPLICAS_ONLINE = Gauge(
    "relayfleet_operator_redis_replicas_online",
    "Replicas in state online behind a managed shard's primary, as last probed.",
    ["namespace", "fleet", "shard"],
    registry=REGISTRY,
)
REDIS_MIN_REPLICAS = Gauge(
    "relayfleet_operator_redis_min_replicas",
    "spec.redis.managed.minReplicas of a managed shard with replicas (writes wait for this many).",
    ["namespace", "fleet", "shard"],
    registry=REGISTRY,
)
REDIS_REPLICA_LAG_BYTES = Gauge(
    "relayfleet_operator_redis_replica_lag_bytes",
    "The largest replication lag (primary offset minus replica offset) of a managed shard.",
    ["namespace", "fleet", "shard"],
    registry=REGISTRY,
)
REDIS_PRIMARY_CHANGES = Counter(
    "relayfleet_operator_redis_primary_changes_total",
    "Times a managed shard's primary was seen to change between two probes (failovers).",
    ["namespace", "fleet", "shard"],
    registry=REGISTRY,
)
LAST_BACKUP_SECONDS = Gauge(
    "relayfleet_operator_last_backup_timestamp_seconds",
    "Unix time of the last successful backup of a shard (its CronJob's lastSuccessfulTime).",
    ["namespace", "fleet", "shard"],
    registry=REGISTRY,
)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose /metrics on its own port (kopf's liveness endpoint has another)."""
    start_http_server(port, addr=addr, registry=REGISTRY)


# Slot-move outcomes start at 0, so increase() and the dashboard see them before the first move.
for _cause in ("drain", "rebalance"):
    for _result in ("ok", "error"):
        MIGRATIONS.labels(_cause, _result)
