"""RelayShard documents for the operator tests (builders, relay config, managed TLS, faults, the
operator on a cluster) and the e2e tests."""

from __future__ import annotations

from typing import Any

from relayfleet_operator.spec import parse_shard


def shard(name: str, fleet: str = "main", **spec: Any) -> dict[str, Any]:
    """A RelayShard as a user writes it: managed Redis unless `spec` says otherwise."""
    body: dict[str, Any] = {"fleet": fleet, "redis": {"managed": {}}}
    body.update(spec)
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayShard",
        "metadata": {"name": name},
        "spec": body,
    }


def shard_body(name: str = "a", **spec: Any) -> dict[str, Any]:
    """`shard` as the operator's handlers receive it from the API server (namespace, uid, generation)."""
    doc = shard(name, **spec)
    doc["metadata"].update({"namespace": "ns1", "uid": f"uid-{name}", "generation": 3})
    return doc


MANAGED = parse_shard(shard_body())

# spec.relay with every field set
FULL_RELAY: dict[str, Any] = {
    "enqueueTokensSecretRef": {"name": "relay-tokens"},
    "pushWebhookSecretRef": {"name": "push", "key": "endpoint"},
    "didcommSeedSecretRef": {"name": "didcomm", "key": "seed"},
    "publicURL": "https://relay.example.com",
    "env": [{"name": "RELAY_MAX_WAITERS", "value": "5000"}, {"name": "RELAY_LOG_LEVEL", "value": "DEBUG"}],
    "podTemplate": {
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"relayfleet.dev/shard": "a"}},
                        },
                    }
                ]
            }
        },
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "relay", "effect": "NoSchedule"}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"relayfleet.dev/shard": "a"}},
            }
        ],
        "nodeSelector": {"pool": "relays"},
        "priorityClassName": "relay-critical",
        "annotations": {"example.com/team": "messaging", "prometheus.io/port": "9"},
    },
}
