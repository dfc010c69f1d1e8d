"""Faults done to real Pods from the node itself (the test process runs as root on the node of
`make cluster`): a container's processes found by its id in their cgroup, SIGKILLed; a Pod cut
off from chosen peers by iptables rules in its network namespace (entered through one of its
processes), so whatever the bridge does, nothing of theirs reaches it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest


def container_id(pod: dict[str, Any], container: str) -> str:
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        if status["name"] == container and status.get("containerID"):
            return str(status["containerID"]).split("://", 1)[1]
    raise LookupError(f"container {container} of {pod['metadata']['name']} has no id yet")


def container_pids(cid: str) -> list[int]:
    """The host pids of a container's processes (its id names its cgroup)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if cid in (proc / "cgroup").read_text():
                pids.append(int(proc.name))
    return sorted(pids)


def on_this_node(cid: str) -> list[int]:
    pids = container_pids(cid)
    if not pids:
        pytest.skip("the container's processes are not on this host (a node fault needs the node's root)")
    return pids


def sigkill_container(pod: dict[str, Any], container: str) -> int:
    """SIGKILL every process of the container; returns how many."""
    pids = on_this_node(container_id(pod, container))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def _iptables(pid: int, *args: str) -> None:
    subprocess.run(
        ["nsenter", "-t", str(pid), "-n", "iptables", "-w", *args],
        check=True,
        capture_output=True,
        timeout=30,
    )


@contextlib.contextmanager
def partitioned(pod: dict[str, Any], container: str, peers: Sequence[str]) -> Iterator[None]:
    """No packet between the Pod and any of `peers` (Pod IPs) while inside: DROP both ways,
    so connections hang as over a cut link (no reset)."""
    pid = on_this_node(container_id(pod, container))[0]
    rules = [("INPUT", "-s", ip) for ip in peers] + [("OUTPUT", "-d", ip) for ip in peers]
    added = []
    try:
        for chain, flag, ip in rules:
            _iptables(pid, "-I", chain, flag, ip, "-j", "DROP")
            added.append((chain, flag, ip))
        yield
    finally:
        for chain, flag, ip in added:
            _iptables(pid, "-D", chain, flag, ip, "-j", "DROP")
