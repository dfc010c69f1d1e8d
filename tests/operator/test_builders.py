"""The operator's pure builders: every child object, checked field by field without an API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from relayfleet_operator import builders
from relayfleet_operator.spec import (
    DEFAULT_NEIGHBOURS,
    DEFAULTABLE_LIMITS,
    QUOTA_ENV,
    RESERVED_RELAY_ENV,
    TRUSTED_PROXIES_ENV,
    ExternalRedis,
    ImageDefaults,
    LimitDefaults,
    ManagedRedis,
    Neighbours,
    ShardSpec,
    SpecError,
    parse_shard,
    quantity_bytes,
)
from relayfleet_testing.localredis import free_port

from relay.fleet.sharding import SLOT_COUNT, ShardMapError, parse_sentinel_url, parse_shard_map
from tests.support.shard_specs import MANAGED, shard_body

DEBIAN_REDIS = "/usr/bin/redis-server"
ROOT = Path(__file__).resolve().parents[2]


EXTERNAL = parse_shard(shard_body("b", redis={"external": {"url": "redis://:pw@10.0.0.9:6380/0"}}))


def test_parse_applies_crd_defaults() -> None:
    assert MANAGED.replicas == 2
    assert MANAGED.weight == 100
    assert isinstance(MANAGED.redis, ManagedRedis)
    assert MANAGED.redis.appendfsync == "everysec"
    assert MANAGED.redis.storage_size == "1Gi"
    assert MANAGED.retention.max_age_seconds == 7 * 86400
    assert MANAGED.limits.max_payload_bytes == 5242880
    assert isinstance(EXTERNAL.redis, ExternalRedis)


# Only what the CRD's schema cannot say is checked by parse_shard; the API server rejects the
# rest (tests/operator/test_operator_k8s.py, INVALID).
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"retention": {"maxAge": "1w"}}, "duration '1w'"),
        ({"backup": {"schedule": "0 * * *"}}, "spec.backup.schedule must be a cron schedule of 5 fields"),
        ({"backup": {"storage": {"size": "500m"}}}, "spec.backup.storage.size: quantity '500m': milli-bytes"),
        (
            {"redis": {"managed": {"storage": {"size": "1e9"}}}},
            "spec.redis.managed.storage.size: quantity '1e9'",
        ),
        ({"redis": {"managed": {"maxmemory": "2u"}}}, "quantity '2u' is not a byte size"),
    ],
)
def test_bad_specs_give_clear_errors(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_shard(shard_body(**spec))


def test_quantities() -> None:
    assert quantity_bytes("512Mi") == 512 * 2**20
    assert quantity_bytes("1G") == 10**9
    assert quantity_bytes(1024) == 1024
    with pytest.raises(SpecError):
        quantity_bytes("lots")


def _kinds(objs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in objs]


def test_managed_shard_children_and_owner_refs() -> None:
    objs = builders.shard_children(MANAGED)
    assert _kinds(objs) == [
        ("ConfigMap", "relayfleet-a-redis-config"),
        ("Service", "relayfleet-a-redis"),
        ("NetworkPolicy", "relayfleet-a-redis"),
        ("StatefulSet", "relayfleet-a-redis"),
        ("Service", "relayfleet-a-relay"),
        ("PodDisruptionBudget", "relayfleet-a-relay"),
        ("Deployment", "relayfleet-a-relay"),
    ]
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "ns1"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "relayfleet.dev/v1alpha1",
                "kind": "RelayShard",
                "name": "a",
                "uid": "uid-a",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["relayfleet.dev/fleet"] == "main"
        assert meta["labels"]["relayfleet.dev/shard"] == "a"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "relayfleet-operator"


def test_external_shard_has_no_redis_objects() -> None:
    objs = builders.shard_children(EXTERNAL)
    assert _kinds(objs) == [
        ("Service", "relayfleet-b-relay"),
        ("PodDisruptionBudget", "relayfleet-b-relay"),
        ("Deployment", "relayfleet-b-relay"),
    ]
    assert not any("redis" in o["metadata"]["name"] for o in objs)
    with pytest.raises(ValueError, match="uses external Redis"):
        builders.redis_statefulset(EXTERNAL)


def test_redis_conf_aof_and_noeviction() -> None:
    conf = builders.redis_config_map(MANAGED)["data"]["redis.conf"]
    lines = conf.splitlines()
    assert "appendonly yes" in lines
    assert "appendfsync everysec" in lines
    assert "maxmemory-policy noeviction" in lines
    assert "stream-node-max-bytes 131072" in lines  # docs/memory.md
    always = parse_shard(shard_body(redis={"managed": {"appendfsync": "always", "maxmemory": "1Gi"}}))
    lines = builders.redis_config_map(always)["data"]["redis.conf"].splitlines()
    assert "appendfsync always" in lines
    assert f"maxmemory {2**30}" in lines
    # A changed config changes the pod template, so redis-server restarts with it.
    h1 = builders.redis_statefulset(MANAGED)["spec"]["template"]["metadata"]["annotations"]
    h2 = builders.redis_statefulset(always)["spec"]["template"]["metadata"]["annotations"]
    assert h1 != h2


def test_password_secret_takes_the_password_as_input() -> None:
    secret = builders.redis_password_secret(MANAGED, "s3cret")
    assert secret["stringData"] == {"password": "s3cret", "auth.conf": 'requirepass "s3cret"\n'}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-a"
    with pytest.raises(ValueError, match="must not be empty"):
        builders.redis_password_secret(MANAGED, "")
    # The password never lands in the ConfigMap or the StatefulSet.
    assert "s3cret" not in json.dumps(builders.shard_children(MANAGED))


def test_statefulset_pvc_probes_and_security() -> None:
    sts = builders.redis_statefulset(parse_shard(shard_body(redis={"managed": {"storage": {"size": "5Gi"}}})))
    spec = sts["spec"]
    assert spec["replicas"] == 1
    assert spec["serviceName"] == "relayfleet-a-redis"
    claim = spec["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["command"] == ["redis-server", "/etc/redis/redis.conf"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"/data", "/etc/redis", "/etc/redis-secret"}
    assert pod["automountServiceAccountToken"] is False
    headless = builders.redis_headless_service(MANAGED)
    assert headless["spec"]["clusterIP"] == "None"


def test_relay_deployment() -> None:
    shard = parse_shard(
        shard_body(
            replicas=5,
            image="example/relay:1",
            resources={"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}},
            limits={"rateLimitMessages": 50, "rateLimitWindowSeconds": 10},
        )
    )
    dep = builders.relay_deployment(shard)
    assert dep["spec"]["replicas"] == 5
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "example/relay:1"
    assert container["command"] == ["relayfleet"]
    assert container["args"][0] == "relay"
    i = container["args"].index("--shard-map-configmap")
    assert container["args"][i + 1] == "ns1/relayfleet-main-shardmap"
    assert container["resources"] == {"requests": {"cpu": "250m"}, "limits": {"memory": "1Gi"}}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["RELAY_RATE_LIMIT"] == "50"
    assert env["RELAY_RATE_WINDOW_MS"] == "10000"
    assert env["RELAY_FLEET"] == "main"
    # serving on while the terminating Pod's endpoint goes, then the longest long-poll, within the grace
    delay = container["lifecycle"]["preStop"]["exec"]["command"]
    assert delay[0] == "sleep"
    assert int(delay[1]) >= 5
    assert pod["terminationGracePeriodSeconds"] > int(delay[1]) + 60
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == "relayfleet-main-relay"
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert builders.selector_string("a") == "app.kubernetes.io/component=relay,relayfleet.dev/shard=a"
    pdb = builders.relay_pdb(shard)
    assert pdb["spec"]["selector"]["matchLabels"] == selector


def test_fleet_objects_belong_to_every_shard() -> None:
    objs = builders.fleet_objects("ns1", "main", [EXTERNAL, MANAGED])
    assert _kinds(objs) == [
        ("ServiceAccount", "relayfleet-main-relay"),
        ("Role", "relayfleet-main-relay"),
        ("RoleBinding", "relayfleet-main-relay"),
        ("Service", "relayfleet-main"),
    ]
    for obj in objs:
        refs = obj["metadata"]["ownerReferences"]
        assert [r["name"] for r in refs] == ["a", "b"]
        assert not any(r["controller"] for r in refs)
    service = objs[-1]
    assert service["spec"]["selector"] == {
        "relayfleet.dev/fleet": "main",
        "app.kubernetes.io/component": "relay",
    }
    role = objs[1]
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["relayfleet-main-shardmap"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_urls_keep_credentials_out_of_the_map() -> None:
    assert builders.strip_credentials("redis://:pw@10.0.0.9:6380/0") == "redis://10.0.0.9:6380/0"
    assert builders.strip_credentials("rediss://user:pw@h:1/2") == "rediss://h:1/2"
    assert builders.endpoint_of("redis://:pw@10.0.0.9:6380/0") == "10.0.0.9:6380"
    assert builders.endpoint_of("redis://h/0") == "h:6379"
    assert builders.managed_redis_url(MANAGED) == "redis://relayfleet-a-redis.ns1.svc:6379/0"
    assert builders.managed_redis_url(MANAGED, "p/w") == "redis://:p%2Fw@relayfleet-a-redis.ns1.svc:6379/0"
    creds = builders.credentials_secret("ns1", "main", {"a": "redis://:x@h:1/0"}, [MANAGED])
    assert creds["kind"] == "Secret"
    assert creds["stringData"] == {"a": "redis://:x@h:1/0"}


def test_first_shard_gets_all_slots_new_shards_none() -> None:
    first = builders.join_shard_map(None, "main", "a", "redis://a:6379/0")
    assert first.slot_counts() == {"a": SLOT_COUNT}
    assert first.epoch == 1
    second = builders.join_shard_map(first, "main", "b", "redis://b:6379/0")
    assert second.slot_counts() == {"a": SLOT_COUNT, "b": 0}
    assert second.epoch == 2
    # Joining again with the same URL changes nothing; a new URL bumps the epoch.
    assert builders.join_shard_map(second, "main", "b", "redis://b:6379/0") is second
    moved = builders.join_shard_map(second, "main", "b", "redis://b2:6379/0")
    assert moved.epoch == 3
    assert moved.shards["b"] == "redis://b2:6379/0"
    with pytest.raises(ShardMapError, match="belongs to fleet 'main'"):
        builders.join_shard_map(second, "other", "c", "redis://c:6379/0")


def test_leaving_needs_an_empty_shard() -> None:
    m = builders.join_shard_map(
        builders.initial_shard_map("main", "a", "redis://a/0"), "main", "b", "redis://b/0"
    )
    with pytest.raises(ShardMapError, match="still owns 16384 slots"):
        builders.leave_shard_map(m, "a")
    left = builders.leave_shard_map(m, "b")
    assert left is not None
    assert list(left.shards) == ["a"]
    assert left.epoch == m.epoch + 1
    assert builders.leave_shard_map(left, "b") is left  # not a member: nothing to do


def test_shard_map_configmap_roundtrip() -> None:
    m = builders.join_shard_map(
        builders.initial_shard_map("main", "a", "redis://a:6379/0"), "main", "b", "redis://b/0"
    )
    cm = builders.shard_map_configmap("ns1", m, [MANAGED])
    assert cm["metadata"]["name"] == "relayfleet-main-shardmap"
    assert cm["metadata"]["annotations"]["relayfleet.dev/epoch"] == str(m.epoch)
    doc = json.loads(cm["data"]["shardmap.json"])
    assert doc == {
        "fleet": "main",
        "epoch": 2,
        "shards": {"a": {"redis": "redis://a:6379/0"}, "b": {"redis": "redis://b/0"}},
        "slots": [[0, 16383, "a"]],
    }
    assert parse_shard_map(doc) == m
    assert builders.shard_map_from_configmap(cm) == m
    assert builders.shard_map_from_configmap(None) is None
    with pytest.raises(ShardMapError, match="not valid JSON"):
        builders.shard_map_from_configmap({"data": {"shardmap.json": "{"}})


@pytest.mark.skipif(not os.path.exists(DEBIAN_REDIS), reason="Debian redis-server not installed")
def test_generated_redis_conf_runs_on_real_redis(tmp_path: Path) -> None:
    """The conf the StatefulSet mounts, with only its paths pointed at a temp dir."""
    (tmp_path / "auth.conf").write_text(builders.redis_auth_conf("pw-123"))
    conf = builders.redis_conf(
        "always", 64 * 2**20, data_dir=str(tmp_path), auth_include=str(tmp_path / "auth.conf")
    )
    (tmp_path / "redis.conf").write_text(conf)
    port = free_port()
    proc = subprocess.Popen(
        [DEBIAN_REDIS, str(tmp_path / "redis.conf"), "--port", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password="pw-123", decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        got = {
            k: client.config_get(k)[k]
            for k in ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory", "stream-node-max-bytes")
        }
        assert got == {
            "appendonly": "yes",
            "appendfsync": "always",
            "maxmemory-policy": "noeviction",
            "maxmemory": str(64 * 2**20),
            "stream-node-max-bytes": "131072",
        }
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        proc.terminate()
        proc.wait(10)


# --- replicas, Sentinels, backups -------------------------------------------------------------

REPLICATED = parse_shard(shard_body("r", redis={"managed": {"replicas": 2, "minReplicas": 1}}))


def test_replicas_and_min_replicas_parse() -> None:
    assert isinstance(MANAGED.redis, ManagedRedis)
    assert (MANAGED.redis.replicas, MANAGED.redis.min_replicas, MANAGED.redis.sentinel) == (0, 0, False)
    assert isinstance(REPLICATED.redis, ManagedRedis)
    assert (REPLICATED.redis.replicas, REPLICATED.redis.min_replicas, REPLICATED.redis.sentinel) == (
        2,
        1,
        True,
    )


def test_unreplicated_shard_objects_are_unchanged() -> None:
    """replicas: 0 builds exactly the single-node StatefulSet (no restart on upgrade)."""
    sts = builders.redis_statefulset(MANAGED)
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    assert "affinity" not in pod
    assert pod["containers"][0]["command"] == ["redis-server", "/etc/redis/redis.conf"]
    assert builders.redis_ha_objects(MANAGED) == []


def test_replicated_shard_builds_sentinels_pdbs_and_spread() -> None:
    objs = builders.shard_children(REPLICATED)
    kinds = _kinds(objs)
    for wanted in [
        ("ConfigMap", "relayfleet-r-redis-ha"),
        ("Service", "relayfleet-r-sentinel"),
        ("NetworkPolicy", "relayfleet-r-sentinel"),
        ("PodDisruptionBudget", "relayfleet-r-redis"),
        ("PodDisruptionBudget", "relayfleet-r-sentinel"),
        ("StatefulSet", "relayfleet-r-sentinel"),
        ("StatefulSet", "relayfleet-r-redis"),
    ]:
        assert wanted in kinds
    # the scripts' ConfigMap exists before the StatefulSets that mount it
    assert kinds.index(("ConfigMap", "relayfleet-r-redis-ha")) < kinds.index(
        ("StatefulSet", "relayfleet-r-redis")
    )
    sts = builders.redis_statefulset(REPLICATED)
    assert sts["spec"]["replicas"] == 3
    pod = sts["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert {t["podAffinityTerm"]["topologyKey"] for t in terms} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    container = pod["containers"][0]
    assert container["command"] == ["sh", "/scripts/start-redis.sh"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PRIMARY0"] == "relayfleet-r-redis-0.relayfleet-r-redis.ns1.svc"
    assert env["ANNOUNCE"] == "$(POD_NAME).relayfleet-r-redis.ns1.svc"
    assert env["MASTER_NAME"] == "r"
    assert env["MIN_REPLICAS"] == "1"  # start-redis.sh sets min-replicas-to-write from it
    assert env["SENTINELS"].split() == builders.sentinel_addresses(REPLICATED)
    assert len(env["SENTINELS"].split()) == 3
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sh", "/scripts/pre-stop-redis.sh"]
    sentinel = builders.sentinel_statefulset(REPLICATED)
    assert sentinel["spec"]["replicas"] == 3
    senv = {e["name"]: e.get("value") for e in sentinel["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert senv["QUORUM"] == "2"
    assert senv["ANNOUNCE"] == "$(POD_NAME).relayfleet-r-sentinel.ns1.svc"
    for pdb in (builders.redis_pdb(REPLICATED), builders.sentinel_pdb(REPLICATED)):
        assert pdb["spec"]["maxUnavailable"] == 1
    # Sentinels may reach the Redis port; the Sentinel port admits the same parties
    peers = builders.redis_network_policy(REPLICATED)["spec"]["ingress"][0]["from"]
    assert {
        "podSelector": {"matchLabels": {"relayfleet.dev/fleet": "main", builders.LABEL_COMPONENT: "sentinel"}}
    } in peers
    spol = builders.sentinel_network_policy(REPLICATED)
    assert spol["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 26379}]
    assert spol["spec"]["podSelector"]["matchLabels"][builders.LABEL_COMPONENT] == "sentinel"


def test_replicated_shard_url_names_its_sentinels_and_the_map_holds_an_entry() -> None:
    url = builders.managed_redis_url(REPLICATED, "pw-1")
    target = parse_sentinel_url(url)
    assert target.service == "r"
    assert target.password == "pw-1"
    assert target.min_replicas == 1
    assert [f"{h}:{p}" for h, p in target.sentinels] == builders.sentinel_addresses(REPLICATED)
    public = builders.strip_credentials(url)
    assert "pw-1" not in public
    doc = builders.initial_shard_map("main", "r", public).to_json()
    assert doc["shards"]["r"] == {
        "sentinels": builders.sentinel_addresses(REPLICATED),
        "service": "r",
        "minReplicas": 1,
    }
    assert builders.endpoint_of(url) == "sentinel r via " + ",".join(builders.sentinel_addresses(REPLICATED))


def test_retired_children_after_replicas_back_to_zero_and_no_backup() -> None:
    groups = builders.retired_children(MANAGED)
    names = [(kind, name) for group in groups for _, kind, name in group]
    assert names[0] == ("StatefulSet", "relayfleet-a-sentinel")
    assert ("CronJob", "relayfleet-a-backup") in names
    assert ("PersistentVolumeClaim", "relayfleet-a-backup") not in names
    backed = parse_shard(shard_body("r", redis={"managed": {"replicas": 1}}, backup={}))
    assert builders.retired_children(backed) == []


def test_backup_cronjob_and_claim() -> None:
    shard = parse_shard(
        shard_body(
            "r",
            redis={"managed": {"replicas": 1}},
            backup={
                "schedule": "5 */2 * * *",
                "keep": 7,
                "storage": {"size": "5Gi", "storageClassName": "slow"},
            },
        )
    )
    claim, cron = builders.backup_objects(shard)
    assert claim["kind"] == "PersistentVolumeClaim"
    assert "ownerReferences" not in claim["metadata"]  # backups outlive the shard
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["spec"]["storageClassName"] == "slow"
    assert cron["spec"]["schedule"] == "5 */2 * * *"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]
    assert pod["metadata"]["labels"][builders.LABEL_REDIS_CLIENT] == "true"
    args = pod["spec"]["containers"][0]["args"]
    assert args[:2] == ["backup", "--redis-url-file"]
    assert args[args.index("--keep") + 1] == "7"
    assert args[args.index("--redis-url-file") + 1] == "/etc/relayfleet/credentials/r"
    assert builders.backup_objects(MANAGED) == []
    with pytest.raises(SpecError, match="cron schedule"):
        parse_shard(shard_body(backup={"schedule": "hourly"}))


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj.get("spec") or {}
    if "jobTemplate" in spec:
        spec = spec["jobTemplate"]["spec"]
    return ((spec.get("template") or {}).get("spec")) or {}


@pytest.mark.parametrize("shard", [MANAGED, EXTERNAL, REPLICATED], ids=["managed", "external", "replicated"])
def test_a_reconcile_applies_each_service_account_before_the_pods_that_run_as_it(shard: ShardSpec) -> None:
    """A Deployment applied before its ServiceAccount gets a FailedCreate event from its ReplicaSet."""
    applied: set[str] = set()
    checked = 0
    for obj in builders.reconcile_objects(shard, [shard], None):
        if obj["kind"] == "ServiceAccount":
            applied.add(obj["metadata"]["name"])
        account = _pod_spec(obj).get("serviceAccountName")
        if account:
            checked += 1
            assert account in applied, (
                f"{obj['kind']}/{obj['metadata']['name']} before ServiceAccount {account}"
            )
    assert checked >= 1


def _images(shard: ShardSpec) -> dict[tuple[str, str], str]:
    """(object name, container name) -> image, for every container of the shard's children."""
    return {
        (obj["metadata"]["name"], c["name"]): c["image"]
        for obj in builders.shard_children(shard)
        for c in _pod_spec(obj).get("containers") or ()
    }


