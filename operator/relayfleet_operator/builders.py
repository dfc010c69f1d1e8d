"""Pure builders: every Kubernetes object the operator owns, as plain dicts.

No I/O here: given a ShardSpec (and, where needed, a password or a shard map), each
function returns the full desired object, ready for server-side apply. Handlers stay
thin and tests can check every field without an API server.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from relay.fleet import contract
from relay.fleet.contract import Obj
from relay.fleet.sharding import (
    SLOT_COUNT,
    SentinelTarget,
    ShardMap,
    ShardMapError,
    SlotRange,
    is_sentinel_url,
    parse_sentinel_url,
    parse_shard_map,
)
from relayfleet_operator.redis_scripts import PRE_STOP_REDIS, START_REDIS, START_SENTINEL
from relayfleet_operator.spec import (
    API_VERSION,
    SHARD_KIND,
    Backup,
    ExternalRedis,
    ManagedRedis,
    RelayConfig,
    Resources,
    SecretKeyRef,
    ShardSpec,
)

MANAGER = "relayfleet-operator"
LABEL_FLEET = "relayfleet.dev/fleet"
LABEL_SHARD = "relayfleet.dev/shard"
LABEL_COMPONENT = "app.kubernetes.io/component"
CONFIG_HASH = "relayfleet.dev/config-hash"
SHARDMAP_KEY = contract.SHARDMAP_KEY
RELAY_PORT = 8080
REDIS_PORT = 6379
SENTINEL_PORT = 26379
SENTINELS_PER_SHARD = 3
SENTINEL_QUORUM = 2
SENTINEL_DOWN_AFTER_MS = 5000
SENTINEL_FAILOVER_TIMEOUT_MS = 30000
RELAY_UID = 10001
REDIS_UID = 999  # the uid of the `redis` user in the official images
CREDENTIALS_DIR = "/etc/relayfleet/credentials"
# managed Redis over TLS: where the Redis pod mounts its certificate Secret
REDIS_TLS_DIR = "/etc/redis-tls"
RELAY_SECRETS_DIR = "/etc/relayfleet/secrets"


# --- names -----------------------------------------------------------------------------------


def relay_name(shard: str) -> str:
    return f"relayfleet-{shard}-relay"


def redis_name(shard: str) -> str:
    return f"relayfleet-{shard}-redis"


def redis_config_name(shard: str) -> str:
    return f"relayfleet-{shard}-redis-config"


def sentinel_name(shard: str) -> str:
    return f"relayfleet-{shard}-sentinel"


def redis_ha_name(shard: str) -> str:
    """ConfigMap holding the start-up scripts of a replicated shard."""
    return f"relayfleet-{shard}-redis-ha"


def backup_name(shard: str) -> str:
    return f"relayfleet-{shard}-backup"


def shardmap_name(fleet: str) -> str:
    return contract.shardmap_configmap_name(fleet)


def fleet_service_name(fleet: str) -> str:
    return f"relayfleet-{fleet}"


def credentials_name(fleet: str) -> str:
    return f"relayfleet-{fleet}-credentials"


def relay_account_name(fleet: str) -> str:
    return f"relayfleet-{fleet}-relay"


# --- metadata --------------------------------------------------------------------------------


def labels(fleet: str, shard: str | None, component: str) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "relayfleet",
        "app.kubernetes.io/managed-by": MANAGER,
        LABEL_COMPONENT: component,
        LABEL_FLEET: fleet,
    }
    if shard is not None:
        out["app.kubernetes.io/instance"] = shard
        out[LABEL_SHARD] = shard
    return out


def relay_selector(shard: str) -> dict[str, str]:
    # Deployment selectors are immutable: keep them to labels that never change.
    return {LABEL_SHARD: shard, LABEL_COMPONENT: "relay"}


def selector_string(shard: str) -> str:
    """The scale subresource's status.selector (label selector in string form)."""
    return ",".join(f"{k}={v}" for k, v in sorted(relay_selector(shard).items()))


def owner_reference(shard: ShardSpec, controller: bool = True) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": SHARD_KIND,
        "name": shard.name,
        "uid": shard.uid,
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def fleet_owner_references(owners: Iterable[ShardSpec]) -> list[Obj]:
    """Fleet-wide objects belong to every shard of the fleet, none as controller, so the
    garbage collector removes them only when the last shard is gone."""
    return [owner_reference(s, controller=False) for s in sorted(owners, key=lambda s: s.name)]


