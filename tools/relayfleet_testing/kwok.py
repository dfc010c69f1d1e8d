"""A kwok cluster (`kwokctl create cluster --runtime binary`) from the control-plane binaries
hack/control-plane.sh builds: a real kube-apiserver, controller-manager, scheduler and etcd with
fake kwok nodes, so Deployments get Running, Ready Pods. Used by the operator tests
(tests/support/k8s_cluster.py) and `relayfleet bench --scale --phase operator`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0


class KwokError(RuntimeError):
    """kwokctl could not create the cluster or its nodes; the message carries its output."""


@dataclass(frozen=True)
class Kwok:
    name: str
    kubeconfig: Path
    bin_dir: Path
    # KWOK_WORKDIR keeps kwokctl's state, logs and pid files out of ~/.kwok; KWOK_KUBE_VERSION
    # makes it generate flags for the version built
    env: dict[str, str] = field(default_factory=dict)

    def kubectl(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, check=True, timeout=timeout, env={**os.environ, **self.env},
        )  # fmt: skip


def build_control_plane(repo: Path) -> Path:
    """The directory of the pinned binaries (built by hack/control-plane.sh on first use)."""
    script = repo / "hack" / "control-plane.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False, cwd=repo)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not (Path(lines[-1]) / "kube-apiserver").exists():
        raise KwokError(f"{script} failed (exit {proc.returncode}):\n{tail(proc.stderr, 60)}")
    return Path(lines[-1])


@contextlib.contextmanager
def kwok_cluster(bin_dir: Path, workdir: Path, nodes: int) -> Iterator[Kwok]:
    """A kwok cluster with `nodes` Ready fake nodes; deleted (its processes stopped) on exit."""
    name = f"rf-{uuid.uuid4().hex[:8]}"
    kubeconfig = workdir / "kubeconfig"
    env = {"KWOK_WORKDIR": str(workdir / "kwok-home"), "KWOK_KUBE_VERSION": kube_version(bin_dir)}
    kwokctl = str(bin_dir / "kwokctl")

    def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [kwokctl, "--name", name, *args],
            capture_output=True, text=True, check=False, timeout=timeout, env={**os.environ, **env},
        )  # fmt: skip

    with _ports_lock():
        create = run(
            "create", "cluster", "--runtime=binary", f"--kubeconfig={kubeconfig}",
            f"--kube-apiserver-binary={bin_dir / 'kube-apiserver'}",
            f"--kube-controller-manager-binary={bin_dir / 'kube-controller-manager'}",
            f"--kube-scheduler-binary={bin_dir / 'kube-scheduler'}",
            f"--kwok-controller-binary={bin_dir / 'kwok'}",
            f"--etcd-binary={bin_dir / 'etcd'}",
            "--wait=2m",
            timeout=STARTUP_TIMEOUT_S + 60,
        )  # fmt: skip
    try:
        if create.returncode != 0:
            raise KwokError(
                f"kwokctl create cluster failed (exit {create.returncode}):\n"
                f"{tail(create.stdout + create.stderr, 60)}\n{kwok_logs(workdir)}"
            )
        scale = run("scale", "node", f"--replicas={nodes}", timeout=120)
        if scale.returncode != 0:
            raise KwokError(f"kwokctl scale node failed:\n{tail(scale.stdout + scale.stderr, 40)}")
        cluster = Kwok(name, kubeconfig, bin_dir, env)
        cluster.kubectl(
            "wait", "--for=condition=Ready", "node", "--all", f"--timeout={int(STARTUP_TIMEOUT_S)}s",
            timeout=STARTUP_TIMEOUT_S + 10,
        )  # fmt: skip
        yield cluster
    finally:
        deleted = run("delete", "cluster", timeout=120)
        if deleted.returncode != 0:  # pragma: no cover - diagnostics only
            _kill_leftovers(workdir)


@contextlib.contextmanager
def _ports_lock() -> Iterator[None]:
    """Held while kwokctl creates a cluster: it picks its components' ports by probing for free
    ones, so two creations at once (two pytest-xdist workers, each with a part of the kwok tests,
    or two runs on one machine) took the same port and one cluster failed to bind. Once created,
    its components hold their ports and the next creation probes past them."""
    with (Path(tempfile.gettempdir()) / "relayfleet-kwokctl-create.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def kube_version(bin_dir: Path) -> str:
    out = subprocess.run(
        [str(bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[-1]  # "Kubernetes v1.36.4"


def kwok_logs(workdir: Path) -> str:
    parts = []
    for log in sorted((workdir / "kwok-home").glob("clusters/*/logs/*.log")):
        parts.append(f"--- {log.name}\n{tail(log.read_text(errors='replace'), 20)}")
    return "\n".join(parts)


def _kill_leftovers(workdir: Path) -> None:
    for pid_file in (workdir / "kwok-home").glob("clusters/*/pids/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