def test_images_a_shard_does_not_name_are_the_operators_configured_ones() -> None:
    configured = ImageDefaults(relay="registry.test/relay:7", redis="registry.test/redis:7")
    body = shard_body("r", redis={"managed": {"replicas": 1}}, backup={})
    images = _images(parse_shard(body, configured))
    assert images == {
        ("relayfleet-r-relay", "relay"): "registry.test/relay:7",
        ("relayfleet-r-redis", "redis"): "registry.test/redis:7",
        ("relayfleet-r-sentinel", "sentinel"): "registry.test/redis:7",
        ("relayfleet-r-backup", "backup"): "registry.test/relay:7",  # `relayfleet backup` runs in it
    }
    # an image in the spec wins over the configured one
    body["spec"].update(image="example/relay:1", redis={"managed": {"replicas": 1, "image": "redis:7.2"}})
    assert set(_images(parse_shard(body, configured)).values()) == {"example/relay:1", "redis:7.2"}
    # without configuration: this release's own images (hack/version.py stamps both)
    version = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "version.py")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert set(_images(REPLICATED).values()) == {
        f"ghcr.io/relayfleet/relayfleet:{version}",
        f"ghcr.io/relayfleet/redis:{version}",
    }


def test_quota_limits_reach_the_relay_env_only_when_given() -> None:
    """spec.limits' quota keys (issue 36) become the relay's variables; unset ones leave the
    relay's own default (no variable), and 0 (off) is passed on as given."""
    given = {
        "clientRateMessages": 200,
        "clientRateBytes": 0,
        "clientRateWindowMs": 10_000,
        "trustedProxies": ["10.0.0.0/8", "fd00::/8", "192.168.1.7"],
        "recipientMaxChannels": 16,
        "recipientMaxMessages": 20_000,
        "recipientMaxBytes": 1 << 30,
        "recipientRateLimit": 1000,
        "shardReserveFraction": 0.1,
        "shardReserveQueueBytes": 1 << 20,
        "didcommMaxKeysPerConnection": 100,
        "didcommIdleExpirySeconds": 86400,
        "didcommMaxConnectionsPerClient": 30,
    }
    env = {e["name"]: e["value"] for e in builders.relay_env(parse_shard(shard_body(limits=given)))}
    assert {k: v for k, v in env.items() if k in QUOTA_ENV.values() or k == TRUSTED_PROXIES_ENV} == {
        "RELAY_CLIENT_RATE_MESSAGES": "200",
        "RELAY_CLIENT_RATE_BYTES": "0",
        "RELAY_CLIENT_RATE_WINDOW_MS": "10000",
        "RELAY_TRUSTED_PROXIES": "10.0.0.0/8,fd00::/8,192.168.1.7/32",
        "RELAY_RECIPIENT_MAX_CHANNELS": "16",
        "RELAY_RECIPIENT_MAX_MESSAGES": "20000",
        "RELAY_RECIPIENT_MAX_BYTES": str(1 << 30),
        "RELAY_RECIPIENT_RATE_LIMIT": "1000",
        "RELAY_SHARD_RESERVE_FRACTION": "0.1",
        "RELAY_SHARD_RESERVE_QUEUE_BYTES": str(1 << 20),
        "RELAY_DIDCOMM_MAX_KEYS_PER_CONNECTION": "100",
        "RELAY_DIDCOMM_IDLE_EXPIRY_S": "86400",
        "RELAY_DIDCOMM_MAX_CONNECTIONS_PER_CLIENT": "30",
    }
    assert set(QUOTA_ENV) | {"trustedProxies"} == set(given)  # every key is exercised
    plain = {e["name"] for e in builders.relay_env(parse_shard(shard_body()))}
    assert not plain & (set(QUOTA_ENV.values()) | {TRUSTED_PROXIES_ENV})
    assert set(QUOTA_ENV.values()) | {TRUSTED_PROXIES_ENV} <= RESERVED_RELAY_ENV
    with pytest.raises(SpecError, match="trustedProxies"):
        parse_shard(shard_body(limits={"trustedProxies": ["10.0.0.0/33"]}))