def _meta(name: str, shard: ShardSpec, component: str, **extra: Any) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": shard.namespace,
        "labels": labels(shard.fleet, shard.name, component),
        "ownerReferences": [owner_reference(shard)],
    }
    meta.update(extra)
    return meta


def _resources(res: Resources) -> Obj:
    return {kind: dict(values) for kind, values in res.items() if values}


def _pod_security(uid: int) -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


# --- redis URLs ------------------------------------------------------------------------------


def strip_credentials(url: str) -> str:
    """The URL without user:password, safe to put in a ConfigMap or a status."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def endpoint_of(url: str) -> str:
    """host:port (or the socket path) of a Redis URL, without credentials; for a Sentinel
    URL, the service and the Sentinels (the primary is in status.redis)."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).redacted()
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or REDIS_PORT}"


def managed_redis_host(shard: ShardSpec) -> str:
    return f"{redis_name(shard.name)}.{shard.namespace}.svc"


def managed_redis_url(shard: ShardSpec, password: str | None = None, ca_pem: str | None = None) -> str:
    """URL of a managed shard's Redis; with the password only for the credentials Secret.
    With replicas it names the shard's Sentinels (a redis+sentinel:// URL, written into the
    shard map as a Sentinel entry: relay/fleet/sharding.py). With TLS the URL carries the CA
    itself (`ssl_ca_data`, read by relay/storage/connection.py and redis-py alike), so relays,
    the operator and the Spark jobs verify the shard without mounting anything."""
    managed = _managed(shard)
    if managed.sentinel:
        return SentinelTarget(
            sentinels=tuple(_split_address(a) for a in sentinel_addresses(shard)),
            service=sentinel_master_name(shard),
            password=password or None,
            min_replicas=managed.min_replicas,
        ).url()
    auth = f":{quote(password, safe='')}@" if password else ""
    base = f"{auth}{managed_redis_host(shard)}:{REDIS_PORT}/0"
    if managed.tls_secret:
        if not ca_pem or "BEGIN CERTIFICATE" not in ca_pem:
            raise ValueError(f"Secret {managed.tls_secret} must hold the CA certificate in ca.crt")
        return f"rediss://{base}?ssl_ca_data={quote(ca_pem.strip(), safe='')}"
    return f"redis://{base}"


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# --- relay ----------------------------------------------------------------------------------


def relay_env(shard: ShardSpec) -> list[Obj]:
    limits, retention = shard.limits, shard.retention
    # Names as relay/settings.py and relay/cli.py read them.
    pairs = [
        ("RELAY_FLEET", shard.fleet),
        ("RELAY_MAX_PAYLOAD", limits.max_payload_bytes),
        ("RELAY_RATE_LIMIT", limits.rate_limit_messages),
        ("RELAY_RATE_WINDOW_MS", limits.rate_limit_window_seconds * 1000),
        ("RELAY_QUEUE_MAX_MESSAGES", limits.max_queue_messages),
        ("RELAY_QUEUE_MAX_BYTES", limits.max_queue_bytes),
        ("RELAY_RETENTION_SECONDS", retention.max_age_seconds),
        ("RELAY_REDIS_CREDENTIALS_DIR", CREDENTIALS_DIR),
    ]
    relay = shard.relay
    if relay.public_url:
        pairs.append(("RELAY_PUBLIC_URL", relay.public_url))
    # Secrets reach the relay as files (RELAY_*_FILE): never as values in the pod spec, so
    # `kubectl get pod -o yaml` and env dumps show only a path.
    pairs += [(f"{env}_FILE", path) for env, _, path in _relay_secret_files(relay)]
    pairs += list(relay.env)
    return [{"name": k, "value": str(v)} for k, v in pairs]


def _relay_secret_files(relay: RelayConfig) -> list[tuple[str, SecretKeyRef, str]]:
    """(env name, Secret reference, file path) of each secret spec.relay mounts."""
    refs = [
        ("RELAY_ENQUEUE_TOKENS", "enqueue-tokens", relay.enqueue_tokens),
        ("RELAY_PUSH_WEBHOOK", "push-webhook", relay.push_webhook),
        ("RELAY_DIDCOMM_SEED", "didcomm-seed", relay.didcomm_seed),
    ]
    return [(env, ref, f"{RELAY_SECRETS_DIR}/{vol}/{vol}") for env, vol, ref in refs if ref is not None]


