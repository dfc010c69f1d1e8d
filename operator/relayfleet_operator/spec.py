"""A RelayShard's spec as typed values, with the CRD's defaults applied.

The API server fills defaults already; repeating them here keeps the pure builders total
(they also receive hand-written bodies in tests and from older stored objects). Bad input
raises SpecError with a message naming the field, never a KeyError.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GROUP = "relayfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SHARD_KIND = "RelayShard"
SHARD_PLURAL = "relayshards"
REBALANCE_KIND = "RelayRebalance"
REBALANCE_PLURAL = "relayrebalances"

DEFAULT_IMAGE = "ghcr.io/relayfleet/relayfleet:0.2.0"
DEFAULT_REDIS_IMAGE = "redis:7.2"

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"^([0-9]+)(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGTPE]i|[kMGTPE]|m)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

Quantity = int | str
Resources = Mapping[str, Mapping[str, Quantity]]


def default_relay_resources() -> Resources:
    return {"requests": {"cpu": "100m", "memory": "128Mi"}}


def default_redis_resources() -> Resources:
    return {"requests": {"cpu": "100m", "memory": "256Mi"}}


class SpecError(ValueError):
    """A RelayShard or RelayRebalance spec the operator cannot act on."""


@dataclass(frozen=True)
class ManagedRedis:
    image: str = DEFAULT_REDIS_IMAGE
    storage_size: Quantity = "1Gi"
    storage_class: str | None = None
    appendfsync: str = "everysec"
    maxmemory_bytes: int = 0
    resources: Resources = field(default_factory=default_redis_resources)
    # Replicas besides the primary; above 0 the shard runs Sentinels too (see ha.py).
    replicas: int = 0
    # Writes wait (WAIT) for this many replicas; at most `replicas`.
    min_replicas: int = 0
    # spec.redis.managed.tls.secretName: TLS only, certificate (tls.crt, tls.key, ca.crt) from it
    tls_secret: str | None = None

    @property
    def sentinel(self) -> bool:
        return self.replicas > 0


@dataclass(frozen=True)
class ExternalRedis:
    url: str | None = None
    secret_name: str | None = None
    secret_key: str = "url"


@dataclass(frozen=True)
class Backup:
    """spec.backup: a CronJob snapshots the shard's Redis onto a claim, keeping `keep`."""

    schedule: str = "17 * * * *"
    keep: int = 24
    suspend: bool = False
    storage_size: Quantity = "10Gi"
    storage_class: str | None = None


@dataclass(frozen=True)
class Limits:
    max_payload_bytes: int = 5242880
    rate_limit_messages: int = 500
    rate_limit_window_seconds: int = 5
    max_queue_messages: int = 10000
    max_queue_bytes: int = 268435456


@dataclass(frozen=True)
class Retention:
    max_age_seconds: int = 7 * 86400
    max_messages: int = 10000


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class PodTemplate:
    """Scheduling controls and annotations copied onto the relay pods as given."""

    affinity: Mapping[str, Any] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    priority_class_name: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RelayConfig:
    """spec.relay: what the relay pods get beyond limits and retention."""

    enqueue_tokens: SecretKeyRef | None = None
    push_webhook: SecretKeyRef | None = None
    didcomm_seed: SecretKeyRef | None = None
    public_url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    pod_template: PodTemplate = PodTemplate()


# The operator sets these itself (or they carry secrets, which are mounted as files instead):
# spec.relay.env may not name them. The CRD's CEL rule repeats this list.
RESERVED_RELAY_ENV = frozenset(
    {
        "RELAY_FLEET",
        "RELAY_HOST",
        "RELAY_PORT",
        "RELAY_REDIS_URL",
        "RELAY_SHARD_MAP",
        "RELAY_SHARD_MAP_CONFIGMAP",
        "RELAY_REDIS_CREDENTIALS_DIR",
        "RELAY_MAX_PAYLOAD",
        "RELAY_RATE_LIMIT",
        "RELAY_RATE_WINDOW_MS",
        "RELAY_QUEUE_MAX_MESSAGES",
        "RELAY_QUEUE_MAX_BYTES",
        "RELAY_RETENTION_SECONDS",
        "RELAY_PUBLIC_URL",
        "RELAY_ENQUEUE_TOKENS",
        "RELAY_ENQUEUE_TOKENS_FILE",
        "RELAY_PUSH_WEBHOOK",
        "RELAY_PUSH_WEBHOOK_FILE",
        "RELAY_DIDCOMM_SEED",
        "RELAY_DIDCOMM_SEED_FILE",
    }
)
_RELAY_ENV_NAME = re.compile(r"^RELAY_[A-Z0-9_]{1,64}$")


