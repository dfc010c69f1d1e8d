"""RelayShard spec.relay on a real API server: CEL and schema reject bad values with their
message, and on the kwok cluster every field reaches the relay pods the controllers create
from the operator's Deployment (secrets as mounted files, never as env values)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.k8s_cluster import KubeCluster
from tests.support.operator_harness import (
    KwokFleet,
    apply,
    create,
    create_when_served,
    get,
    wait_for,
)
from tests.support.shard_specs import FULL_RELAY, shard

pytestmark = pytest.mark.k8s


def with_relay(**relay: Any) -> dict[str, Any]:
    return shard("x", relay=relay)


def test_full_spec_relay_is_accepted_with_defaults(kube_apiserver: KubeCluster, apiserver_ns: str) -> None:
    wait_for(
        "RelayShard to be served",
        lambda: create(kube_apiserver, apiserver_ns, shard("a", relay=FULL_RELAY)).returncode == 0,
    )
    got = get(kube_apiserver, apiserver_ns, "rshard", "a")
    assert got is not None
    relay = got["spec"]["relay"]
    assert relay["enqueueTokensSecretRef"] == {"name": "relay-tokens", "key": "tokens"}  # defaulted key
    assert relay["pushWebhookSecretRef"] == {"name": "push", "key": "endpoint"}
    assert relay["podTemplate"] == FULL_RELAY["podTemplate"]  # nothing pruned
    assert relay["env"] == FULL_RELAY["env"]


INVALID = [
    (with_relay(publicURL="relay.example.com"), "relay.publicURL must be an absolute http(s) URL"),
    (with_relay(publicURL="ftp://relay.example.com/"), "relay.publicURL must be an absolute http(s) URL"),
    (with_relay(env=[{"name": "PATH", "value": "/bin"}]), "spec.relay.env[0].name"),
    (with_relay(env=[{"name": "RELAY_FLEET", "value": "x"}]), "relay.env may not set a variable"),
    (with_relay(env=[{"name": "RELAY_ENQUEUE_TOKENS", "value": "t"}]), "relay.env may not set a variable"),
    (
        with_relay(env=[{"name": "RELAY_X", "value": "1"}, {"name": "RELAY_X", "value": "2"}]),
        "Duplicate value",
    ),
    (with_relay(enqueueTokensSecretRef={"key": "tokens"}), "spec.relay.enqueueTokensSecretRef.name"),
    (with_relay(pushWebhookSecretRef={"name": "Bad_Name"}), "spec.relay.pushWebhookSecretRef.name"),
    (
        with_relay(podTemplate={"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
        "a toleration with operator Exists takes no value",
    ),
    (
        with_relay(podTemplate={"tolerations": [{"key": "k", "effect": "Sometimes"}]}),
        "spec.relay.podTemplate.tolerations[0].effect",
    ),
    (
        with_relay(
            podTemplate={"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway"}]}
        ),
        "spec.relay.podTemplate.topologySpreadConstraints[0].topologyKey",
    ),
    (with_relay(podTemplate={"priorityClassName": "Not Valid"}), "spec.relay.podTemplate.priorityClassName"),
    (
        with_relay(podTemplate={"annotations": {"bad key!": "x"}}),
        "relay.podTemplate.annotations keys must be valid annotation names",
    ),
    (with_relay(podTemplate={"nodeSelector": {"pool": 3}}), "spec.relay.podTemplate.nodeSelector.pool"),
    (with_relay(env=[{"name": "RELAY_X", "value": 1}]), "spec.relay.env[0].value"),
    (with_relay(didcommSeedSecretRef={}), "spec.relay.didcommSeedSecretRef.name"),
    (with_relay(podTemplate={"tolerations": "all"}), "spec.relay.podTemplate.tolerations"),
    (with_relay(podTemplate={"affinity": "anywhere"}), "spec.relay.podTemplate.affinity"),
    (with_relay(podTemplate={"priorityClassName": 5}), "spec.relay.podTemplate.priorityClassName"),
]


@pytest.mark.parametrize(("doc", "message"), INVALID, ids=[m for _, m in INVALID])
def test_bad_spec_relay_is_rejected_with_its_message(
    kube_apiserver: KubeCluster, apiserver_ns: str, doc: dict[str, Any], message: str
) -> None:
    proc = create_when_served(kube_apiserver, apiserver_ns, doc)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def relay_pods(fleet: KwokFleet, name: str) -> list[dict[str, Any]]:
    pods = fleet.get("pods", "-l", f"relayfleet.dev/shard={name},app.kubernetes.io/component=relay")
    return list((pods or {}).get("items") or [])


def test_every_spec_relay_field_reaches_the_relay_pods(kwok_fleet: KwokFleet) -> None:
    fleet = kwok_fleet
    # The Priority admission plugin refuses pods naming a PriorityClass that does not exist.
    priority: dict[str, Any] = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": f"relay-critical-{fleet.ns}"},
        "value": 1000,
    }
    apply(fleet.cluster, fleet.ns, priority)
    try:
        relay: dict[str, Any] = copy.deepcopy(FULL_RELAY)
        relay["podTemplate"]["priorityClassName"] = priority["metadata"]["name"]
        tokens: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "relay-tokens"},
            "stringData": {"tokens": "tok-1"},
        }
        fleet.apply(tokens)
        fleet.redis("a")
        fleet.operator.start()
        fleet.join(fleet.external("a", relay=relay))
        pod: dict[str, Any] = wait_for(
            "a relay pod of shard a", lambda: next(iter(relay_pods(fleet, "a")), None)
        )
        spec = pod["spec"]
        container = spec["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["RELAY_PUBLIC_URL"]["value"] == "https://relay.example.com"
        assert env["RELAY_MAX_WAITERS"]["value"] == "5000"
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for var, secret in [
            ("RELAY_ENQUEUE_TOKENS_FILE", "relay-tokens"),
            ("RELAY_PUSH_WEBHOOK_FILE", "push"),
            ("RELAY_DIDCOMM_SEED_FILE", "didcomm"),
        ]:
            directory = env[var]["value"].rsplit("/", 1)[0]
            assert volumes[mounts[directory]]["secret"]["secretName"] == secret
        assert all("valueFrom" not in e for e in container["env"])
        t: dict[str, Any] = relay["podTemplate"]
        assert spec["nodeSelector"] == t["nodeSelector"]
        assert spec["priorityClassName"] == t["priorityClassName"]
        assert spec["priority"] == 1000  # admission resolved the class
        assert spec["affinity"] == t["affinity"]
        assert spec["topologySpreadConstraints"] == t["topologySpreadConstraints"]
        assert t["tolerations"][0] in spec["tolerations"]
        assert pod["metadata"]["annotations"]["example.com/team"] == "messaging"

        # A change to spec.relay rolls the pods: the new ReplicaSet's pods carry it.
        relay["env"] = [{"name": "RELAY_MAX_WAITERS", "value": "7000"}]
        fleet.apply(fleet.external("a", relay=relay))

        def rolled() -> bool:
            for p in relay_pods(fleet, "a"):
                values = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
                if values.get("RELAY_MAX_WAITERS") == "7000" and "RELAY_LOG_LEVEL" not in values:
                    return True
            return False

        wait_for("pods with the changed env", rolled)

        # Rotating a token: the operator's digest of the mounted Secrets changes, the relays roll.
        def digest() -> str | None:
            dep = fleet.get("deployment", "relayfleet-a-relay")
            value = ((dep or {})["spec"]["template"]["metadata"].get("annotations") or {}).get(
                "relayfleet.dev/secrets-hash"
            )
            return value if isinstance(value, str) else None

        before = wait_for("a secrets digest on the relay pods", digest)
        tokens["stringData"] = {"tokens": "tok-2"}
        fleet.apply(tokens)
        after = wait_for("a new secrets digest", lambda: (d := digest()) != before and d)
        assert after != before
        wait_for(
            "a relay pod with the new digest",
            lambda: any(
                (p["metadata"].get("annotations") or {}).get("relayfleet.dev/secrets-hash") == after
                for p in relay_pods(fleet, "a")
            ),
        )
    finally:
        fleet.cluster.kubectl("delete", "priorityclass", priority["metadata"]["name"], check=False)