def _relay_secret_volumes(relay: RelayConfig) -> tuple[list[Obj], list[Obj]]:
    """One Secret volume per reference (only the referenced key, owner-readable), and its mount."""
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    for _, ref, path in _relay_secret_files(relay):
        vol = path.rsplit("/", 2)[1]
        volumes.append(
            {
                "name": vol,
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key, "path": vol}],
                    "defaultMode": 0o440,
                },
            }
        )
        mounts.append({"name": vol, "mountPath": f"{RELAY_SECRETS_DIR}/{vol}", "readOnly": True})
    return volumes, mounts


def _relay_pod_scheduling(relay: RelayConfig) -> Obj:
    """spec.relay.podTemplate's scheduling fields, as pod spec fields (absent when unset)."""
    t = relay.pod_template
    out: Obj = {}
    if t.affinity:
        out["affinity"] = dict(t.affinity)
    if t.tolerations:
        out["tolerations"] = [dict(x) for x in t.tolerations]
    if t.topology_spread_constraints:
        out["topologySpreadConstraints"] = [dict(x) for x in t.topology_spread_constraints]
    if t.node_selector:
        out["nodeSelector"] = dict(t.node_selector)
    if t.priority_class_name:
        out["priorityClassName"] = t.priority_class_name
    return out


SECRETS_HASH = "relayfleet.dev/secrets-hash"


def relay_secret_refs(shard: ShardSpec) -> list[SecretKeyRef]:
    """The Secret keys spec.relay mounts into the relay pods (the operator hashes their values)."""
    return [ref for _, ref, _ in _relay_secret_files(shard.relay)]


def secrets_hash(shard: ShardSpec, values: Sequence[bytes | None]) -> str:
    """A digest of the mounted secrets' values (None: missing), keyed by the shard's uid so the
    annotation says nothing about a value on its own. The relay reads its secrets at start: a
    changed digest changes the pod template, which rolls the relays onto the new values."""
    digest = hashlib.sha256(shard.uid.encode())
    for value in values:
        digest.update(b"\x00" if value is None else b"\x01" + hashlib.sha256(value).digest())
    return digest.hexdigest()[:16]


def relay_deployment(shard: ShardSpec, secrets_digest: str | None = None) -> Obj:
    selector = relay_selector(shard.name)
    pod_labels = {**labels(shard.fleet, shard.name, "relay"), **selector}
    secret_volumes, secret_mounts = _relay_secret_volumes(shard.relay)
    container: Obj = {
        "name": "relay",
        "image": shard.image,
        "imagePullPolicy": shard.image_pull_policy,
        "command": ["relayfleet"],
        "args": [
            "relay",
            "--host",
            "0.0.0.0",
            "--port",
            str(RELAY_PORT),
            "--shard-map-configmap",
            f"{shard.namespace}/{shardmap_name(shard.fleet)}",
        ],
        "env": relay_env(shard),
        "ports": [{"name": "http", "containerPort": RELAY_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": _resources(shard.resources),
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *secret_mounts,
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(relay_name(shard.name), shard, "relay"),
        "spec": {
            "replicas": shard.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        **shard.relay.pod_template.annotations,
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(RELAY_PORT),
                        "prometheus.io/path": "/metrics",
                        **({SECRETS_HASH: secrets_digest} if secrets_digest else {}),
                    },
                },
                "spec": {
                    "serviceAccountName": relay_account_name(shard.fleet),
                    "automountServiceAccountToken": True,  # the relay watches the shard map ConfigMap
                    "securityContext": _pod_security(RELAY_UID),
                    "terminationGracePeriodSeconds": 70,  # longer than the longest long-poll (60 s)
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "credentials",
                            "secret": {"secretName": credentials_name(shard.fleet), "optional": True},
                        },
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                        *secret_volumes,
                    ],
                    **_relay_pod_scheduling(shard.relay),
                },
            },
        },
    }


