"""A RelayShard's spec as typed values, with the CRD's defaults applied.

The API server validates every RelayShard against the CRD (crds/relayshards.yaml: types,
ranges, enums, names, CEL rules) and fills its defaults; repeating the defaults here keeps
the pure builders total (they also receive hand-written bodies in tests and from objects
stored before a default existed). The checks are not repeated: SpecError is left for what
the schema cannot say (whole-byte sizes, a five-field cron schedule).

The two images are the exception: the CRD has no default for them, so a RelayShard that names
none runs the operator's configured ones (ImageDefaults, from the chart's values), and a
chart upgrade moves it along (docs/design-decisions.md, "Images the operator defaults").
So are the quota keys of spec.limits (no default in the CRD either): a key a RelayShard leaves
out takes the operator's configured value (LimitDefaults, the chart's relayDefaults.limits),
else the relay's own default holds.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from relay import settings as relay_settings
from relay.settings import RELAY_SETTINGS

GROUP = "relayfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SHARD_KIND = "RelayShard"
SHARD_PLURAL = "relayshards"
REBALANCE_KIND = "RelayRebalance"
REBALANCE_PLURAL = "relayrebalances"

DEFAULT_IMAGE = "ghcr.io/relayfleet/relayfleet:0.2.0"
# The project's Redis image (Dockerfile.redis: Debian's redis-server and redis-sentinel, uid 999)
DEFAULT_REDIS_IMAGE = "ghcr.io/relayfleet/redis:0.2.0"

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
class ImageDefaults:
    """The images of a RelayShard that names none (spec.image, spec.redis.managed.image):
    the operator's configuration (OperatorSettings), else this release's images."""

    relay: str = DEFAULT_IMAGE
    redis: str = DEFAULT_REDIS_IMAGE


# The labels of the operator's Pods as the chart sets them (its selector without the release).
DEFAULT_OPERATOR_LABELS: tuple[tuple[str, str], ...] = (
    ("app.kubernetes.io/name", "relayfleet"),
    ("app.kubernetes.io/component", "operator"),
)


@dataclass(frozen=True)
class Neighbours:
    """Who outside a shard's namespace may reach its Redis, and where the Spark jobs run
    (the operator's configuration, from the chart): the Redis NetworkPolicy admits the
    operator's Pods of `operator_namespace` only (None: the shard's own namespace), and the
    Spark jobs' Pods of `spark_namespace` for the fleets in `spark_fleets` (namespace, fleet),
    whose credentials Secret the operator copies there."""

    operator_namespace: str | None = None
    operator_labels: tuple[tuple[str, str], ...] = DEFAULT_OPERATOR_LABELS
    spark_namespace: str | None = None
    spark_fleets: frozenset[tuple[str, str]] = frozenset()

    def spark_for(self, namespace: str, fleet: str) -> str | None:
        """The Spark jobs' namespace when they serve this fleet, else None."""
        if self.spark_namespace and (namespace, fleet) in self.spark_fleets:
            return self.spark_namespace
        return None


# no Spark, the operator in the shard's own namespace: the narrowest peers (builders' default)
DEFAULT_NEIGHBOURS = Neighbours()


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
    # The storage quotas (docs/operator.md): spec.limits key -> value, only those given; the
    # relay's own default holds for the rest (relay/settings.py has them once).
    quotas: tuple[tuple[str, int | float], ...] = ()
    trusted_proxies: tuple[str, ...] = ()

    def crd_defaulted_env(self) -> list[tuple[str, int]]:
        """The relay variables of the five keys the CRD defaults, with their values (scaled as the
        relay's declaration says), in CRD_DEFAULTED_LIMITS' order."""
        values = (
            self.max_payload_bytes,
            self.rate_limit_messages,
            self.rate_limit_window_seconds,
            self.max_queue_messages,
            self.max_queue_bytes,
        )
        pairs = [(LIMIT_ENV[key], value) for key, value in zip(CRD_DEFAULTED_LIMITS, values, strict=True)]
        return [(env, value * scale) for (env, scale), value in pairs]


