"""The relay Deployment: its environment, mounted Secrets, scheduling, and the digest that rolls it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from relay.fleet.contract import Obj, shardmap_configmap_name
from relayfleet_operator.builders.meta import shard_meta
from relayfleet_operator.builders.names import (
    CREDENTIALS_DIR,
    PUSH_CREDENTIALS_DIR,
    RELAY_PORT,
    RELAY_SECRETS_DIR,
    RELAY_SHUTDOWN_DELAY_S,
    RELAY_UID,
    credentials_name,
    labels,
    relay_account_name,
    relay_name,
    relay_selector,
)
from relayfleet_operator.builders.pods import (
    container_resources,
    container_security,
    mount,
    pod_security,
    scratch_volume,
    secret_volume,
)
from relayfleet_operator.spec import (
    CREDENTIALS_DIR_ENV,
    FLEET_ENV,
    PUBLIC_URL_ENV,
    PUSH_CREDENTIAL_FILES,
    PUSH_CREDENTIALS_DIR_ENV,
    QUOTA_ENV,
    RETENTION_ENV,
    TRUSTED_PROXIES_ENV,
    RelayConfig,
    SecretKeyRef,
    ShardSpec,
)


def relay_env(shard: ShardSpec) -> list[Obj]:
    limits, retention = shard.limits, shard.retention
    # Names as relay/settings.py declares them (relayfleet_operator/spec.py takes them from there).
    pairs: list[tuple[str, object]] = [
        (FLEET_ENV, shard.fleet),
        *limits.crd_defaulted_env(),
        (RETENTION_ENV, retention.max_age_seconds),
        (CREDENTIALS_DIR_ENV, CREDENTIALS_DIR),
    ]
    # the quotas given in spec.limits (the relay's defaults for the rest)
    pairs += [(QUOTA_ENV[key], value) for key, value in limits.quotas]
    if limits.trusted_proxies:
        pairs.append((TRUSTED_PROXIES_ENV, ",".join(limits.trusted_proxies)))
    relay = shard.relay
    if relay.public_url:
        pairs.append((PUBLIC_URL_ENV, relay.public_url))
    # Secrets reach the relay as files (RELAY_*_FILE): never as values in the pod spec, so
    # `kubectl get pod -o yaml` and env dumps show only a path.
    pairs += [(f"{env}_FILE", path) for env, _, path in _relay_secret_files(relay)]
    if relay.push_credentials:
        pairs.append((PUSH_CREDENTIALS_DIR_ENV, PUSH_CREDENTIALS_DIR))
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
        volumes.append(secret_volume(vol, ref.name, {ref.key: vol}, mode=0o440))
        mounts.append(mount(vol, f"{RELAY_SECRETS_DIR}/{vol}", read_only=True))
    if relay.push_credentials:  # the whole Secret: a provider's files are there or absent
        volumes.append(secret_volume("push-credentials", relay.push_credentials, mode=0o440))
        mounts.append(mount("push-credentials", PUSH_CREDENTIALS_DIR, read_only=True))
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
    refs = [ref for _, ref, _ in _relay_secret_files(shard.relay)]
    if shard.relay.push_credentials:
        refs += [SecretKeyRef(shard.relay.push_credentials, key) for key in PUSH_CREDENTIAL_FILES]
    return refs


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
            f"{shard.namespace}/{shardmap_configmap_name(shard.fleet)}",
        ],
        "env": relay_env(shard),
        "ports": [{"name": "http", "containerPort": RELAY_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        # SIGTERM only once the terminating Pod's endpoint has left kube-proxy's rules: a relay
        # that stopped accepting at once dropped connections still routed to it.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(RELAY_SHUTDOWN_DELAY_S)]}}},
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": container_resources(shard.resources),
        "securityContext": container_security(),
        "volumeMounts": [
            mount("credentials", CREDENTIALS_DIR, read_only=True),
            mount("tmp", "/tmp"),
            *secret_mounts,
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": shard_meta(relay_name(shard.name), shard, "relay"),
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
                    "securityContext": pod_security(RELAY_UID),
                    # longer than the preStop delay plus the longest long-poll (60 s)
                    "terminationGracePeriodSeconds": RELAY_SHUTDOWN_DELAY_S + 65,
                    "containers": [container],
                    "volumes": [
                        secret_volume("credentials", credentials_name(shard.fleet), optional=True),
                        scratch_volume("tmp", "64Mi"),
                        *secret_volumes,
                    ],
                    **_relay_pod_scheduling(shard.relay),
                },
            },
        },
    }