def relay_service(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(relay_name(shard.name), shard, "relay"),
        "spec": {
            "type": "ClusterIP",
            "selector": relay_selector(shard.name),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def relay_pdb(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(relay_name(shard.name), shard, "relay"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": relay_selector(shard.name)}},
    }


# --- managed redis ---------------------------------------------------------------------------


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


def redis_password_secret(shard: ShardSpec, password: str) -> Obj:
    """Created once (the handler generates the password); never rewritten afterwards."""
    if not password:
        raise ValueError("the Redis password must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(redis_name(shard.name), shard, "redis"),
        "type": "Opaque",
        "stringData": {"password": password, "auth.conf": redis_auth_conf(password)},
    }


def redis_config_map(shard: ShardSpec) -> Obj:
    managed = _managed(shard)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(redis_config_name(shard.name), shard, "redis"),
        "data": {
            "redis.conf": redis_conf(
                managed.appendfsync, managed.maxmemory_bytes, tls=managed.tls_secret is not None
            )
        },
    }


def redis_headless_service(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(redis_name(shard.name), shard, "redis"),
        "spec": {
            "clusterIP": "None",
            # Clients address the one pod by the Service name; it must resolve before Ready
            # is known so the operator can wait on it.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_SHARD: shard.name, LABEL_COMPONENT: "redis"},
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }


LABEL_REDIS_CLIENT = "relayfleet.dev/redis-client"


def redis_network_policy(shard: ShardSpec) -> Obj:
    """Only the fleet's own parts may reach a managed shard's Redis port: its relays, the
    other shards' Redis (MIGRATE connects server to server), the shard's Sentinels, the operator
    (migrations) and pods that carry the redis-client label (the Spark jobs' driver and
    executors, the backup job)."""
    fleet = shard.fleet
    peers: list[Obj] = [
        {"podSelector": {"matchLabels": {LABEL_FLEET: fleet, LABEL_COMPONENT: "relay"}}},
        {"podSelector": {"matchLabels": {LABEL_FLEET: fleet, LABEL_COMPONENT: "redis"}}},
        {"podSelector": {"matchLabels": {LABEL_FLEET: fleet, LABEL_COMPONENT: "sentinel"}}},
        {"podSelector": {"matchLabels": {LABEL_REDIS_CLIENT: "true"}}},
        {
            # the operator may run in another namespace (watchAllNamespaces)
            "namespaceSelector": {},
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "relayfleet", LABEL_COMPONENT: "operator"}
            },
        },
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(redis_name(shard.name), shard, "redis"),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_SHARD: shard.name, LABEL_COMPONENT: "redis"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}],
        },
    }


def _managed(shard: ShardSpec) -> ManagedRedis:
    if not isinstance(shard.redis, ManagedRedis):
        raise ValueError(f"RelayShard {shard.name} uses external Redis: no Redis objects to build")
    return shard.redis


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def redis_statefulset(shard: ShardSpec) -> Obj:
    managed = _managed(shard)
    name = redis_name(shard.name)
    selector = {LABEL_SHARD: shard.name, LABEL_COMPONENT: "redis"}
    conf = redis_conf(managed.appendfsync, managed.maxmemory_bytes, tls=managed.tls_secret is not None)
    password_env = {"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {"name": name, "key": "password"}}}
    claim_spec: Obj = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": managed.storage_size}},
    }
    if managed.storage_class:
        claim_spec["storageClassName"] = managed.storage_class
    tls_cli = f"--tls --cacert {REDIS_TLS_DIR}/ca.crt " if managed.tls_secret else ""
    ping = ["sh", "-c", f"redis-cli {tls_cli}-p 6379 ping | grep -q PONG"]
    sts: Obj = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, shard, "redis"),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "podManagementPolicy": "OrderedReady",
            "updateStrategy": {"type": "RollingUpdate"},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            "template": {
                "metadata": {
                    "labels": {**labels(shard.fleet, shard.name, "redis"), **selector},
                    # redis-server reads its config once: a changed config must restart the pod.
                    "annotations": {CONFIG_HASH: config_hash(conf)},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(REDIS_UID),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [
                        {
                            "name": "redis",
                            "image": managed.image,
                            "command": ["redis-server", "/etc/redis/redis.conf"],
                            "env": [password_env],
                            "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
                            "readinessProbe": {"exec": {"command": ping}, "periodSeconds": 5},
                            "livenessProbe": {
                                "tcpSocket": {"port": "redis"},
                                "periodSeconds": 10,
                                "failureThreshold": 6,
                            },
                            "resources": _resources(managed.resources),
                            "securityContext": _container_security(),
                            "volumeMounts": [
                                {"name": "data", "mountPath": "/data"},
                                {"name": "config", "mountPath": "/etc/redis", "readOnly": True},
                                # Not under /etc/redis: a read-only ConfigMap volume holds no mount point.
                                {"name": "secret", "mountPath": "/etc/redis-secret", "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "config", "configMap": {"name": redis_config_name(shard.name)}},
                        {
                            "name": "secret",
                            "secret": {
                                "secretName": name,
                                "items": [{"key": "auth.conf", "path": "auth.conf"}],
                            },
                        },
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": "data", "labels": labels(shard.fleet, shard.name, "redis")},
                    "spec": claim_spec,
                }
            ],
        },
    }
    if managed.tls_secret:
        pod = sts["spec"]["template"]["spec"]
        pod["containers"][0]["volumeMounts"].append(
            {"name": "tls", "mountPath": REDIS_TLS_DIR, "readOnly": True}
        )
        pod["volumes"].append({"name": "tls", "secret": {"secretName": managed.tls_secret}})
    return _replicated(shard, sts) if managed.sentinel else sts


# --- replicated redis: replicas and Sentinels --------------------------------------------------
#
# One group of three Sentinels per shard (docs/design-decisions.md says why not per fleet):
# it lives and dies with the shard, its config never changes when other shards come and go,
# and a Sentinel group's trouble stays inside one shard.


def sentinel_master_name(shard: ShardSpec) -> str:
    """The name the shard's Sentinels monitor it under (the shard map's "service")."""
    return shard.name


def redis_pod_host(shard: ShardSpec, ordinal: int) -> str:
    name = redis_name(shard.name)
    return f"{name}-{ordinal}.{name}.{shard.namespace}.svc"


def sentinel_addresses(shard: ShardSpec) -> list[str]:
    name = sentinel_name(shard.name)
    return [f"{name}-{i}.{name}.{shard.namespace}.svc:{SENTINEL_PORT}" for i in range(SENTINELS_PER_SHARD)]


def _spread(selector: Mapping[str, str]) -> Obj:
    """Preferred, not required, anti-affinity: spread over nodes and zones where there are
    any, yet still schedule on a cluster smaller than the group."""
    term = {"labelSelector": {"matchLabels": dict(selector)}}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": {**term, "topologyKey": "kubernetes.io/hostname"}},
                {"weight": 50, "podAffinityTerm": {**term, "topologyKey": "topology.kubernetes.io/zone"}},
            ]
        }
    }


