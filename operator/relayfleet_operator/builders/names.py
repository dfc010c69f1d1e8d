"""Names, labels, selectors, ports and paths that the objects share (no object built here)."""

from __future__ import annotations

from relayfleet_operator.spec import ShardSpec

MANAGER = "relayfleet-operator"
LABEL_FLEET = "relayfleet.dev/fleet"
LABEL_SHARD = "relayfleet.dev/shard"
LABEL_COMPONENT = "app.kubernetes.io/component"
CONFIG_HASH = "relayfleet.dev/config-hash"
RELAY_PORT = 8080
RELAY_SHUTDOWN_DELAY_S = 5  # a terminating relay serves this long before SIGTERM (preStop)
REDIS_PORT = 6379
SENTINEL_PORT = 26379
SENTINELS_PER_SHARD = 3
RELAY_UID = 10001
REDIS_UID = 999  # the uid of the `redis` user in the official images
CREDENTIALS_DIR = "/etc/relayfleet/credentials"
# managed Redis over TLS: where the Redis pod mounts its certificate Secret
REDIS_TLS_DIR = "/etc/redis-tls"
RELAY_SECRETS_DIR = "/etc/relayfleet/secrets"
PUSH_CREDENTIALS_DIR = f"{RELAY_SECRETS_DIR}/push-credentials"  # spec.relay.pushCredentialsSecretRef
LABEL_REDIS_CLIENT = "relayfleet.dev/redis-client"


def relay_name(shard: str) -> str:
    return f"relayfleet-{shard}-relay"


def redis_name(shard: str) -> str:
    return f"relayfleet-{shard}-redis"


def redis_claim_name(shard: str) -> str:
    """The data claim of the shard's first Redis Pod (volumeClaimTemplates "data", ordinal 0)."""
    return f"data-{redis_name(shard)}-0"


def redis_config_name(shard: str) -> str:
    return f"relayfleet-{shard}-redis-config"


def sentinel_name(shard: str) -> str:
    return f"relayfleet-{shard}-sentinel"


def redis_ha_name(shard: str) -> str:
    """ConfigMap holding the start-up scripts of a replicated shard."""
    return f"relayfleet-{shard}-redis-ha"


def backup_name(shard: str) -> str:
    return f"relayfleet-{shard}-backup"


def fleet_service_name(fleet: str) -> str:
    return f"relayfleet-{fleet}"


def credentials_name(fleet: str) -> str:
    return f"relayfleet-{fleet}-credentials"


def relay_account_name(fleet: str) -> str:
    return f"relayfleet-{fleet}-relay"


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


def redis_selector(shard: str) -> dict[str, str]:
    return {LABEL_SHARD: shard, LABEL_COMPONENT: "redis"}


def sentinel_selector(shard: ShardSpec) -> dict[str, str]:
    return {LABEL_SHARD: shard.name, LABEL_COMPONENT: "sentinel"}


def sentinel_master_name(shard: ShardSpec) -> str:
    """The name the shard's Sentinels monitor it under (the shard map's "service")."""
    return shard.name
