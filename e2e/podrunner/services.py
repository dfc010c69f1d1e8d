"""Services and endpoints, emulated: a JSON address table {"host:port": ["127.0.0.1:P", ...]}
mapping every Service name (short, namespaced, .svc, .svc.cluster.local, its clusterIP) and
port to the loopback ports of the ready pods its selector picks, and every pod IP:containerPort
to its process's port. Processes resolve through it (e2e/podenv/sitecustomize.py); it is
rewritten atomically, and only when it changed."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from e2e.podrunner.kube import Api
from e2e.podrunner.pods import RunPod


class AddressTable:
    def __init__(self, api: Api, namespace: str, path: Path) -> None:
        self.api, self.ns, self.path = api, namespace, path
        self.text = ""

    def write(self, pods: Iterable[RunPod]) -> None:
        services = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/services")
        if services is None:
            return
        table: dict[str, list[str]] = {}
        running = [p for p in pods if p.container is not None and p.phase == "Running"]
        for pod in running:
            assert pod.container is not None
            for container_port, host in pod.container.ports.items():
                if container_port.isdigit():
                    table[f"{pod.ip}:{container_port}"] = [f"127.0.0.1:{host}"]
        for svc in services.get("items") or []:
            name = svc["metadata"]["name"]
            selector = svc["spec"].get("selector") or {}
            if not selector:
                continue
            members = [
                p
                for p in running
                if p.container is not None
                and p.container.ready
                and all(p.labels.get(k) == v for k, v in selector.items())
            ]
            names = [
                name,
                f"{name}.{self.ns}",
                f"{name}.{self.ns}.svc",
                f"{name}.{self.ns}.svc.cluster.local",
            ]
            if svc["spec"].get("clusterIP") not in (None, "None"):
                names.append(svc["spec"]["clusterIP"])
            for port in svc["spec"].get("ports") or []:
                target = str(port.get("targetPort", port["port"]))
                hosts = [
                    f"127.0.0.1:{p.container.ports[target]}"
                    for p in members
                    if p.container is not None and target in p.container.ports
                ]
                if hosts:
                    for n in names:
                        table[f"{n}:{port['port']}"] = hosts
        text = json.dumps(table, sort_keys=True)
        if text != self.text:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)
            self.text = text