# The spec.limits keys with a CRD default: typed fields of Limits (the API server fills them in).
CRD_DEFAULTED_LIMITS: tuple[str, ...] = (
    "maxPayloadBytes",
    "rateLimitMessages",
    "rateLimitWindowSeconds",
    "maxQueueMessages",
    "maxQueueBytes",
)
# spec.limits key -> the relay variable it sets and the key's scale (rateLimitWindowSeconds: x 1000),
# from the relay's declarations (relay/settings.py: each setting names its key)
LIMIT_ENV: dict[str, tuple[str, int]] = {
    s.limit_key: (s.env, s.limit_scale) for s in RELAY_SETTINGS if s.limit_key
}
# The other relay variables the operator sets on every relay (builders/deployments.py)
FLEET_ENV = relay_settings.FLEET.env
RETENTION_ENV = relay_settings.RETENTION_SECONDS.env
CREDENTIALS_DIR_ENV = relay_settings.CREDENTIALS_DIR.env
PUBLIC_URL_ENV = relay_settings.PUBLIC_URL.env
PUSH_CREDENTIALS_DIR_ENV = relay_settings.PUSH_CREDENTIALS_DIR.env
PUSH_CREDENTIAL_FILES = (relay_settings.PUSH_FCM_FILE, *relay_settings.PUSH_APNS_FILES)
# spec.limits keys of the quotas -> the relay's environment variable (the value as given;
# 0 turns a limit off), from the relay's own declarations (relay/settings.py: each setting names
# its spec.limits key), so a limit cannot be added on one side only. crds/relayshards.yaml
# declares each with its range (tests/project/test_chart_limits.py holds the three together).
QUOTA_ENV: dict[str, str] = {
    s.limit_key: s.env
    for s in RELAY_SETTINGS
    if s.limit_key and s.limit_key not in CRD_DEFAULTED_LIMITS and s.limit_key != "trustedProxies"
}
TRUSTED_PROXIES_ENV = next(s.env for s in RELAY_SETTINGS if s.limit_key == "trustedProxies")  # comma-joined
# The spec.limits keys without a CRD default, so the ones a fleet-wide default can fill: the API
# server writes the other five into every RelayShard, where no operator default could reach them.
DEFAULTABLE_LIMITS: tuple[str, ...] = (*QUOTA_ENV, "trustedProxies")
# shardReserveFraction is a number; every other quota key is an integer
_FRACTION_LIMITS = frozenset({"shardReserveFraction"})


@dataclass(frozen=True)
class LimitDefaults:
    """spec.limits keys a RelayShard leaves out, from the operator's configuration
    (OperatorSettings, RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS: the chart's relayDefaults.limits).
    A RelayShard's own key wins, even 0 (off) or an empty trustedProxies."""

    values: tuple[tuple[str, int | float | tuple[str, ...]], ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> LimitDefaults:
        """From a JSON object of spec.limits keys, with the CRD's types (the chart's
        values.schema.json checks their ranges). ValueError names the first bad key."""
        if not isinstance(raw, Mapping):
            raise ValueError("not a JSON object of spec.limits keys")
        out: list[tuple[str, int | float | tuple[str, ...]]] = []
        for key in DEFAULTABLE_LIMITS:
            if key not in raw:
                continue
            value = raw[key]
            if key == "trustedProxies":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ValueError("trustedProxies: not a list of CIDRs")
                try:
                    out.append((key, _trusted_proxies(value)))
                except SpecError as exc:
                    raise ValueError(str(exc)) from None
                continue
            number = (int, float) if key in _FRACTION_LIMITS else (int,)
            if isinstance(value, bool) or not isinstance(value, number) or value < 0:
                raise ValueError(f"{key}: not a non-negative {'number' if len(number) > 1 else 'integer'}")
            out.append((key, value))
        unknown = sorted(str(k)[:64] for k in raw if k not in DEFAULTABLE_LIMITS)
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not one of {', '.join(DEFAULTABLE_LIMITS)}")
        return cls(tuple(out))


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
    # a whole Secret: the device push providers' credentials, one file per key
    # (relay/devicepush/credentials.py names them), mounted as RELAY_PUSH_CREDENTIALS_DIR
    push_credentials: str | None = None
    public_url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    pod_template: PodTemplate = PodTemplate()


# The operator sets these itself (or they carry secrets, which are mounted as files instead):
# spec.relay.env may not name them: the CRD's CEL rule rejects this list (tests keep the two equal).
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
        PUSH_CREDENTIALS_DIR_ENV,
        *QUOTA_ENV.values(),
        TRUSTED_PROXIES_ENV,
    }
)


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


