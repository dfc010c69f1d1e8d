"""Pure builders: every Kubernetes object the operator owns, as plain dicts.

No I/O here: given a ShardSpec (and, where needed, a password or a shard map), each
function returns the full desired object, ready for server-side apply. Handlers stay
thin and tests can check every field without an API server.

One module per object kind (the layout of CloudNativePG's `pkg/specs`); this package
exposes them all, so callers write `builders.relay_deployment(shard)`:

- names            object names, labels, selectors, ports and paths
- meta             owner references, object metadata, config digest, the managed-Redis spec
- urls             a shard's Redis URL and addresses (credentials Secret, shard map, status)
- redis_conf       redis.conf text and the password include file
- pods             pod-spec pieces: security contexts, resources, volumes, mounts, claims
- deployments      the relay Deployment (env, mounted Secrets, scheduling, secrets digest)
- services, statefulsets, configmaps, secrets, network_policies, pdbs, rbac
                   one Kubernetes kind each
- backup           the backup claim and CronJob
- rebalances       the RelayRebalance a new shard proposes (spec.autoRebalance)
- shardmap         shard-map arithmetic (first map, join, leave) and reading its ConfigMap
- children         what one shard / one fleet owns, in apply order; what a spec retires
"""

from __future__ import annotations

from relayfleet_operator.builders.backup import BACKUP_DIR, backup_claim, backup_cronjob
from relayfleet_operator.builders.children import (
    Ref,
    backup_objects,
    fleet_objects,
    reconcile_objects,
    redis_ha_objects,
    retired_children,
    shard_children,
)
from relayfleet_operator.builders.configmaps import redis_config_map, redis_ha_config_map, shard_map_configmap
from relayfleet_operator.builders.deployments import (
    SECRETS_HASH,
    relay_deployment,
    relay_env,
    relay_secret_refs,
    secrets_hash,
)
from relayfleet_operator.builders.meta import config_hash, fleet_owner_references, owner_reference
from relayfleet_operator.builders.names import (
    CONFIG_HASH,
    CREDENTIALS_DIR,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_REDIS_CLIENT,
    LABEL_SHARD,
    MANAGER,
    REDIS_PORT,
    REDIS_TLS_DIR,
    REDIS_UID,
    RELAY_PORT,
    RELAY_SECRETS_DIR,
    RELAY_UID,
    SENTINEL_PORT,
    SENTINELS_PER_SHARD,
    backup_name,
    credentials_name,
    fleet_service_name,
    labels,
    redis_claim_name,
    redis_config_name,
    redis_ha_name,
    redis_name,
    redis_selector,
    relay_account_name,
    relay_name,
    relay_selector,
    selector_string,
    sentinel_master_name,
    sentinel_name,
    sentinel_selector,
)
from relayfleet_operator.builders.network_policies import redis_network_policy, sentinel_network_policy
from relayfleet_operator.builders.pdbs import redis_pdb, relay_pdb, sentinel_pdb
from relayfleet_operator.builders.rbac import relay_role, relay_role_binding, relay_service_account
from relayfleet_operator.builders.rebalances import join_rebalance, join_rebalance_name
from relayfleet_operator.builders.redis_conf import redis_auth_conf, redis_conf
from relayfleet_operator.builders.secrets import (
    SOURCE_NAMESPACE_ANNOTATION,
    credentials_secret,
    redis_password_secret,
    spark_credentials_secret,
)
from relayfleet_operator.builders.services import (
    fleet_service,
    redis_headless_service,
    relay_service,
    sentinel_service,
)
from relayfleet_operator.builders.shardmap import (
    initial_shard_map,
    join_shard_map,
    leave_shard_map,
    shard_map_from_configmap,
)
from relayfleet_operator.builders.statefulsets import (
    SENTINEL_DOWN_AFTER_MS,
    SENTINEL_FAILOVER_TIMEOUT_MS,
    SENTINEL_QUORUM,
    redis_statefulset,
    sentinel_statefulset,
)
from relayfleet_operator.builders.urls import (
    endpoint_of,
    managed_redis_host,
    managed_redis_url,
    redis_pod_host,
    sentinel_addresses,
    strip_credentials,
)

__all__ = [
    "BACKUP_DIR",
    "CONFIG_HASH",
    "CREDENTIALS_DIR",
    "LABEL_COMPONENT",
    "LABEL_FLEET",
    "LABEL_REDIS_CLIENT",
    "LABEL_SHARD",
    "MANAGER",
    "REDIS_PORT",
    "REDIS_TLS_DIR",
    "REDIS_UID",
    "RELAY_PORT",
    "RELAY_SECRETS_DIR",
    "RELAY_UID",
    "SECRETS_HASH",
    "SENTINELS_PER_SHARD",
    "SENTINEL_DOWN_AFTER_MS",
    "SENTINEL_FAILOVER_TIMEOUT_MS",
    "SENTINEL_PORT",
    "SENTINEL_QUORUM",
    "SOURCE_NAMESPACE_ANNOTATION",
    "Ref",
    "backup_claim",
    "backup_cronjob",
    "backup_name",
    "backup_objects",
    "config_hash",
    "credentials_name",
    "credentials_secret",
    "endpoint_of",
    "fleet_objects",
    "fleet_owner_references",
    "fleet_service",
    "fleet_service_name",
    "initial_shard_map",
    "join_rebalance",
    "join_rebalance_name",
    "join_shard_map",
    "labels",
    "leave_shard_map",
    "managed_redis_host",
    "managed_redis_url",
    "owner_reference",
    "reconcile_objects",
    "redis_auth_conf",
    "redis_claim_name",
    "redis_conf",
    "redis_config_map",
    "redis_config_name",
    "redis_ha_config_map",
    "redis_ha_name",
    "redis_ha_objects",
    "redis_headless_service",
    "redis_name",
    "redis_network_policy",
    "redis_password_secret",
    "redis_pdb",
    "redis_pod_host",
    "redis_selector",
    "redis_statefulset",
    "relay_account_name",
    "relay_deployment",
    "relay_env",
    "relay_name",
    "relay_pdb",
    "relay_role",
    "relay_role_binding",
    "relay_secret_refs",
    "relay_selector",
    "relay_service",
    "relay_service_account",
    "retired_children",
    "secrets_hash",
    "selector_string",
    "sentinel_addresses",
    "sentinel_master_name",
    "sentinel_name",
    "sentinel_network_policy",
    "sentinel_pdb",
    "sentinel_selector",
    "sentinel_service",
    "sentinel_statefulset",
    "shard_children",
    "shard_map_configmap",
    "shard_map_from_configmap",
    "spark_credentials_secret",
    "strip_credentials",
]