def _ha_env(shard: ShardSpec, service: str) -> list[Obj]:
    """What the start-up scripts read (see redis_scripts.py); ANNOUNCE is the pod's DNS name."""
    ns = shard.namespace
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ANNOUNCE", "value": f"$(POD_NAME).{service}.{ns}.svc"},
        {"name": "PRIMARY0", "value": redis_pod_host(shard, 0)},
        {"name": "SENTINELS", "value": " ".join(sentinel_addresses(shard))},
        {"name": "MASTER_NAME", "value": sentinel_master_name(shard)},
        # start-redis.sh: a primary with fewer replicas than this refuses writes (see there)
        {"name": "MIN_REPLICAS", "value": str(_managed(shard).min_replicas)},
    ]


def _password_env(shard: ShardSpec) -> Obj:
    return {
        "name": "REDISCLI_AUTH",
        "valueFrom": {"secretKeyRef": {"name": redis_name(shard.name), "key": "password"}},
    }


def _script_volumes() -> list[Obj]:
    return [{"name": "run", "emptyDir": {"sizeLimit": "1Mi"}}]


def _replicated(shard: ShardSpec, sts: Obj) -> Obj:
    """The single-node StatefulSet turned into primary + replicas started by the script."""
    managed = _managed(shard)
    name = redis_name(shard.name)
    spec = sts["spec"]
    spec["replicas"] = 1 + managed.replicas
    template = spec["template"]
    template["metadata"]["annotations"][CONFIG_HASH] = config_hash(
        redis_conf(managed.appendfsync, managed.maxmemory_bytes) + START_REDIS + PRE_STOP_REDIS
    )
    pod = template["spec"]
    pod["affinity"] = _spread(spec["selector"]["matchLabels"])
    container = pod["containers"][0]
    container["command"] = ["sh", "/scripts/start-redis.sh"]
    container["env"] = [*container["env"], *_ha_env(shard, name)]
    container["lifecycle"] = {"preStop": {"exec": {"command": ["sh", "/scripts/pre-stop-redis.sh"]}}}
    container["volumeMounts"] = [
        *container["volumeMounts"],
        {"name": "scripts", "mountPath": "/scripts", "readOnly": True},
        {"name": "run", "mountPath": "/run/redis"},
    ]
    pod["volumes"] = [
        *pod["volumes"],
        {"name": "scripts", "configMap": {"name": redis_ha_name(shard.name), "defaultMode": 0o555}},
        *_script_volumes(),
    ]
    return sts


def redis_ha_config_map(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(redis_ha_name(shard.name), shard, "redis"),
        "data": {
            "start-redis.sh": START_REDIS,
            "pre-stop-redis.sh": PRE_STOP_REDIS,
            "start-sentinel.sh": START_SENTINEL,
        },
    }