def _quota_env(shard: ShardSpec) -> dict[str, str]:
    wired = set(QUOTA_ENV.values()) | {TRUSTED_PROXIES_ENV}
    return {e["name"]: e["value"] for e in builders.relay_env(shard) if e["name"] in wired}


def test_the_operators_limit_defaults_fill_only_the_keys_a_shard_leaves_out() -> None:
    """The chart's relayDefaults.limits (the operator's LimitDefaults) sit under each RelayShard's
    own spec.limits: a key the shard sets wins (even 0, even an empty trustedProxies), a key in
    neither sets no variable (the relay's own default)."""
    defaults = LimitDefaults.parse(
        {
            "clientRateMessages": 2000,
            "recipientMaxChannels": 32,
            "shardReserveFraction": 0.2,
            "trustedProxies": ["10.244.0.0/16"],
        }
    )
    # a shard that sets none of them: every default reaches its relays
    assert _quota_env(parse_shard(shard_body(), limit_defaults=defaults)) == {
        "RELAY_CLIENT_RATE_MESSAGES": "2000",
        "RELAY_RECIPIENT_MAX_CHANNELS": "32",
        "RELAY_SHARD_RESERVE_FRACTION": "0.2",
        "RELAY_TRUSTED_PROXIES": "10.244.0.0/16",
    }
    # the shard's own keys win; its other keys are added; the rest of the defaults stay
    own = {"clientRateMessages": 0, "trustedProxies": [], "recipientMaxBytes": 1 << 20}
    assert _quota_env(parse_shard(shard_body(limits=own), limit_defaults=defaults)) == {
        "RELAY_CLIENT_RATE_MESSAGES": "0",
        "RELAY_RECIPIENT_MAX_CHANNELS": "32",
        "RELAY_RECIPIENT_MAX_BYTES": str(1 << 20),
        "RELAY_SHARD_RESERVE_FRACTION": "0.2",
    }
    # no defaults and no keys: no variable at all
    assert _quota_env(parse_shard(shard_body())) == {}
    assert _quota_env(parse_shard(shard_body(), limit_defaults=LimitDefaults.parse({}))) == {}
    # the five limits with CRD defaults are the shard's own (the API server fills them): never defaulted
    assert not {"maxPayloadBytes", "rateLimitMessages"} & set(DEFAULTABLE_LIMITS)
    assert set(DEFAULTABLE_LIMITS) == set(QUOTA_ENV) | {"trustedProxies"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "not a JSON object"),
        ({"maxPayloadBytes": 1}, "'maxPayloadBytes' is not one of"),
        ({"clientRateMessages": True}, "clientRateMessages: not a non-negative integer"),
        ({"clientRateMessages": 1.5}, "clientRateMessages: not a non-negative integer"),
        ({"recipientMaxBytes": -1}, "recipientMaxBytes: not a non-negative integer"),
        ({"shardReserveFraction": "0.1"}, "shardReserveFraction: not a non-negative number"),
        ({"trustedProxies": "10.0.0.0/8"}, "trustedProxies: not a list"),
        ({"trustedProxies": ["10.0.0.0/33"]}, "trustedProxies: '10.0.0.0/33' is not a CIDR"),
    ],
)
def test_limit_defaults_refuse_what_spec_limits_would_not_hold(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LimitDefaults.parse(raw)


# --- who may reach Redis -------------------------------------------------------------------------

BACKED_UP = parse_shard(shard_body("r", redis={"managed": {"replicas": 1}}, backup={}))
NEIGHBOURS = Neighbours(
    operator_namespace="ops",
    operator_labels=(
        ("app.kubernetes.io/component", "operator"),
        ("app.kubernetes.io/instance", "rf"),
        ("app.kubernetes.io/name", "relayfleet"),
    ),
    spark_namespace="ops-rf-spark",
    spark_fleets=frozenset({(REPLICATED.namespace, REPLICATED.fleet)}),
)


def peers_of(policy: dict[str, Any]) -> list[dict[str, Any]]:
    peers: list[dict[str, Any]] = policy["spec"]["ingress"][0]["from"]
    return peers


def test_no_redis_peer_admits_pods_of_any_namespace_by_labels_alone() -> None:
    """A9: the operator's peer was `namespaceSelector: {}` with its two labels, so a Pod of ANY
    namespace carrying them reached every shard's Redis. Each peer is now either of the shard's
    own namespace (no namespaceSelector) or names one namespace by kubernetes.io/metadata.name
    (the API server sets it, nobody can relabel a namespace into it)."""
    for neighbours in (DEFAULT_NEIGHBOURS, NEIGHBOURS):
        for policy in (
            builders.redis_network_policy(REPLICATED, neighbours),
            builders.sentinel_network_policy(REPLICATED, neighbours),
        ):
            for peer in peers_of(policy):
                assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
                assert peer["podSelector"]["matchLabels"], peer  # never every Pod
                if "namespaceSelector" in peer:
                    assert peer["namespaceSelector"] == {
                        "matchLabels": {"kubernetes.io/metadata.name": peer_ns(peer)}
                    }, peer
                    assert peer_ns(peer) in (REPLICATED.namespace, "ops", "ops-rf-spark")


def peer_ns(peer: dict[str, Any]) -> str:
    ns: str = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    return ns


def test_the_operator_is_admitted_from_its_namespace_with_its_release_labels() -> None:
    peers = peers_of(builders.redis_network_policy(REPLICATED, NEIGHBOURS))
    operator = [
        p for p in peers if p["podSelector"]["matchLabels"].get(builders.LABEL_COMPONENT) == "operator"
    ]
    assert operator == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": dict(NEIGHBOURS.operator_labels)},
        }
    ]
    # without a configured namespace, the operator is looked for in the shard's own
    (default,) = [
        p
        for p in peers_of(builders.redis_network_policy(REPLICATED))
        if p["podSelector"]["matchLabels"].get(builders.LABEL_COMPONENT) == "operator"
    ]
    assert peer_ns(default) == REPLICATED.namespace