@dataclass(frozen=True)
class ShardSpec:
    name: str
    namespace: str
    uid: str
    fleet: str
    redis: ManagedRedis | ExternalRedis
    replicas: int = 2
    weight: int = 100
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    auto_rebalance: bool = False
    resources: Resources = field(default_factory=default_relay_resources)
    retention: Retention = Retention()
    limits: Limits = Limits()
    relay: RelayConfig = RelayConfig()
    generation: int = 0
    backup: Backup | None = None

    @property
    def managed(self) -> bool:
        return isinstance(self.redis, ManagedRedis)


def parse_duration(text: str) -> int:
    """'7d' / '12h' / '30m' / '45s' into seconds."""
    m = _DURATION.match(text)
    if not m:
        raise SpecError(f"duration {text!r} must be a number followed by s, m, h or d")
    return int(m.group(1)) * _UNITS[m.group(2)]


def quantity_bytes(value: Quantity) -> int:
    """A Kubernetes quantity ('512Mi', '1G', 1073741824) as a whole number of bytes."""
    if isinstance(value, bool):
        raise SpecError(f"quantity {value!r} is not a number")
    if isinstance(value, int):
        if value < 0:
            raise SpecError(f"quantity {value} must not be negative")
        return value
    m = _QUANTITY.match(value.strip())
    if not m:
        raise SpecError(f"quantity {value!r} is not a byte size like 512Mi or 1G")
    number, suffix = float(m.group(1)), m.group(2)
    if suffix == "m":
        raise SpecError(f"quantity {value!r}: milli-bytes make no sense for memory")
    factor = _BINARY.get(suffix or "", _DECIMAL.get(suffix or "", 1))
    return int(number * factor)


def _obj(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}.{key} must be an object")
    return value


def _int(parent: Mapping[str, Any], key: str, where: str, default: int, lo: int, hi: int) -> int:
    value = parent.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"{where}.{key} must be between {lo} and {hi}, got {value}")
    return value


def _str(parent: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = parent.get(key, default)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}.{key} must be a non-empty string")
    return value


def _resources(value: Mapping[str, Any], where: str) -> dict[str, dict[str, Quantity]]:
    out: dict[str, dict[str, Quantity]] = {}
    for kind in ("requests", "limits"):
        section = _obj(value, kind, where)
        if section:
            entries: dict[str, Quantity] = {}
            for k, v in section.items():
                if isinstance(v, bool) or not isinstance(v, int | str):
                    raise SpecError(f"{where}.{kind}.{k} must be a quantity")
                entries[str(k)] = v
            out[kind] = entries
    return out


