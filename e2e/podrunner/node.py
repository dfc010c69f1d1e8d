"""The runner's own Node: registered, kept Ready by a heartbeat (status and Lease, as a kubelet
does, since kwok does not manage it), and a PersistentVolume for every claim pending in the
namespace; all deleted again when the runner stops."""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path

from e2e.podrunner.kube import Api, now

log = logging.getLogger("e2e.podrunner")


class Node:
    def __init__(self, api: Api, namespace: str, name: str, workdir: Path) -> None:
        self.api, self.ns, self.name, self.workdir = api, namespace, name, workdir
        self.last_heartbeat = 0.0
        self.last_provision = 0.0
        self.volumes: list[str] = []

    def register(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "relayfleet.dev/e2e-podrunner": "true",
                },
            },
        }
        self.api.try_call("POST", "/api/v1/nodes", body)
        self.heartbeat(force=True)

    def heartbeat(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_heartbeat < 10:
            return
        self.last_heartbeat = time.monotonic()
        stamp = now()
        capacity = {"cpu": "32", "memory": "128Gi", "pods": "250", "ephemeral-storage": "100Gi"}
        status = {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "nodeInfo": {"kubeletVersion": "relayfleet-e2e-podrunner", "operatingSystem": "linux"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "relayfleet e2e pod runner",
                        "lastHeartbeatTime": stamp,
                        "lastTransitionTime": stamp,
                    }
                ],
            }
        }
        self.api.try_call(
            "PATCH", f"/api/v1/nodes/{self.name}/status", status, "application/strategic-merge-patch+json"
        )
        micro = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": micro},
        }
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        if self.api.merge_patch(path, {"spec": lease["spec"]}) is None:
            self.api.try_call("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def unregister(self) -> None:
        self.api.try_call("DELETE", f"/api/v1/nodes/{self.name}")
        for name in self.volumes:
            self.api.try_call("DELETE", f"/api/v1/persistentvolumes/{name}")

    def provision(self) -> None:
        """A PersistentVolume for every pending claim (the scheduler waits for bound claims);
        the pod sees it as the directory workdir/pvc/<claim>."""
        if time.monotonic() - self.last_provision < 1:
            return
        self.last_provision = time.monotonic()
        claims = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims") or {}
        for claim in claims.get("items") or []:
            name = claim["metadata"]["name"]
            pv = f"{self.ns}-{name}"[:63]
            if (claim.get("status") or {}).get("phase") != "Pending" or pv in self.volumes:
                continue
            spec = claim["spec"]
            volume = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv, "labels": {"relayfleet.dev/e2e-podrunner": self.name}},
                "spec": {
                    "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                    "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": spec.get("storageClassName") or "",
                    "hostPath": {"path": str(self.workdir / "pvc" / name)},
                    "claimRef": {"namespace": self.ns, "name": name, "uid": claim["metadata"]["uid"]},
                },
            }
            if self.api.try_call("POST", "/api/v1/persistentvolumes", volume) is not None:
                self.volumes.append(pv)
                log.info("claim %s: volume %s", name, pv)