def test_spark_pods_are_admitted_from_the_spark_namespace_for_their_fleet_only() -> None:
    spark = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops-rf-spark"}},
        "podSelector": {
            "matchLabels": {"relayfleet.dev/fleet": REPLICATED.fleet, "relayfleet.dev/redis-client": "true"}
        },
    }
    assert spark in peers_of(builders.redis_network_policy(REPLICATED, NEIGHBOURS))
    assert spark in peers_of(builders.sentinel_network_policy(REPLICATED, NEIGHBOURS))
    # another fleet, or the same fleet name in another namespace: no Spark peer
    other = Neighbours(
        spark_namespace="ops-rf-spark", spark_fleets=frozenset({("elsewhere", REPLICATED.fleet)})
    )
    assert all(
        "ops-rf-spark" not in json.dumps(p)
        for p in peers_of(builders.redis_network_policy(REPLICATED, other))
    )
    # the same-namespace redis clients (the backup job) must carry the fleet's label too
    (local,) = [
        p
        for p in peers_of(builders.redis_network_policy(REPLICATED))
        if "namespaceSelector" not in p and builders.LABEL_REDIS_CLIENT in p["podSelector"]["matchLabels"]
    ]
    assert local["podSelector"]["matchLabels"][builders.LABEL_FLEET] == REPLICATED.fleet
    backup_pod = builders.backup_cronjob(BACKED_UP)["spec"]["jobTemplate"]["spec"]["template"]["metadata"]
    assert (
        local["podSelector"]["matchLabels"].items()
        <= {
            **backup_pod["labels"],
            builders.LABEL_FLEET: REPLICATED.fleet,
        }.items()
    )


def test_spark_credentials_copy_names_its_source_and_has_no_owner() -> None:
    copy = builders.spark_credentials_secret("ops-rf-spark", "ops", "main", {"a": "cmVkaXM6Ly8="})
    meta = copy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("relayfleet-main-credentials", "ops-rf-spark")
    assert meta["annotations"] == {builders.SOURCE_NAMESPACE_ANNOTATION: "ops"}
    assert "ownerReferences" not in meta  # owner references cannot cross namespaces
    assert copy["data"] == {"a": "cmVkaXM6Ly8="}
