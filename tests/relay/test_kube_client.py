"""The one Kubernetes client (relay/kubeapi.py): retries with backoff on transient errors and
lists read page by page, for its blocking client (relay, `top --kube`, tests) and its asyncio
client (the operator's relayfleet_operator/kube.py).

A real API server does not throttle on demand, so the retries are shown against a tiny local
HTTP server that answers as an API server would under load (429 with Retry-After, 503, a
dropped connection) before it answers properly; pagination against the real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from relayfleet_operator.kube import Conflict, Kube, KubeError

from relay import kubeapi
from relay.retrying import KUBE_API
from tests.support.k8s_cluster import KubeCluster
from tests.support.operator_harness import namespace

CM = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "m", "namespace": "ns"},
    "data": {"a": "1"},
}
# what discovery asks before the first call of the asyncio client (its dynamic client)
DISCOVERY: dict[str, Any] = {
    "/version": {"major": "1", "minor": "36", "gitVersion": "v1.36.4"},
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            {
                "name": "configmaps",
                "singularName": "configmap",
                "namespaced": True,
                "kind": "ConfigMap",
                "verbs": ["create", "delete", "get", "list", "patch", "update"],
            }
        ],
    },
}
DROP = 0  # a scripted "status" that closes the connection without answering


@dataclass
class FlakyApiServer:
    """Answers each METHOD+path from a script of statuses (then 200 with `CM`), and records
    every request it got, with the time."""

    script: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    retry_after: str | None = "1"
    seen: list[tuple[float, str, str]] = field(default_factory=list)
    url: str = ""

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            h.rfile.read(length)
        self.seen.append((time.monotonic(), h.command, path))
        steps = self.script.get((h.command, path))
        status = steps.pop(0) if steps else 200
        if status == DROP:
            h.close_connection = True
            return
        body = DISCOVERY.get(path, CM) if status == 200 else {"kind": "Status", "code": status}
        raw = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        if status in (429, 503) and self.retry_after is not None:
            h.send_header("Retry-After", self.retry_after)
        h.end_headers()
        h.wfile.write(raw)

    def count(self, method: str, path: str) -> int:
        return sum(1 for _, m, p in self.seen if (m, p) == (method, path))


@pytest.fixture
def flaky(tmp_path: Path) -> Iterator[tuple[FlakyApiServer, str]]:
    """The server and a kubeconfig naming it."""
    server = FlakyApiServer()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            server.handle(self)

        do_PATCH = do_POST = do_PUT = do_DELETE = do_GET

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    try:
        yield server, str(kubeconfig)
    finally:
        httpd.shutdown()
        httpd.server_close()


CM_PATH = "/api/v1/namespaces/ns/configmaps/m"


def test_blocking_client_waits_retry_after_then_retries_503_and_a_dropped_connection(
    flaky: tuple[FlakyApiServer, str],
) -> None:
    server, kubeconfig = flaky
    server.script[("GET", CM_PATH)] = [429, 503, DROP]
    core = client.CoreV1Api(kubeapi.api_client(kubeconfig))
    t0 = time.monotonic()
    cm = core.read_namespaced_config_map("m", "ns")
    assert cm.data == {"a": "1"}
    assert server.count("GET", CM_PATH) == 4
    first, second = [t for t, _, p in server.seen if p == CM_PATH][:2]
    assert second - first >= 0.9, "Retry-After: 1 was not waited for"
    assert time.monotonic() - t0 < 15


def test_blocking_client_gives_up_after_its_attempts_and_does_not_retry_a_refusal(
    flaky: tuple[FlakyApiServer, str],
) -> None:
    server, kubeconfig = flaky
    server.retry_after = "0"
    server.script[("GET", CM_PATH)] = [429] * 20
    server.script[("PUT", CM_PATH)] = [409]
    core = client.CoreV1Api(kubeapi.api_client(kubeconfig))
    with pytest.raises(ApiException) as err:
        core.read_namespaced_config_map("m", "ns")
    assert err.value.status == 429
    assert server.count("GET", CM_PATH) == KUBE_API.attempts
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_config_map(
            "m", "ns", client.V1ConfigMap(metadata=client.V1ObjectMeta(name="m"))
        )
    assert err.value.status == 409
    assert server.count("PUT", CM_PATH) == 1


async def test_operator_client_retries_every_verb_on_429_503_and_dropped_connections(
    flaky: tuple[FlakyApiServer, str],
) -> None:
    """Server-side apply is a PATCH and create a POST: the asyncio client's own retry leaves
    them out, kubeapi.retrying covers them (and discovery's GETs) too."""
    server, kubeconfig = flaky
    server.script[("GET", "/api/v1")] = [503]
    server.script[("PATCH", CM_PATH)] = [429, 503, DROP]
    server.script[("POST", "/api/v1/namespaces/ns/configmaps")] = [DROP, 409]
    kube = await Kube.from_config(kubeconfig)
    try:
        t0 = time.monotonic()
        applied = await kube.apply(CM)
        assert applied["data"] == {"a": "1"}
        assert server.count("GET", "/api/v1") == 2
        assert server.count("PATCH", CM_PATH) == 4
        patches = [t for t, m, p in server.seen if (m, p) == ("PATCH", CM_PATH)]
        assert patches[1] - patches[0] >= 0.9, "Retry-After: 1 was not waited for"
        assert time.monotonic() - t0 < 15
        # a create whose answer was lost is sent again; its repeat says AlreadyExists
        with pytest.raises(Conflict):
            await kube.create(CM)
        assert server.count("POST", "/api/v1/namespaces/ns/configmaps") == 2
    finally:
        await kube.close()


async def test_operator_client_gives_up_after_its_attempts_and_does_not_retry_a_refusal(
    flaky: tuple[FlakyApiServer, str],
) -> None:
    server, kubeconfig = flaky
    server.retry_after = "0"
    server.script[("GET", CM_PATH)] = [429] * 20
    server.script[("DELETE", CM_PATH)] = [403]
    kube = await Kube.from_config(kubeconfig)
    try:
        with pytest.raises(KubeError) as err:
            await kube.get("v1", "ConfigMap", "ns", "m")
        assert err.value.status == 429
        assert server.count("GET", CM_PATH) == KUBE_API.attempts
        with pytest.raises(KubeError) as err:
            await kube.delete("v1", "ConfigMap", "ns", "m")
        assert err.value.status == 403
        assert server.count("DELETE", CM_PATH) == 1
    finally:
        await kube.close()


@pytest.mark.k8s
def test_lists_read_every_page(kube_apiserver: KubeCluster) -> None:
    """More objects than one page: both clients follow `continue` to the last one."""
    with namespace(kube_apiserver) as ns:
        names = [f"page-{i}" for i in range(7)]
        core = client.CoreV1Api(kubeapi.api_client(str(kube_apiserver.kubeconfig)))
        for name in names:
            meta = client.V1ObjectMeta(name=name, labels={"pages": "yes"})
            core.create_namespaced_config_map(ns, client.V1ConfigMap(metadata=meta))
        first = core.list_namespaced_config_map(ns, label_selector="pages=yes", limit=3)
        assert len(first.items) == 3  # the server does page
        assert first.metadata is not None
        assert first.metadata._continue
        got = kubeapi.list_all(core.list_namespaced_config_map, ns, label_selector="pages=yes", page=3)
        assert sorted(cm.metadata.name for cm in got) == names

        async def operator_list() -> list[str]:
            kube = Kube(await kubeapi.load_aio_configuration(str(kube_apiserver.kubeconfig)), page=3)
            try:
                return [o["metadata"]["name"] for o in await kube.list("v1", "ConfigMap", ns, "pages=yes")]
            finally:
                await kube.close()

        assert sorted(asyncio.run(operator_list())) == names