def sentinel_selector(shard: ShardSpec) -> dict[str, str]:
    return {LABEL_SHARD: shard.name, LABEL_COMPONENT: "sentinel"}


def sentinel_service(shard: ShardSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(sentinel_name(shard.name), shard, "sentinel"),
        "spec": {
            "clusterIP": "None",
            # Each Sentinel is addressed by its own pod name, also before it is Ready.
            "publishNotReadyAddresses": True,
            "selector": sentinel_selector(shard),
            "ports": [
                {"name": "sentinel", "port": SENTINEL_PORT, "targetPort": "sentinel", "protocol": "TCP"}
            ],
        },
    }


def sentinel_statefulset(shard: ShardSpec) -> Obj:
    managed = _managed(shard)
    name = sentinel_name(shard.name)
    selector = sentinel_selector(shard)
    ping = ["sh", "-c", f"env -u REDISCLI_AUTH redis-cli -p {SENTINEL_PORT} ping | grep -q PONG"]
    env = [
        _password_env(shard),
        *_ha_env(shard, name),
        {"name": "QUORUM", "value": str(SENTINEL_QUORUM)},
        {"name": "DOWN_AFTER_MS", "value": str(SENTINEL_DOWN_AFTER_MS)},
        {"name": "FAILOVER_TIMEOUT_MS", "value": str(SENTINEL_FAILOVER_TIMEOUT_MS)},
        {"name": "MYID_SEED", "value": f"{shard.namespace}/$(POD_NAME)"},
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, shard, "sentinel"),
        "spec": {
            "serviceName": name,
            "replicas": SENTINELS_PER_SHARD,
            "selector": {"matchLabels": selector},
            # Sentinels do not depend on each other's order; start all three at once.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {
                    "labels": {**labels(shard.fleet, shard.name, "sentinel"), **selector},
                    "annotations": {CONFIG_HASH: config_hash(START_SENTINEL)},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(REDIS_UID),
                    "terminationGracePeriodSeconds": 10,
                    "affinity": _spread(selector),
                    "containers": [
                        {
                            "name": "sentinel",
                            "image": managed.image,
                            "command": ["sh", "/scripts/start-sentinel.sh"],
                            "env": env,
                            "ports": [
                                {"name": "sentinel", "containerPort": SENTINEL_PORT, "protocol": "TCP"}
                            ],
                            "readinessProbe": {"exec": {"command": ping}, "periodSeconds": 5},
                            "livenessProbe": {
                                "tcpSocket": {"port": "sentinel"},
                                "periodSeconds": 10,
                                "failureThreshold": 6,
                            },
                            "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}},
                            "securityContext": _container_security(),
                            "volumeMounts": [
                                {"name": "scripts", "mountPath": "/scripts", "readOnly": True},
                                {"name": "run", "mountPath": "/run/sentinel"},
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "scripts",
                            "configMap": {"name": redis_ha_name(shard.name), "defaultMode": 0o555},
                        },
                        *_script_volumes(),
                    ],
                },
            },
        },
    }


def sentinel_network_policy(shard: ShardSpec) -> Obj:
    """The Sentinel port: the same parties as the Redis port (relays and the migrator ask
    it for the primary; the shard's Redis pods ask it at start-up)."""
    policy = redis_network_policy(shard)
    policy["metadata"] = _meta(sentinel_name(shard.name), shard, "sentinel")
    policy["spec"]["podSelector"] = {"matchLabels": sentinel_selector(shard)}
    policy["spec"]["ingress"][0]["ports"] = [{"protocol": "TCP", "port": SENTINEL_PORT}]
    return policy


def _pdb(name: str, shard: ShardSpec, component: str, selector: Mapping[str, str]) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, shard, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}},
    }


def redis_pdb(shard: ShardSpec) -> Obj:
    """One Redis node down at a time (a drain never takes the primary and its last replica)."""
    return _pdb(redis_name(shard.name), shard, "redis", {LABEL_SHARD: shard.name, LABEL_COMPONENT: "redis"})


def sentinel_pdb(shard: ShardSpec) -> Obj:
    """Two of three Sentinels stay: the quorum and the failover majority both need two."""
    return _pdb(sentinel_name(shard.name), shard, "sentinel", sentinel_selector(shard))


def redis_ha_objects(shard: ShardSpec) -> list[Obj]:
    """The extra objects of a shard with replicas (none without)."""
    if not _managed(shard).sentinel:
        return []
    return [
        redis_ha_config_map(shard),
        sentinel_service(shard),
        sentinel_network_policy(shard),
        redis_pdb(shard),
        sentinel_pdb(shard),
        sentinel_statefulset(shard),
    ]


