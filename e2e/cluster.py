"""A fresh namespace of a cluster with the chart installed: on the kwok cluster the test-only pod
runner (e2e/podrunner) is started as the kubelet of one extra node, and every other node is
tainted meanwhile so each pod of the test lands on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.env import FLEET, RELEASE, Env

if TYPE_CHECKING:  # at run time pytest_plugins (e2e/conftest.py) imports it
    from tests.support.k8s_cluster import KubeCluster


ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "relayfleet"
TAINT = "relayfleet.dev/e2e-podrunner"
# Extra `helm install` arguments (kind: the locally built image tags), split like a shell would.
HELM_ARGS_ENV = "RELAYFLEET_E2E_HELM_ARGS"
# "1": use the pod runner on a --kubeconfig cluster too (a kwok cluster you started yourself).
PODRUNNER_ENV = "RELAYFLEET_E2E_PODRUNNER"


def _helm(cluster: KubeCluster) -> str:
    from tests.support.chart import HELM

    return HELM or cluster.tool("helm")


@contextlib.contextmanager
def cluster_env(
    cluster: KubeCluster,
    request: pytest.FixtureRequest,
    chart: Path = CHART,
    runner_env: dict[str, str] | None = None,
) -> Iterator[Env]:
    """A fresh namespace with `chart` installed (and the pod runner, given `runner_env`)."""
    # Not pytest's tmp_path: concurrent pytest runs rotate those away, logs included.
    workdir = Path(tempfile.mkdtemp(prefix="relayfleet-e2e-"))
    failed_before = request.session.testsfailed
    ns = f"rf-e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    runner: subprocess.Popen[bytes] | None = None
    tainted: list[str] = []
    env = Env(cluster, ns, workdir, None)
    try:
        if not cluster.external or os.environ.get(PODRUNNER_ENV) == "1":
            runner, tainted = _start_runner(cluster, ns, workdir, runner_env or {})
            env.runner_addresses = workdir / "runner" / "addresses.json"
        _helm_install(env, chart)
        yield env
    finally:
        env.close()
        cluster.kubectl(
            "-n", ns, "delete", "relayshards,relayrebalances", "--all", "--wait=false", check=False
        )
        subprocess.run(
            [
                _helm(cluster),
                "--kubeconfig",
                str(cluster.kubeconfig),
                "-n",
                ns,
                "uninstall",
                RELEASE,
                "--wait=false",
                "--no-hooks",  # the custom resources were deleted above, their finalizers go below
            ],
            capture_output=True,
            check=False,
            timeout=120,
        )
        # Shards holding the operator's finalizer would keep the namespace alive.
        for name in cluster.kubectl("-n", ns, "get", "rshard", "-o", "name", check=False).stdout.split():
            cluster.kubectl(
                "-n", ns, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        if runner is not None:
            _stop(runner)
            print(
                f"--- pod runner log: {workdir / 'runner.log'}; pod logs under {workdir / 'runner' / 'pods'}"
            )
        for node in tainted:
            cluster.kubectl("taint", "node", node, f"{TAINT}:NoSchedule-", check=False)
        if request.session.testsfailed == failed_before:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"--- e2e logs kept in {workdir}")


def _start_runner(
    cluster: KubeCluster, ns: str, workdir: Path, extra_env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], list[str]]:
    node = f"{ns}-node"
    # Every other node refuses new pods while the test runs, so the scheduler picks the runner's.
    tainted = [n.split("/", 1)[1] for n in cluster.kubectl("get", "nodes", "-o", "name").stdout.split()]
    for n in tainted:
        cluster.kubectl("taint", "node", n, f"{TAINT}=elsewhere:NoSchedule", "--overwrite")
    log = (workdir / "runner.log").open("wb")
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "e2e.podrunner",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--namespace",
            ns,
            "--node",
            node,
            "--workdir",
            str(workdir / "runner"),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **extra_env},
    )
    log.close()
    deadline = time.monotonic() + 60
    while True:
        ready = cluster.kubectl(
            "get", "node", node, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False
        ).stdout
        if ready == "True":
            return runner, tainted
        if runner.poll() is not None or time.monotonic() > deadline:
            _stop(runner)
            raise AssertionError(
                f"pod runner node {node} never became Ready: {(workdir / 'runner.log').read_text()}"
            )
        time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def helm_install_args(env: Env, verb: str, chart: Path) -> list[str]:
    """`helm install|upgrade` of the release with the e2e settings."""
    return [
        _helm(env.cluster),
        "--kubeconfig",
        str(env.cluster.kubeconfig),
        "-n",
        env.namespace,
        verb,
        RELEASE,
        str(chart),
        "--set",
        "operator.resyncSeconds=3",
        "--set",
        "operator.rebalanceTickSeconds=1",
        "--set",
        f"spark.fleets={{{FLEET}}}",
        *os.environ.get(HELM_ARGS_ENV, "").split(),
    ]


def _helm_install(env: Env, chart: Path) -> None:
    done = subprocess.run(
        helm_install_args(env, "install", chart), capture_output=True, text=True, check=False, timeout=180
    )
    if done.returncode != 0:
        raise AssertionError(f"helm install failed: {done.stderr.strip()}")
