"""RelayShard documents for the operator tests (builders, relay config, managed TLS, faults)."""

from __future__ import annotations

from typing import Any

from relayfleet_operator.spec import parse_shard


def shard_body(name: str = "a", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"fleet": "main", "redis": {"managed": {}}}
    base.update(spec)
    return {
        "apiVersion": "relayfleet.dev/v1alpha1",
        "kind": "RelayShard",
        "metadata": {"name": name, "namespace": "ns1", "uid": f"uid-{name}", "generation": 3},
        "spec": base,
    }


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
