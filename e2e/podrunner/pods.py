"""What the runner knows of a pod bound to its node, and of the one local process standing in
for the pod's container."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from relay.fleet.contract import Obj


@dataclass
class Container:
    proc: subprocess.Popen[bytes] | None
    ports: dict[str, int]  # containerPort (as text) and port name -> host port
    env: dict[str, str]
    cwd: str
    ready: bool = False
    restarts: int = 0
    started_at: str = ""
    exit_code: int | None = None
    last_probe: float = 0.0
    restart_at: float = 0.0
    failures: int = 0


@dataclass
class RunPod:
    uid: str
    name: str
    ip: str
    spec: Obj
    labels: dict[str, str]
    dir: Path
    mounts: dict[str, str] = field(default_factory=dict)  # mountPath -> host dir
    container: Container | None = None
    phase: str = "Pending"
    reported: str = ""
    deleting_since: float = 0.0
    error: str = ""


class RunnerError(Exception):
    """A pod this runner cannot stand in for (reported through the Pod's status)."""
