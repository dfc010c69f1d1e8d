"""A relay the operator built from spec.relay: the chart's operator makes the Deployment, the Pod
reads its enqueue tokens from the Secret the kubelet mounts as a file, refuses an enqueue without
a token (401) and takes one with it; neither the Pod nor its log carries the tokens."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from e2e.env import Env
from e2e.probes import http_get, phase, relay_url, shard, wait_for
from relay.protocol import keypair

TOKENS = "e2e-token-one\ne2e-token-two\n"
pytestmark = pytest.mark.timeout(600)  # a shard's volume bound and images started on a real node


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status), json.loads(resp.read() or b"{}"), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def test_operator_built_relay_refuses_enqueue_without_its_token(e2e: Env) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "relay-tokens"},
        "stringData": {"tokens": TOKENS},
    }
    e2e.kubectl("apply", "-f", "-", input=json.dumps(secret))
    relay = {
        "enqueueTokensSecretRef": {"name": "relay-tokens"},
        "publicURL": "https://relay.e2e.example",
        "env": [{"name": "RELAY_MAX_WAITERS", "value": "4000"}],
    }
    e2e.kubectl("apply", "-f", "-", input=shard("t", relay=relay))
    wait_for("shard t Ready", lambda: phase(e2e, "rshard", "t") == "Ready", timeout=150)
    wait_for("fleet service ready", lambda: http_get(relay_url(e2e) + "/readyz")[0] == 200, timeout=60)

    public, _ = keypair()
    queue = base64.urlsafe_b64encode(public).rstrip(b"=").decode()
    url = relay_url(e2e) + f"/v1/queues/{queue}/messages"
    octets = {"Content-Type": "application/octet-stream"}
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "e2e-token-one"}):
        status, doc, headers = post(url, b"hello", {**octets, **auth})
        assert status == 401, (auth, status, doc)
        assert headers.get("WWW-Authenticate") == "Bearer"
        assert set(doc) == {"error", "code"}
    for token in ("e2e-token-one", "e2e-token-two"):  # both lines of the Secret count
        status, doc, _ = post(url, b"hello", {**octets, "Authorization": f"Bearer {token}"})
        assert status == 201, doc

    # The pod carries a file path, never the tokens; no log line carries them either.
    pods: Any = e2e.get("pods", "-l", "relayfleet.dev/shard=t,app.kubernetes.io/component=relay")
    pod_json = json.dumps(pods)
    assert "RELAY_ENQUEUE_TOKENS_FILE" in pod_json
    assert "e2e-token" not in pod_json
    for pod in pods["items"]:
        log = e2e.kubectl("logs", pod["metadata"]["name"], "--all-containers").stdout
        assert log.strip()  # the relay logged its start
        assert "e2e-token" not in log