# --- backups ---------------------------------------------------------------------------------

BACKUP_DIR = "/backups"


def _backup_spec(shard: ShardSpec) -> Backup:
    if shard.backup is None:
        raise ValueError(f"RelayShard {shard.name} has no spec.backup")
    return shard.backup


def backup_claim(shard: ShardSpec) -> Obj:
    """The claim the backups live on. No owner reference: deleting the shard keeps its
    backups (they are what a restore needs after a mistake)."""
    backup = _backup_spec(shard)
    spec: Obj = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": backup.storage_size}},
    }
    if backup.storage_class:
        spec["storageClassName"] = backup.storage_class
    meta = _meta(backup_name(shard.name), shard, "backup")
    del meta["ownerReferences"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def backup_cronjob(shard: ShardSpec) -> Obj:
    """`relayfleet backup` on a schedule: a point-in-time snapshot of the shard's Redis onto
    the claim. The URL comes from the fleet's credentials Secret; for a shard with replicas
    it names the Sentinels, and the backup is taken from the primary they name."""
    backup = _backup_spec(shard)
    args = [
        "backup",
        "--redis-url-file",
        f"{CREDENTIALS_DIR}/{shard.name}",
        "--shard",
        shard.name,
        "--to",
        BACKUP_DIR,
        "--keep",
        str(backup.keep),
    ]
    pod_labels = {**labels(shard.fleet, shard.name, "backup"), LABEL_REDIS_CLIENT: "true"}
    container: Obj = {
        "name": "backup",
        "image": shard.image,
        "imagePullPolicy": shard.image_pull_policy,
        "command": ["relayfleet"],
        "args": args,
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True},
            {"name": "backups", "mountPath": BACKUP_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": _meta(backup_name(shard.name), shard, "backup"),
        "spec": {
            "schedule": backup.schedule,
            "timeZone": "Etc/UTC",
            "suspend": backup.suspend,
            # One backup at a time: the claim is ReadWriteOnce and snapshots fork the primary.
            "concurrencyPolicy": "Forbid",
            "startingDeadlineSeconds": 600,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "backoffLimit": 2,
                    "activeDeadlineSeconds": 3600,
                    "template": {
                        "metadata": {"labels": pod_labels},
                        "spec": {
                            "restartPolicy": "OnFailure",
                            "automountServiceAccountToken": False,
                            "securityContext": _pod_security(RELAY_UID),
                            "containers": [container],
                            "volumes": [
                                {
                                    "name": "credentials",
                                    "secret": {
                                        "secretName": credentials_name(shard.fleet),
                                        "items": [{"key": shard.name, "path": shard.name}],
                                    },
                                },
                                {
                                    "name": "backups",
                                    "persistentVolumeClaim": {"claimName": backup_name(shard.name)},
                                },
                                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                            ],
                        },
                    },
                },
            },
        },
    }


def backup_objects(shard: ShardSpec) -> list[Obj]:
    return [] if shard.backup is None else [backup_claim(shard), backup_cronjob(shard)]


Ref = tuple[str, str, str]  # apiVersion, kind, name


def retired_children(shard: ShardSpec) -> list[list[Ref]]:
    """Optional children the spec no longer asks for, in groups whose first member tells
    whether the group exists (one GET per group on a resync, not one DELETE per object):
    the Sentinel objects after replicas went back to 0, the backup CronJob after spec.backup
    was removed (its claim, holding the backups, stays)."""
    out: list[list[Ref]] = []
    if isinstance(shard.redis, ManagedRedis) and not shard.redis.sentinel:
        sentinel = sentinel_name(shard.name)
        out.append(
            [
                ("apps/v1", "StatefulSet", sentinel),
                ("policy/v1", "PodDisruptionBudget", sentinel),
                ("policy/v1", "PodDisruptionBudget", redis_name(shard.name)),
                ("networking.k8s.io/v1", "NetworkPolicy", sentinel),
                ("v1", "Service", sentinel),
                ("v1", "ConfigMap", redis_ha_name(shard.name)),
            ]
        )
    if shard.backup is None:
        out.append([("batch/v1", "CronJob", backup_name(shard.name))])
    return out


# --- all of one shard ------------------------------------------------------------------------


