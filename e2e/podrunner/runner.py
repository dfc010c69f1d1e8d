"""The runner's loop: every LOOP_S, the node's heartbeat, the pods bound to it listed and synced
(admitted and started, supervised, reported, killed when deleted or gone), volumes provisioned
and refreshed, and the address table rewritten."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from e2e.podrunner import status, supervisor
from e2e.podrunner.kube import Api
from e2e.podrunner.node import Node
from e2e.podrunner.pods import RunnerError, RunPod
from e2e.podrunner.services import AddressTable
from e2e.podrunner.translate import Translator
from e2e.podrunner.volumes import Volumes
from relay.fleet.contract import Obj

log = logging.getLogger("e2e.podrunner")

LOOP_S = 0.5


class Runner:
    def __init__(self, api: Api, namespace: str, node: str, workdir: Path) -> None:
        self.api, self.ns, self.workdir = api, namespace, workdir
        self.pods: dict[str, RunPod] = {}
        self.ip_seq = 0
        self.last_refresh = 0.0
        self.stopping = False
        self.node = Node(api, namespace, node, workdir)
        self.volumes = Volumes(api, namespace, workdir)
        self.addresses = AddressTable(api, namespace, workdir / "addresses.json")
        self.translator = Translator(api, namespace, node, self.addresses.path)

    def run(self) -> None:
        self.node.register()
        while not self.stopping:
            self.node.heartbeat()
            listed = self.api.try_call(
                "GET", f"/api/v1/namespaces/{self.ns}/pods?fieldSelector=spec.nodeName%3D{self.node.name}"
            )
            self.node.provision()
            if listed is not None:
                self.sync(listed.get("items") or [])
                self.addresses.write(self.pods.values())
            time.sleep(LOOP_S)
        for pod in list(self.pods.values()):
            supervisor.kill(pod, grace=5)

    def sync(self, items: list[Obj]) -> None:
        seen = set()
        refresh = time.monotonic() - self.last_refresh > 2
        if refresh:
            self.last_refresh = time.monotonic()
        for item in items:
            meta = item["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            pod = self.pods.get(uid)
            if pod is None:
                if (item.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                pod = self.admit(item)
            if meta.get("deletionTimestamp"):
                # As endpoints would: out of the Service first, then SIGTERM a moment later.
                if pod.deleting_since == 0.0:
                    pod.deleting_since = time.monotonic()
                    if pod.container is not None:
                        pod.container.ready = False
                    status.report(self.api, self.ns, pod)
                    continue
                if time.monotonic() - pod.deleting_since < 1.5:
                    continue
                supervisor.kill(pod, grace=min(int(meta.get("deletionGracePeriodSeconds") or 30), 20))
                self.api.try_call(
                    "DELETE",
                    f"/api/v1/namespaces/{self.ns}/pods/{pod.name}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                )
                continue
            if refresh and pod.container is not None:
                self.volumes.mount(pod, refresh_only=True)
            supervisor.supervise(pod)
            status.report(self.api, self.ns, pod)
        for uid in list(self.pods):
            if uid not in seen:
                supervisor.kill(self.pods.pop(uid), grace=5)

    def admit(self, item: Obj) -> RunPod:
        meta = item["metadata"]
        self.ip_seq += 1
        ip = f"10.244.{self.ip_seq // 250}.{self.ip_seq % 250 + 2}"
        pod = RunPod(
            uid=meta["uid"],
            name=meta["name"],
            ip=ip,
            spec=item["spec"],
            labels=meta.get("labels") or {},
            dir=self.workdir / "pods" / f"{meta['name']}-{meta['uid'][:8]}",
        )
        pod.dir.mkdir(parents=True, exist_ok=True)
        self.pods[pod.uid] = pod
        try:
            self.volumes.mount(pod)
            self.start(pod)
        except RunnerError as exc:
            pod.error, pod.phase = str(exc), "Failed"
            log.warning("pod %s cannot run: %s", pod.name, exc)
        return pod

    def start(self, pod: RunPod) -> None:
        container, argv = self.translator.process(pod)
        kubeconfig = self.volumes.pod_kubeconfig(pod)
        if kubeconfig:
            container.env["KUBECONFIG"] = kubeconfig
        pod.container = container
        supervisor.spawn(pod, argv)
