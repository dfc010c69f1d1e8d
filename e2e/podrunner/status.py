"""The Pod status a kubelet would report for a pod of the runner: phase, conditions and the
one container's state (running, waiting in CrashLoopBackOff or on a RunnerError, terminated),
patched only when something a reader would see changed."""

from __future__ import annotations

import json

from e2e.podrunner.kube import Api, now
from e2e.podrunner.pods import RunPod
from relay.fleet.contract import Obj


def report(api: Api, namespace: str, pod: RunPod) -> None:
    c = pod.container
    ready = bool(c and c.ready and pod.phase == "Running")
    stamp = now()
    name = pod.spec["containers"][0]["name"]
    image = pod.spec["containers"][0].get("image", "")
    state: Obj
    if pod.phase in ("Succeeded", "Failed") and c is not None:
        code = c.exit_code if c.exit_code is not None else 1
        reason = "Completed" if code == 0 else "Error"
        state = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": c.started_at,
                "finishedAt": stamp,
            }
        }
    elif c is not None and c.proc is None:
        state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"exited {c.exit_code}"}}
    elif c is not None:
        state = {"running": {"startedAt": c.started_at}}
    else:
        state = {"waiting": {"reason": "RunnerError", "message": pod.error}}
    key = json.dumps([pod.phase, ready, c.restarts if c else 0, list(state)])
    if key == pod.reported:
        return
    flag = "True" if ready else "False"
    conditions = [
        {"type": t, "status": s, "lastTransitionTime": stamp}
        for t, s in (
            ("PodReadyToStartContainers", "True"),
            ("Initialized", "True"),
            ("ContainersReady", flag),
            ("Ready", flag),
            ("PodScheduled", "True"),
        )
    ]
    status: Obj = {
        "phase": pod.phase,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": pod.ip,
        "podIPs": [{"ip": pod.ip}],
        "startTime": (c.started_at if c else stamp),
        "conditions": conditions,
        "containerStatuses": [
            {
                "name": name,
                "image": image,
                "imageID": image,
                "containerID": f"relayfleet-e2e://{c.proc.pid if c and c.proc else 0}",
                "ready": ready,
                "started": pod.phase == "Running",
                "restartCount": c.restarts if c else 0,
                "state": state,
            }
        ],
    }
    if pod.error:
        status["message"] = pod.error
    if api.merge_patch(f"/api/v1/namespaces/{namespace}/pods/{pod.name}/status", {"status": status}):
        pod.reported = key