def shard_children(shard: ShardSpec, secrets_digest: str | None = None) -> list[Obj]:
    """Every object owned by one shard, in apply order (the password Secret excepted: it is
    created once by the handler, never re-applied)."""
    objs = [relay_service(shard), relay_pdb(shard), relay_deployment(shard, secrets_digest)]
    if isinstance(shard.redis, ExternalRedis):
        return objs
    return [
        redis_config_map(shard),
        redis_headless_service(shard),
        redis_network_policy(shard),
        *redis_ha_objects(shard),
        redis_statefulset(shard),
        *backup_objects(shard),
        *objs,
    ]


# --- fleet-wide objects ----------------------------------------------------------------------


def _fleet_meta(name: str, namespace: str, fleet: str, component: str, owners: Sequence[ShardSpec]) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "labels": labels(fleet, None, component)}
    if owners:
        meta["ownerReferences"] = fleet_owner_references(owners)
    return meta


def fleet_service(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    """One Service across every relay pod of the fleet: clients need not know the shards."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _fleet_meta(fleet_service_name(fleet), namespace, fleet, "fleet", owners),
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_FLEET: fleet, LABEL_COMPONENT: "relay"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def relay_service_account(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _fleet_meta(relay_account_name(fleet), namespace, fleet, "relay", owners),
    }


def relay_role(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    """Relays may read and watch their own fleet's shard map, nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _fleet_meta(relay_account_name(fleet), namespace, fleet, "relay", owners),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [shardmap_name(fleet)],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def relay_role_binding(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    name = relay_account_name(fleet)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _fleet_meta(name, namespace, fleet, "relay", owners),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }


def credentials_secret(
    namespace: str, fleet: str, urls: Mapping[str, str], owners: Sequence[ShardSpec]
) -> Obj:
    """Full Redis URLs (with passwords) per shard, mounted into relay pods as files named
    after the shards; the shard map itself carries only credential-free URLs."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _fleet_meta(credentials_name(fleet), namespace, fleet, "fleet", owners),
        "type": "Opaque",
        "stringData": dict(sorted(urls.items())),
    }


def fleet_objects(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> list[Obj]:
    return [
        relay_service_account(namespace, fleet, owners),
        relay_role(namespace, fleet, owners),
        relay_role_binding(namespace, fleet, owners),
        fleet_service(namespace, fleet, owners),
    ]


# --- the shard map ---------------------------------------------------------------------------


def initial_shard_map(fleet: str, shard: str, url: str) -> ShardMap:
    """The first shard of a fleet owns all 16384 slots."""
    return ShardMap(fleet, 1, {shard: url}, (SlotRange(0, SLOT_COUNT - 1, shard),))


def join_shard_map(current: ShardMap | None, fleet: str, shard: str, url: str) -> ShardMap:
    """The map after `shard` joins (with no slots) or changes its URL; unchanged if neither."""
    if current is None:
        return initial_shard_map(fleet, shard, url)
    if current.fleet != fleet:
        raise ShardMapError(f"shard map belongs to fleet {current.fleet!r}, not {fleet!r}")
    if current.shards.get(shard) == url:
        return current
    shards = {**current.shards, shard: url}
    return ShardMap(current.fleet, current.epoch + 1, shards, current.ranges)


def leave_shard_map(current: ShardMap, shard: str) -> ShardMap | None:
    """The map without `shard`, which must own no slots; None when no shard is left."""
    if shard not in current.shards:
        return current
    owned = current.slot_counts().get(shard, 0)
    if owned:
        raise ShardMapError(f"shard {shard!r} still owns {owned} slots; migrate them away first")
    shards = {k: v for k, v in current.shards.items() if k != shard}
    if not shards:
        return None
    return ShardMap(current.fleet, current.epoch + 1, shards, current.ranges)


def shard_map_from_configmap(cm: Mapping[str, Any] | None) -> ShardMap | None:
    if not cm:
        return None
    data = cm.get("data") or {}
    text = data.get(SHARDMAP_KEY)
    if text is None:
        raise ShardMapError(f"ConfigMap has no {SHARDMAP_KEY!r} key")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ShardMapError(f"{SHARDMAP_KEY} is not valid JSON: {exc}") from None
    return parse_shard_map(doc)


def shard_map_configmap(namespace: str, shard_map: ShardMap, owners: Sequence[ShardSpec]) -> Obj:
    # Round-trip through the validator: a map that breaks the contract never gets written.
    parse_shard_map(shard_map.to_json())
    meta = _fleet_meta(shardmap_name(shard_map.fleet), namespace, shard_map.fleet, "shardmap", owners)
    meta["annotations"] = {"relayfleet.dev/epoch": str(shard_map.epoch)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {SHARDMAP_KEY: shard_map.dumps()},
    }
