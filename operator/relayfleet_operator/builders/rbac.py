"""The relays' ServiceAccount, Role and RoleBinding (read and watch their fleet's shard map)."""

from __future__ import annotations

from collections.abc import Sequence

from relay.fleet.contract import Obj, shardmap_configmap_name
from relayfleet_operator.builders.meta import fleet_meta
from relayfleet_operator.builders.names import relay_account_name
from relayfleet_operator.spec import ShardSpec


def relay_service_account(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": fleet_meta(relay_account_name(fleet), namespace, fleet, "relay", owners),
    }


def relay_role(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    """Relays may read and watch their own fleet's shard map, nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": fleet_meta(relay_account_name(fleet), namespace, fleet, "relay", owners),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [shardmap_configmap_name(fleet)],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def relay_role_binding(namespace: str, fleet: str, owners: Sequence[ShardSpec]) -> Obj:
    name = relay_account_name(fleet)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": fleet_meta(name, namespace, fleet, "relay", owners),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