def _redis(spec: Mapping[str, Any]) -> ManagedRedis | ExternalRedis:
    redis = _obj(spec, "redis", "spec")
    managed, external = redis.get("managed"), redis.get("external")
    if (managed is None) == (external is None):
        raise SpecError("exactly one of redis.managed or redis.external must be set")
    if managed is not None:
        m = _obj(redis, "managed", "spec.redis")
        storage = _obj(m, "storage", "spec.redis.managed")
        fsync = m.get("appendfsync", "everysec")
        if fsync not in ("everysec", "always"):
            raise SpecError("spec.redis.managed.appendfsync must be everysec or always")
        size = storage.get("size", "1Gi")
        quantity_bytes(size)  # validates
        res = _obj(m, "resources", "spec.redis.managed")
        storage_class = storage.get("storageClassName")
        replicas = _int(m, "replicas", "spec.redis.managed", 0, 0, 2)
        min_replicas = _int(m, "minReplicas", "spec.redis.managed", 0, 0, 2)
        if min_replicas > replicas:
            raise SpecError("spec.redis.managed.minReplicas must not exceed spec.redis.managed.replicas")
        tls_secret: str | None = None
        if m.get("tls") is not None:
            tls_secret = _str(_obj(m, "tls", "spec.redis.managed"), "secretName", "spec.redis.managed.tls")
            if replicas:
                raise SpecError("spec.redis.managed.tls is not supported with replicas yet")
        return ManagedRedis(
            replicas=replicas,
            min_replicas=min_replicas,
            tls_secret=tls_secret,
            image=_str(m, "image", "spec.redis.managed", ManagedRedis.image),
            storage_size=size,
            storage_class=storage_class if isinstance(storage_class, str) and storage_class else None,
            appendfsync=fsync,
            maxmemory_bytes=quantity_bytes(m.get("maxmemory", 0)),
            resources=_resources(res, "spec.redis.managed.resources") if res else default_redis_resources(),
        )
    e = _obj(redis, "external", "spec.redis")
    url, ref = e.get("url"), e.get("secretRef")
    if (url is None) == (ref is None):
        raise SpecError("exactly one of redis.external.url or redis.external.secretRef must be set")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise SpecError("spec.redis.external.url must start with redis://, rediss:// or unix://")
        return ExternalRedis(url=url)
    r = _obj(e, "secretRef", "spec.redis.external")
    return ExternalRedis(
        secret_name=_str(r, "name", "spec.redis.external.secretRef"),
        secret_key=_str(r, "key", "spec.redis.external.secretRef", "url"),
    )


def _backup(spec: Mapping[str, Any]) -> Backup | None:
    if spec.get("backup") is None:
        return None
    b = _obj(spec, "backup", "spec")
    schedule = _str(b, "schedule", "spec.backup", Backup.schedule)
    if len(schedule.split()) != 5:
        raise SpecError("spec.backup.schedule must be a cron schedule of 5 fields")
    suspend = b.get("suspend", False)
    if not isinstance(suspend, bool):
        raise SpecError("spec.backup.suspend must be a boolean")
    storage = _obj(b, "storage", "spec.backup")
    size = storage.get("size", Backup.storage_size)
    quantity_bytes(size)  # validates
    storage_class = storage.get("storageClassName")
    return Backup(
        schedule=schedule,
        keep=_int(b, "keep", "spec.backup", Backup.keep, 1, 1000),
        suspend=suspend,
        storage_size=size,
        storage_class=storage_class if isinstance(storage_class, str) and storage_class else None,
    )


def _secret_ref(parent: Mapping[str, Any], key: str, default_key: str) -> SecretKeyRef | None:
    where = f"spec.relay.{key}"
    if parent.get(key) is None:
        return None
    ref = _obj(parent, key, "spec.relay")
    return SecretKeyRef(_str(ref, "name", where), _str(ref, "key", where, default_key))


def _objects(parent: Mapping[str, Any], key: str, where: str) -> tuple[Mapping[str, Any], ...]:
    value = parent.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise SpecError(f"{where}.{key} must be a list of objects")
    return tuple(value)


