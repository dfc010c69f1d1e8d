"""`relayfleet top --kube` finds a fleet's relays through a real API server.

Bare kube-apiserver (no controllers): the test writes what the operator and the endpoint
controller would — the fleet Service, a Pod whose status carries the machine's own address,
and the Service's EndpointSlice (one ready relay, one not ready). The relay is a real
`relayfleet relay` process on a real redis-server, listening on that address, so both the API
server's pod proxy (the default) and --direct reach real /metrics.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from relayfleet_testing.localredis import LocalRedis, free_port

from tests.support.k8s_cluster import KubeCluster
from tests.support.operator_harness import namespace, wait_for
from tests.support.procs import RELAYFLEET

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]


def host_address() -> str | None:
    """This machine's non-loopback IPv4 address (the route's source; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
        except OSError:
            return None
        address: str = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.fixture
def relay_on_host(redis_server: LocalRedis, tmp_path: Path) -> Iterator[tuple[str, int]]:
    address = host_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address: the API server cannot proxy to a loopback pod IP")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = (tmp_path / "relay.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relay",
            "--host",
            address,
            "--port",
            str(port),
            "--redis-url",
            redis_server.url,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://{address}:{port}/readyz", timeout=1) as r:
                    return bool(r.status == 200)
            except OSError:
                if proc.poll() is not None:
                    pytest.fail((tmp_path / "relay.log").read_text())
                return False

        wait_for("the relay", ready, timeout=30)
        yield address, port
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def fleet_objects(ns: str, fleet: str, address: str, port: int) -> list[dict[str, Any]]:
    labels = {
        "app.kubernetes.io/name": "relayfleet",
        "app.kubernetes.io/managed-by": "relayfleet-operator",
        "app.kubernetes.io/component": "fleet",
        "relayfleet.dev/fleet": fleet,
    }
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"relayfleet-{fleet}", "labels": labels},
        "spec": {
            "selector": {"relayfleet.dev/fleet": fleet, "app.kubernetes.io/component": "relay"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }
    pod = f"relayfleet-{fleet}-relay-0"
    slice_: dict[str, Any] = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"relayfleet-{fleet}-x1",
            "labels": {
                "kubernetes.io/service-name": f"relayfleet-{fleet}",
                "endpointslice.kubernetes.io/managed-by": "test",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": ns},
            },
            # A relay that is not ready (e.g. starting) is left out.
            {"addresses": ["192.0.2.250"], "conditions": {"ready": False}},
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }
    return [service, slice_]


def top(cluster: KubeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RELAYFLEET, "top", "--kube",
         "--kubeconfig", str(cluster.kubeconfig), "--once", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip


def test_top_kube_finds_the_relays_of_a_fleet(
    kube_apiserver: KubeCluster, relay_on_host: tuple[str, int]
) -> None:
    address, port = relay_on_host
    with namespace(kube_apiserver) as ns:
        docs = fleet_objects(ns, "main", address, port) + fleet_objects(ns, "blue", "192.0.2.251", port)
        kube_apiserver.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump_all(docs))
        # The Pod the slice points at: the API server proxies to its status.podIP.
        pod_name = "relayfleet-main-relay-0"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name},
            "spec": {
                "containers": [{"name": "relay", "image": "relayfleet", "ports": [{"containerPort": port}]}]
            },
        }
        # No controller-manager on a bare API server: the namespace's default account is ours to make.
        kube_apiserver.kubectl("-n", ns, "create", "serviceaccount", "default", check=False)
        kube_apiserver.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod))
        status = {"status": {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}]}}
        kube_apiserver.kubectl(
            "-n",
            ns,
            "patch",
            "pod",
            pod_name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )

        # Through the API server's pod proxy (the default), one fleet.
        t0 = time.monotonic()
        proc = top(kube_apiserver, "--namespace", ns, "--fleet", "main")
        elapsed = time.monotonic() - t0
        assert proc.returncode == 0, proc.stderr
        assert "1/1 relays answering" in proc.stdout, proc.stdout
        assert f"pod/{pod_name}:{port}" in proc.stdout
        assert "192.0.2.250" not in proc.stdout
        print(f"top --kube --once via the pod proxy: {elapsed:.2f}s")

        # --direct: the endpoint address itself.
        proc = top(kube_apiserver, "--namespace", ns, "--fleet", "main", "--direct")
        assert proc.returncode == 0, proc.stderr
        assert f"http://{address}:{port}" in proc.stdout
        assert "1/1 relays answering" in proc.stdout

        # Every fleet of the namespace: blue's relay address answers nothing, and says so.
        proc = top(kube_apiserver, "--namespace", ns, "--direct")
        assert "1/2 relays answering" in proc.stdout, proc.stdout

        # A fleet with no Service: nothing to show, exit 1 with one line.
        proc = top(kube_apiserver, "--namespace", ns, "--fleet", "nope")
        assert proc.returncode == 1
        assert proc.stderr.strip() == "relayfleet top: the Kubernetes API lists no relay"
