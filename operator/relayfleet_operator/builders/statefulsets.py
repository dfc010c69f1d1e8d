"""StatefulSets: a managed shard's Redis (one node, or primary + replicas) and its Sentinels.

One group of three Sentinels per shard (docs/design-decisions.md says why not per fleet):
it lives and dies with the shard, its config never changes when other shards come and go,
and a Sentinel group's trouble stays inside one shard.
"""

from __future__ import annotations

from collections.abc import Mapping

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import config_hash, managed_spec, shard_meta
from relayfleet_operator.builders.names import (
    CONFIG_HASH,
    REDIS_PORT,
    REDIS_TLS_DIR,
    REDIS_UID,
    SENTINEL_PORT,
    SENTINELS_PER_SHARD,
    labels,
    redis_config_name,
    redis_ha_name,
    redis_name,
    redis_selector,
    sentinel_master_name,
    sentinel_name,
    sentinel_selector,
)
from relayfleet_operator.builders.pods import (
    claim_spec,
    config_map_volume,
    container_resources,
    container_security,
    mount,
    pod_security,
    scratch_volume,
    secret_volume,
)
from relayfleet_operator.builders.redis_conf import redis_conf
from relayfleet_operator.builders.urls import redis_pod_host, sentinel_addresses
from relayfleet_operator.redis_scripts import PRE_STOP_REDIS, START_REDIS, START_SENTINEL
from relayfleet_operator.spec import ShardSpec

SENTINEL_QUORUM = 2
SENTINEL_DOWN_AFTER_MS = 5000
SENTINEL_FAILOVER_TIMEOUT_MS = 30000


def redis_statefulset(shard: ShardSpec) -> Obj:
    managed = managed_spec(shard)
    name = redis_name(shard.name)
    selector = redis_selector(shard.name)
    conf = redis_conf(managed.appendfsync, managed.maxmemory_bytes, tls=managed.tls_secret is not None)
    tls_cli = f"--tls --cacert {REDIS_TLS_DIR}/ca.crt " if managed.tls_secret else ""
    ping = ["sh", "-c", f"redis-cli {tls_cli}-p 6379 ping | grep -q PONG"]
    sts: Obj = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": shard_meta(name, shard, "redis"),
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
                    "securityContext": pod_security(REDIS_UID),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [
                        {
                            "name": "redis",
                            "image": managed.image,
                            "command": ["redis-server", "/etc/redis/redis.conf"],
                            "env": [_password_env(shard)],
                            "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
                            "readinessProbe": {"exec": {"command": ping}, "periodSeconds": 5},
                            "livenessProbe": {
                                "tcpSocket": {"port": "redis"},
                                "periodSeconds": 10,
                                "failureThreshold": 6,
                            },
                            "resources": container_resources(managed.resources),
                            "securityContext": container_security(),
                            "volumeMounts": [
                                mount("data", "/data"),
                                mount("config", "/etc/redis", read_only=True),
                                # Not under /etc/redis: a read-only ConfigMap volume holds no mount point.
                                mount("secret", "/etc/redis-secret", read_only=True),
                            ],
                        }
                    ],
                    "volumes": [
                        config_map_volume("config", redis_config_name(shard.name)),
                        secret_volume("secret", name, {"auth.conf": "auth.conf"}),
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": "data", "labels": labels(shard.fleet, shard.name, "redis")},
                    "spec": claim_spec(managed.storage_size, managed.storage_class),
                }
            ],
        },
    }
    if managed.tls_secret:
        pod = sts["spec"]["template"]["spec"]
        pod["containers"][0]["volumeMounts"].append(mount("tls", REDIS_TLS_DIR, read_only=True))
        pod["volumes"].append(secret_volume("tls", managed.tls_secret))
    return _replicated(shard, sts) if managed.sentinel else sts


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
        {"name": "MIN_REPLICAS", "value": str(managed_spec(shard).min_replicas)},
    ]


def _password_env(shard: ShardSpec) -> Obj:
    return {
        "name": "REDISCLI_AUTH",
        "valueFrom": {"secretKeyRef": {"name": redis_name(shard.name), "key": "password"}},
    }


def _script_volumes(shard: ShardSpec) -> list[Obj]:
    """The start-up scripts (executable) and the scratch space they write to."""
    return [
        config_map_volume("scripts", redis_ha_name(shard.name), mode=0o555),
        scratch_volume("run", "1Mi"),
    ]


def _replicated(shard: ShardSpec, sts: Obj) -> Obj:
    """The single-node StatefulSet turned into primary + replicas started by the script."""
    managed = managed_spec(shard)
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
        mount("scripts", "/scripts", read_only=True),
        mount("run", "/run/redis"),
    ]
    pod["volumes"] = [
        *pod["volumes"],
        *_script_volumes(shard),
    ]
    return sts


def sentinel_statefulset(shard: ShardSpec) -> Obj:
    managed = managed_spec(shard)
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
        "metadata": shard_meta(name, shard, "sentinel"),
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
                    "securityContext": pod_security(REDIS_UID),
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
                            "securityContext": container_security(),
                            "volumeMounts": [
                                mount("scripts", "/scripts", read_only=True),
                                mount("run", "/run/sentinel"),
                            ],
                        }
                    ],
                    "volumes": _script_volumes(shard),
                },
            },
        },
    }