def _string_map(parent: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = _obj(parent, key, where)
    if not all(isinstance(v, str) for v in value.values()):
        raise SpecError(f"{where}.{key} values must be strings")
    return {str(k): str(v) for k, v in value.items()}


def _relay_env(relay: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for item in _objects(relay, "env", "spec.relay"):
        name, value = item.get("name"), item.get("value", "")
        if not isinstance(name, str) or not _RELAY_ENV_NAME.match(name):
            raise SpecError(f"spec.relay.env: {name!r} is not a RELAY_* variable name")
        if name in RESERVED_RELAY_ENV:
            raise SpecError(
                f"spec.relay.env: {name} is set by the operator (or is a secret: use a secretRef)"
            )
        if not isinstance(value, str):
            raise SpecError(f"spec.relay.env: the value of {name} must be a string")
        if any(name == seen for seen, _ in out):
            raise SpecError(f"spec.relay.env: {name} appears twice")
        out.append((name, value))
    return tuple(out)


def _relay(spec: Mapping[str, Any]) -> RelayConfig:
    relay = _obj(spec, "relay", "spec")
    pod = _obj(relay, "podTemplate", "spec.relay")
    where = "spec.relay.podTemplate"
    public_url = relay.get("publicURL")
    if public_url is not None and (
        not isinstance(public_url, str) or not public_url.startswith(("https://", "http://"))
    ):
        raise SpecError("spec.relay.publicURL must be an http(s) URL")
    affinity = pod.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise SpecError(f"{where}.affinity must be an object")
    priority = pod.get("priorityClassName")
    if priority is not None and not isinstance(priority, str):
        raise SpecError(f"{where}.priorityClassName must be a string")
    return RelayConfig(
        enqueue_tokens=_secret_ref(relay, "enqueueTokensSecretRef", "tokens"),
        push_webhook=_secret_ref(relay, "pushWebhookSecretRef", "url"),
        didcomm_seed=_secret_ref(relay, "didcommSeedSecretRef", "seed"),
        public_url=public_url or None,
        env=_relay_env(relay),
        pod_template=PodTemplate(
            affinity=affinity or None,
            tolerations=_objects(pod, "tolerations", where),
            topology_spread_constraints=_objects(pod, "topologySpreadConstraints", where),
            node_selector=_string_map(pod, "nodeSelector", where),
            priority_class_name=priority or None,
            annotations=_string_map(pod, "annotations", where),
        ),
    )


def parse_shard(body: Mapping[str, Any]) -> ShardSpec:
    """Build a ShardSpec from a RelayShard object (as a dict or kopf Body)."""
    meta = _obj(body, "metadata", "object")
    spec = _obj(body, "spec", "object")
    name = _str(meta, "name", "metadata")
    if len(name) > 32 or not _DNS1035.match(name):
        raise SpecError("RelayShard name must be a DNS-1035 label of at most 32 characters")
    fleet = _str(spec, "fleet", "spec")
    if len(fleet) > 32 or not _DNS1035.match(fleet):
        raise SpecError("spec.fleet must be a DNS-1035 label of at most 32 characters")
    retention = _obj(spec, "retention", "spec")
    limits = _obj(spec, "limits", "spec")
    res = _obj(spec, "resources", "spec")
    auto = spec.get("autoRebalance", False)
    if not isinstance(auto, bool):
        raise SpecError("spec.autoRebalance must be a boolean")
    pull = spec.get("imagePullPolicy", "IfNotPresent")
    if pull not in ("Always", "IfNotPresent", "Never"):
        raise SpecError("spec.imagePullPolicy must be Always, IfNotPresent or Never")
    generation = meta.get("generation", 0)
    return ShardSpec(
        name=name,
        namespace=_str(meta, "namespace", "metadata", "default"),
        uid=str(meta.get("uid", "")),
        generation=generation if isinstance(generation, int) else 0,
        fleet=fleet,
        redis=_redis(spec),
        backup=_backup(spec),
        replicas=_int(spec, "replicas", "spec", 2, 0, 1000),
        weight=_int(spec, "weight", "spec", 100, 1, 10000),
        image=_str(spec, "image", "spec", DEFAULT_IMAGE),
        image_pull_policy=pull,
        auto_rebalance=auto,
        resources=_resources(res, "spec.resources") if res else default_relay_resources(),
        retention=Retention(
            max_age_seconds=parse_duration(_str(retention, "maxAge", "spec.retention", "7d")),
            max_messages=_int(retention, "maxMessages", "spec.retention", 10000, 1, 100_000_000),
        ),
        limits=Limits(
            max_payload_bytes=_int(limits, "maxPayloadBytes", "spec.limits", 5242880, 1, 2**29),
            rate_limit_messages=_int(limits, "rateLimitMessages", "spec.limits", 500, 1, 1_000_000),
            rate_limit_window_seconds=_int(limits, "rateLimitWindowSeconds", "spec.limits", 5, 1, 3600),
            max_queue_messages=_int(limits, "maxQueueMessages", "spec.limits", 10000, 1, 100_000_000),
            max_queue_bytes=_int(limits, "maxQueueBytes", "spec.limits", 268435456, 1, 2**40),
        ),
        relay=_relay(spec),
    )
