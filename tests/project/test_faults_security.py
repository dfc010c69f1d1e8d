"""Security checks: capabilities, logs, containers, network and Redis access.

- A queue cannot be read, acked, drained, watched or inspected without a signature by
  the recipient's key (none, or another key's, gets 401 and changes nothing);
- an inbox cannot be read without its id (another id sees nothing of it);
- nothing secret reaches the logs: a relay at DEBUG level is driven through all of
  the above, then its log is grepped for payloads, inbox ids, keys and signatures;
- relay, Redis and operator containers run as non-root on read-only root filesystems;
  managed Redis requires a password;
- a NetworkPolicy lets only relay pods reach shard Redis.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml
from relayfleet_operator import builders
from relayfleet_operator.spec import parse_shard
from relayfleet_testing.localredis import LocalRedis

from relay.protocol import keypair, sign_headers
from tests.support.chart import HELM, helm
from tests.support.faults import stop_relay
from tests.support.fleet_harness import DEBIAN_REDIS, RelayProc, spawn_relay, wait_ready
from tests.support.shard_specs import MANAGED, shard_body

pytestmark = [pytest.mark.faults]
ROOT = Path(__file__).resolve().parents[2]


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _snapshot(client: redis.Redis) -> dict[bytes, bytes | None]:
    return {k: client.dump(k) for k in client.scan_iter(count=1000)}


def _start_signed_relay(workdir: Path, redis_url: str) -> RelayProc:
    """A relay with signatures on (the default; start_relay passes --auth none), logging at DEBUG."""
    return spawn_relay(["--redis-url", redis_url], workdir, {"RELAY_LOG_LEVEL": "DEBUG"}, signed=True)


async def test_queues_and_inboxes_need_their_capability_and_nothing_secret_is_logged(
    tmp_path: Path,
) -> None:
    server = LocalRedis(binary=DEBIAN_REDIS, dir=str(tmp_path / "redis")).start()
    relay = _start_signed_relay(tmp_path, server.url)
    client = redis.Redis.from_url(server.url)
    pub, priv = keypair()
    _other_pub, other_priv = keypair()
    secret_payload = b"PAYLOAD-MARKER-7f3a9c"
    inbox_id = "INBOX-ID-MARKER-51be2d"
    base = f"/v1/queues/{_b64(pub)}"
    try:
        wait_ready(relay)
        async with aiohttp.ClientSession() as http:

            async def go(
                method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
            ) -> int:
                async with http.request(method, relay.url + path, data=body, headers=headers) as resp:
                    await resp.read()
                    return resp.status

            assert await go("POST", base + "/messages", secret_payload) == 201  # enqueue is open
            guarded = [
                ("GET", base + "/messages", b""),
                ("GET", base + "/messages?wait=1", b""),
                ("POST", base + "/drain", b""),
                ("POST", base + "/ack", b'{"upToSeq": 1}'),
                ("GET", base + "/status", b""),
            ]
            before = _snapshot(client)
            for method, path, body in guarded:
                assert await go(method, path, body) == 401, (method, path)
                wrong = sign_headers(other_priv, method, path, body)
                assert await go(method, path, body, wrong) == 401, (method, path, "other key")
                garbage = {"Authorization": "Relay-Ed25519 key=" + _b64(pub) + ", ts=1, nonce=AA, sig=AA"}
                assert await go(method, path, body, garbage) == 401, (method, path, "garbage")
            for headers in ({}, sign_headers(other_priv, "GET", base + "/live", b"")):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    async with http.ws_connect(relay.url + base + "/live", headers=headers):
                        pass
                assert refused.value.status == 401, "watching a queue without its key"
            assert _snapshot(client) == before, "refused requests changed Redis"
            ok = sign_headers(priv, "GET", base + "/messages", b"")
            async with http.get(relay.url + base + "/messages", headers=ok) as resp:
                assert resp.status == 200
                doc: dict[str, Any] = await resp.json()
            assert [base64.urlsafe_b64decode(m["payload"] + "==") for m in doc["messages"]] == [
                secret_payload
            ]

            # inboxes: the id is the capability
            append = {"X-Inbox-ID": inbox_id}
            async with http.post(
                relay.url + "/v1/inbox/append",
                json={"messageId": "m1", "ciphertext": _b64(secret_payload)},
                headers=append,
            ) as resp:
                append_status = resp.status
                await resp.read()
            assert append_status == 201
            async with http.get(relay.url + "/v1/inbox/messages", headers=append) as resp:
                assert resp.status == 200
                assert len((await resp.json())["messages"]) == 1  # the right id reads it
            assert await go("GET", "/v1/inbox/messages") == 400
            async with http.get(
                relay.url + "/v1/inbox/messages", headers={"X-Inbox-ID": "someone-else"}
            ) as resp:
                assert resp.status == 200
                assert (await resp.json()).get("messages") in ([], None)
        stop_relay(relay)
        text = relay.log_path.read_text(errors="replace")
        for secret in (
            secret_payload.decode(),
            _b64(secret_payload),
            inbox_id,
            _b64(priv),
            _b64(other_priv),
            priv.hex(),
        ):
            assert secret not in text, f"a secret reached the log: {secret[:12]}..."
        assert "nonce=" not in text, "an Authorization header reached the log"
        assert "sig=" not in text, "an Authorization header reached the log"
        assert "Traceback" not in text
    finally:
        client.close()
        stop_relay(relay)
        server.stop()


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("containers", [])) + list(pod.get("initContainers", []))


def _check_pod(what: str, pod: dict[str, Any]) -> None:
    pod_sc = pod.get("securityContext") or {}
    for c in _containers(pod):
        sc = {**pod_sc, **(c.get("securityContext") or {})}
        assert sc.get("runAsNonRoot") is True, f"{what}/{c['name']}: not runAsNonRoot"
        assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, (
            f"{what}/{c['name']}: root filesystem writable"
        )


def test_relay_redis_and_operator_pods_are_non_root_and_read_only() -> None:
    managed = parse_shard(shard_body())
    _check_pod("relay", builders.relay_deployment(managed)["spec"]["template"]["spec"])
    _check_pod("redis", builders.redis_statefulset(MANAGED)["spec"]["template"]["spec"])
    if HELM is None:
        pytest.skip("helm not built")
    rendered = helm("template", "relayfleet", str(ROOT / "charts" / "relayfleet"))
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert deployments
    for d in deployments:
        _check_pod(d["metadata"]["name"], d["spec"]["template"]["spec"])
    for d in (d for d in docs if d["kind"] == "CronJob"):
        _check_pod(d["metadata"]["name"], d["spec"]["jobTemplate"]["spec"]["template"]["spec"])
    for d in (d for d in docs if d["kind"] == "Job"):  # the uninstall hook
        _check_pod(d["metadata"]["name"], d["spec"]["template"]["spec"])


def test_managed_redis_requires_a_password() -> None:
    assert "requirepass" in builders.redis_auth_conf("s3cret")
    sts = builders.redis_statefulset(MANAGED)
    mounts = {
        m["mountPath"]
        for c in _containers(sts["spec"]["template"]["spec"])
        for m in c.get("volumeMounts", [])
    }
    assert "/etc/redis-secret" in mounts  # the password comes from a Secret, never the ConfigMap


def _network_policies(shard: Any) -> list[dict[str, Any]]:
    objs = builders.shard_children(shard) + builders.fleet_objects("ns1", "main", [shard])
    return [o for o in objs if o.get("kind") == "NetworkPolicy"]


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def test_only_the_fleets_own_parts_may_reach_shard_redis() -> None:
    """Ingress to a managed shard's Redis and, when replicated, its Sentinels: its fleet's
    relays, the fleet's other Redis servers (MIGRATE connects server to server; replicas
    sync from the primary), the fleet's Sentinels (they monitor and reconfigure the Redis
    servers), the operator (migrations) and pods that carry the redis-client label (Spark
    drivers/executors, labelled by the chart) — only on the Redis / Sentinel port, and
    nothing else."""
    allowed = {
        (("app.kubernetes.io/component", "relay"), ("relayfleet.dev/fleet", "main")),
        (("app.kubernetes.io/component", "redis"), ("relayfleet.dev/fleet", "main")),
        (("app.kubernetes.io/component", "sentinel"), ("relayfleet.dev/fleet", "main")),
        (("relayfleet.dev/fleet", "main"), ("relayfleet.dev/redis-client", "true")),
        (("app.kubernetes.io/component", "operator"), ("app.kubernetes.io/name", "relayfleet")),
    }
    replicated = parse_shard(shard_body("r", redis={"managed": {"replicas": 2, "minReplicas": 1}}))
    for shard in (MANAGED, replicated):
        policies = _network_policies(shard)
        assert policies, "no NetworkPolicy for shard Redis"
        guarded = [(builders.redis_statefulset(shard), builders.REDIS_PORT)]
        if shard is replicated:
            guarded.append((builders.sentinel_statefulset(shard), builders.SENTINEL_PORT))
        for workload, port in guarded:
            sel = workload["spec"]["selector"]["matchLabels"]
            covering = [p for p in policies if sel.items() >= p["spec"]["podSelector"]["matchLabels"].items()]
            assert covering, workload["metadata"]["name"]
            for p in covering:
                assert p["spec"]["policyTypes"] == ["Ingress"]
                for rule in p["spec"]["ingress"]:
                    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
                    for peer in rule["from"]:
                        assert "ipBlock" not in peer
                        # a peer beyond the shard's namespace names ONE namespace (issue 36, A9:
                        # `namespaceSelector: {}` admitted the operator's labels from any)
                        if "namespaceSelector" in peer:
                            assert peer["namespaceSelector"] == {
                                "matchLabels": {"kubernetes.io/metadata.name": shard.namespace}
                            }, peer
                        labels = tuple(sorted(peer["podSelector"]["matchLabels"].items()))
                        assert labels in allowed, peer
    # the fleet peers select the fleet's own pods: a Sentinel and a Redis pod carry those labels
    sentinel_pod = _pod_labels(builders.sentinel_statefulset(replicated)).items()
    redis_pod = _pod_labels(builders.redis_statefulset(replicated)).items()
    assert {("app.kubernetes.io/component", "sentinel"), ("relayfleet.dev/fleet", "main")} <= sentinel_pod
    assert {("app.kubernetes.io/component", "redis"), ("relayfleet.dev/fleet", "main")} <= redis_pod
    # the chart labels the Spark pods it runs, driver and executors
    chart = (ROOT / "charts/relayfleet/templates/spark-cronjobs.yaml").read_text()
    assert 'relayfleet.dev/redis-client: "true"' in chart
    assert "spark.kubernetes.executor.label.relayfleet.dev/redis-client=true" in chart