def _obj(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value: Mapping[str, Any] | None = parent.get(key)
    return value if value is not None else {}


def _resources(value: Mapping[str, Any]) -> dict[str, dict[str, Quantity]]:
    return {kind: dict(value[kind]) for kind in ("requests", "limits") if value.get(kind)}


def _size(parent: Mapping[str, Any], where: str, default: Quantity) -> Quantity:
    """A storage size as given, once it is known to be whole bytes (the schema's quantity
    pattern also admits milli and exponent forms)."""
    size: Quantity = parent.get("size", default)
    try:
        quantity_bytes(size)
    except SpecError as exc:
        raise SpecError(f"{where}.size: {exc}") from None
    return size


def _redis(spec: Mapping[str, Any], image: str) -> ManagedRedis | ExternalRedis:
    redis = _obj(spec, "redis")
    if redis.get("managed") is not None:
        m = _obj(redis, "managed")
        storage = _obj(m, "storage")
        res = _obj(m, "resources")
        tls = m.get("tls")
        return ManagedRedis(
            replicas=m.get("replicas", 0),
            min_replicas=m.get("minReplicas", 0),
            tls_secret=tls["secretName"] if tls is not None else None,
            image=m.get("image") or image,
            storage_size=_size(storage, "spec.redis.managed.storage", "1Gi"),
            storage_class=storage.get("storageClassName") or None,
            appendfsync=m.get("appendfsync", "everysec"),
            maxmemory_bytes=quantity_bytes(m.get("maxmemory", 0)),
            resources=_resources(res) if res else default_redis_resources(),
        )
    e = _obj(redis, "external")
    if e.get("url") is not None:
        return ExternalRedis(url=e["url"])
    ref = _obj(e, "secretRef")
    return ExternalRedis(secret_name=ref["name"], secret_key=ref.get("key", "url"))


def _backup(spec: Mapping[str, Any]) -> Backup | None:
    if spec.get("backup") is None:
        return None
    b = _obj(spec, "backup")
    schedule: str = b.get("schedule", Backup.schedule)
    if len(schedule.split()) != 5:  # the schema bounds only its length
        raise SpecError("spec.backup.schedule must be a cron schedule of 5 fields")
    storage = _obj(b, "storage")
    return Backup(
        schedule=schedule,
        keep=b.get("keep", Backup.keep),
        suspend=b.get("suspend", False),
        storage_size=_size(storage, "spec.backup.storage", Backup.storage_size),
        storage_class=storage.get("storageClassName") or None,
    )


def _secret_ref(parent: Mapping[str, Any], key: str, default_key: str) -> SecretKeyRef | None:
    ref = parent.get(key)
    return None if ref is None else SecretKeyRef(ref["name"], ref.get("key", default_key))


def _relay(spec: Mapping[str, Any]) -> RelayConfig:
    relay = _obj(spec, "relay")
    pod = _obj(relay, "podTemplate")
    return RelayConfig(
        enqueue_tokens=_secret_ref(relay, "enqueueTokensSecretRef", "tokens"),
        push_webhook=_secret_ref(relay, "pushWebhookSecretRef", "url"),
        didcomm_seed=_secret_ref(relay, "didcommSeedSecretRef", "seed"),
        push_credentials=(relay.get("pushCredentialsSecretRef") or {}).get("name") or None,
        public_url=relay.get("publicURL") or None,
        env=tuple((item["name"], item.get("value", "")) for item in relay.get("env") or ()),
        pod_template=PodTemplate(
            affinity=pod.get("affinity") or None,
            tolerations=tuple(pod.get("tolerations") or ()),
            topology_spread_constraints=tuple(pod.get("topologySpreadConstraints") or ()),
            node_selector=dict(_obj(pod, "nodeSelector")),
            priority_class_name=pod.get("priorityClassName") or None,
            annotations=dict(_obj(pod, "annotations")),
        ),
    )


def _trusted_proxies(value: Any) -> tuple[str, ...]:
    """spec.limits.trustedProxies, each a CIDR or address (the schema's pattern is loose)."""
    out = []
    for item in value:
        try:
            out.append(str(ipaddress.ip_network(str(item), strict=False)))
        except ValueError:
            raise SpecError(f"limits.trustedProxies: {str(item)[:64]!r} is not a CIDR") from None
    return tuple(out)


def parse_shard(
    body: Mapping[str, Any],
    images: ImageDefaults = ImageDefaults(),
    limit_defaults: LimitDefaults = LimitDefaults(),
) -> ShardSpec:
    """Build a ShardSpec from a RelayShard object (as a dict or kopf Body); `images` for the
    images it does not name, `limit_defaults` for the spec.limits quota keys it leaves out.

    The API server has checked the object against the CRD's schema and CEL rules
    (crds/relayshards.yaml: types, ranges, enums, names, exactly-one-of, reserved env);
    only what the schema cannot say is checked here, as SpecError.
    """
    meta = _obj(body, "metadata")
    spec = _obj(body, "spec")
    retention = _obj(spec, "retention")
    # the shard's own keys over the operator's defaults (merged before parsing, so both are checked alike)
    limits = {**dict(limit_defaults.values), **_obj(spec, "limits")}
    res = _obj(spec, "resources")
    generation = meta.get("generation", 0)
    return ShardSpec(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=str(meta.get("uid", "")),
        generation=generation if isinstance(generation, int) else 0,
        fleet=spec["fleet"],
        redis=_redis(spec, images.redis),
        backup=_backup(spec),
        replicas=spec.get("replicas", 2),
        weight=spec.get("weight", 100),
        image=spec.get("image") or images.relay,
        image_pull_policy=spec.get("imagePullPolicy", "IfNotPresent"),
        auto_rebalance=spec.get("autoRebalance", False),
        resources=_resources(res) if res else default_relay_resources(),
        retention=Retention(
            max_age_seconds=parse_duration(retention.get("maxAge", "7d")),
            max_messages=retention.get("maxMessages", Retention.max_messages),
        ),
        limits=Limits(
            max_payload_bytes=limits.get("maxPayloadBytes", Limits.max_payload_bytes),
            rate_limit_messages=limits.get("rateLimitMessages", Limits.rate_limit_messages),
            rate_limit_window_seconds=limits.get("rateLimitWindowSeconds", Limits.rate_limit_window_seconds),
            max_queue_messages=limits.get("maxQueueMessages", Limits.max_queue_messages),
            max_queue_bytes=limits.get("maxQueueBytes", Limits.max_queue_bytes),
            quotas=tuple((key, limits[key]) for key in QUOTA_ENV if key in limits),
            trusted_proxies=_trusted_proxies(limits.get("trustedProxies", ())),
        ),
        relay=_relay(spec),
    )
