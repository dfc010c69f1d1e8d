"""The e2e tests' view of a cluster: kubectl in the test namespace, and Services and Pods reached
from the test process.

A Service is reached at its ClusterIP when the test process can route to it (the single-node
cluster of `make cluster`: the host is the node, kube-proxy's rules apply to it), so every request
goes through kube-proxy and spreads over the ready endpoints as a client's would. Elsewhere (kind
on a laptop) through `kubectl port-forward`, which pins one Pod per forward.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only a type here; conftest's pytest_plugins imports the module
    from tests.support.k8s_cluster import KubeCluster


RELEASE = "relayfleet"
FLEET = "main"
# "clusterip", "port-forward", or unset: the ClusterIP when it answers, else a port-forward.
SERVICE_ACCESS_ENV = "RELAYFLEET_E2E_SERVICE_ACCESS"


@dataclass
class Env:
    """The cluster, the test's namespace, and how to reach its Services."""

    cluster: KubeCluster
    namespace: str
    workdir: Path
    forwards: dict[str, tuple[subprocess.Popen[str], int]] = field(default_factory=dict)
    direct: dict[str, bool] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    forwarded: set[str] = field(default_factory=set)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("-n", self.namespace, *args, check=check, input=input, timeout=timeout)

    @property
    def spark_namespace(self) -> str:
        """The chart's default Spark namespace for this release: <namespace>-<fullname>-spark."""
        return f"{self.namespace}-{RELEASE}-spark"

    def spark(self) -> Env:
        """The same cluster, in the Spark jobs' namespace (CronJobs, driver and executor Pods)."""
        return Env(self.cluster, self.spark_namespace, self.workdir / "spark")

    def get(self, *what: str) -> dict[str, Any] | None:
        proc = self.kubectl("get", *what, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {' '.join(what)}: {proc.stderr.strip()}")
        doc: dict[str, Any] = json.loads(proc.stdout)
        return doc

    def pods(self, selector: str) -> list[dict[str, Any]]:
        doc = self.get("pods", "-l", selector)
        return [] if doc is None else list(doc["items"])

    def service_url(self, service: str, port: int) -> str:
        """http://HOST:PORT reaching the Service: its ClusterIP, else a port-forward (looked up
        once per Service: the workload asks per request)."""
        key = f"{service}:{port}"
        if key in self.urls:
            return self.urls[key]
        if key in self.forwarded:
            return f"http://127.0.0.1:{self.forward(f'svc/{service}', port)}"
        svc = self.get("service", service)
        if svc is None:
            raise LookupError(f"service {service} does not exist yet")
        ip = svc["spec"].get("clusterIP") or ""
        mode = os.environ.get(SERVICE_ACCESS_ENV, "")
        if mode != "port-forward" and ip and ip != "None" and (mode == "clusterip" or self._routable()):
            self.urls[key] = f"http://{ip}:{port}"
            return self.urls[key]
        self.forwarded.add(key)
        return f"http://127.0.0.1:{self.forward(f'svc/{service}', port)}"

    def _routable(self) -> bool:
        """Whether this process reaches ClusterIPs: asked once, of the `kubernetes` Service,
        which always has an endpoint."""
        known = self.direct.get("clusterip")
        if known is None:
            ip = self.cluster.kubectl(
                "-n", "default", "get", "service", "kubernetes", "-o", "jsonpath={.spec.clusterIP}"
            ).stdout.strip()
            try:
                with socket.create_connection((ip, 443), timeout=3):
                    known = True
            except OSError:
                known = False
            self.direct["clusterip"] = known
        return known

    def pod_address(self, pod: str, port: int) -> tuple[str, int]:
        """(host, port) reaching `pod`'s port: its Pod IP where Services are routable (the
        node's own network), else a port-forward."""
        if os.environ.get(SERVICE_ACCESS_ENV) != "port-forward" and self._routable():
            doc = self.get("pod", pod)
            ip = ((doc or {}).get("status") or {}).get("podIP")
            if not ip:
                raise LookupError(f"pod {pod} has no IP yet")
            return ip, port
        return "127.0.0.1", self.forward(f"pod/{pod}", port)

    def forward(self, target: str, port: int) -> int:
        """A local port forwarded to `target` (svc/NAME or pod/NAME) port `port`, kept while it lives."""
        key = f"{target}:{port}"
        known = self.forwards.get(key)
        if known is None or known[0].poll() is not None:
            known = self.forwards[key] = self._port_forward(target, port)
        return known[1]

    def _port_forward(self, target: str, port: int) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [
                self.cluster.tool("kubectl"),
                "--kubeconfig",
                str(self.cluster.kubeconfig),
                "-n",
                self.namespace,
                "port-forward",
                "--address=127.0.0.1",
                target,
                f":{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not m:
            proc.kill()
            proc.wait(5)
            raise LookupError(f"kubectl port-forward {target} printed {line!r}")
        return proc, int(m.group(1))

    def secret_value(self, name: str, key: str) -> str:
        doc = self.get("secret", name)
        if doc is None or key not in (doc.get("data") or {}):
            raise LookupError(f"secret {name} has no key {key} yet")
        return base64.b64decode(doc["data"][key]).decode()

    def save_diagnostics(self) -> Path:
        """What a person debugging a failed run looks at first, written into the workdir."""
        out = self.workdir / "cluster"
        out.mkdir(parents=True, exist_ok=True)
        for name, args in {
            "pods.txt": ("get", "pods", "-o", "wide"),
            "all.txt": ("get", "all,pvc,rshard,rrebalance,cm,secret", "-o", "wide"),
            "events.txt": ("get", "events", "--sort-by=.lastTimestamp"),
            "rshards.yaml": ("get", "rshard,rrebalance", "-o", "yaml"),
        }.items():
            done = self.kubectl(*args, check=False)
            (out / name).write_text(done.stdout + done.stderr)
        pods = self.get("pods") or {"items": []}
        for pod in pods["items"]:
            pname = pod["metadata"]["name"]
            for c in pod["spec"]["containers"]:
                for previous in ("", "--previous"):
                    done = self.kubectl(
                        "logs", pname, "-c", c["name"], *([previous] if previous else []), check=False
                    )
                    if done.stdout:
                        (out / f"{pname}.{c['name']}{previous.replace('--', '.')}.log").write_text(
                            done.stdout
                        )
        if not self.namespace.endswith("-spark"):
            with contextlib.suppress(Exception):
                self.spark().save_diagnostics()
        nodes = self.cluster.kubectl("describe", "nodes", check=False)
        (out / "nodes.txt").write_text(nodes.stdout + nodes.stderr)
        return out

    def close(self) -> None:
        for proc, _ in self.forwards.values():
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self.forwards.clear()
