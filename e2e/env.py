"""The e2e tests' view of a cluster: kubectl in the test namespace, and Services reached from
the test process (the pod runner's address table on kwok, `kubectl port-forward` elsewhere)."""

from __future__ import annotations

import contextlib
import json
import random
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here; conftest's pytest_plugins imports the module
    from tests.support.k8s_cluster import KubeCluster


RELEASE = "relayfleet"
FLEET = "main"


@dataclass
class Env:
    """The cluster, the test's namespace, and how to reach its Services."""

    cluster: KubeCluster
    namespace: str
    workdir: Path
    runner_addresses: Path | None  # set when the pod runner stands in for the kubelet
    forwards: dict[str, tuple[subprocess.Popen[str], int]] = field(default_factory=dict)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("-n", self.namespace, *args, check=check, input=input)

    def get(self, *what: str) -> dict[str, object] | None:
        proc = self.kubectl("get", *what, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {' '.join(what)}: {proc.stderr.strip()}")
        doc: dict[str, object] = json.loads(proc.stdout)
        return doc

    def service_url(self, service: str, port: int) -> str:
        """http://127.0.0.1:P reaching the Service (one ready endpoint, chosen per call)."""
        if self.runner_addresses is not None:
            try:
                table = json.loads(self.runner_addresses.read_text())
            except (OSError, ValueError):
                table = {}
            targets = table.get(f"{service}:{port}")
            if not targets:
                raise LookupError(f"service {service}:{port} has no ready endpoint yet")
            return f"http://{random.choice(targets)}"
        key = f"{service}:{port}"
        known = self.forwards.get(key)
        if known is None or known[0].poll() is not None:
            known = self.forwards[key] = self._port_forward(service, port)
        return f"http://127.0.0.1:{known[1]}"

    def _port_forward(self, service: str, port: int) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [
                self.cluster.tool("kubectl"),
                "--kubeconfig",
                str(self.cluster.kubeconfig),
                "-n",
                self.namespace,
                "port-forward",
                f"svc/{service}",
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
            raise LookupError(f"kubectl port-forward svc/{service} printed {line!r}")
        return proc, int(m.group(1))

    def close(self) -> None:
        for proc, _ in self.forwards.values():
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
