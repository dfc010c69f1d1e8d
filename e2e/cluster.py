"""A fresh namespace of a real cluster with the chart installed, removed afterwards (its objects,
the operator's finalizers, the namespace). A failed test leaves the cluster's view of the
namespace (pods, events, every container's log) in the workdir, printed at teardown."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
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
# Extra `helm install` arguments (image names or pull policies of a cluster), split like a shell would.
HELM_ARGS_ENV = "RELAYFLEET_E2E_HELM_ARGS"
NEVER = "0 0 30 2 *"  # February 30th


def _helm(cluster: KubeCluster) -> str:
    from tests.support.chart import HELM

    return HELM or cluster.tool("helm")


@contextlib.contextmanager
def cluster_env(
    cluster: KubeCluster, request: pytest.FixtureRequest, chart: Path = CHART, *extra: str
) -> Iterator[Env]:
    """A fresh namespace with `chart` installed (`extra`: more `helm install` arguments)."""
    # Not pytest's tmp_path: concurrent pytest runs rotate those away, logs included.
    workdir = Path(tempfile.mkdtemp(prefix="relayfleet-e2e-"))
    failed_before = request.session.testsfailed
    ns = f"rf-e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    env = Env(cluster, ns, workdir)
    try:
        _helm_install(env, chart, *extra)
        yield env
    finally:
        failed = request.session.testsfailed != failed_before
        if failed:
            with contextlib.suppress(Exception):
                print(f"--- cluster state of {ns}: {env.save_diagnostics()}")
        env.close()
        delete_namespace(env)
        if failed:
            print(f"--- e2e logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def delete_namespace(env: Env) -> None:
    """Custom resources first (the operator still runs to drain them), then the release, then
    whatever finalizer is left, then the namespace."""
    env.kubectl("delete", "relayshards,relayrebalances", "--all", "--wait=false", check=False)
    subprocess.run(
        [
            _helm(env.cluster),
            "--kubeconfig",
            str(env.cluster.kubeconfig),
            "-n",
            env.namespace,
            "uninstall",
            RELEASE,
            "--wait=false",
            "--no-hooks",
        ],
        capture_output=True,
        check=False,
        timeout=120,
    )
    # Objects holding the operator's finalizers would keep the namespace alive.
    for kind in ("rshard", "rrebalance"):
        for name in env.kubectl("get", kind, "-o", "name", check=False).stdout.split():
            env.kubectl("patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
    env.cluster.kubectl("delete", "namespace", env.namespace, "--wait=false", check=False)
    # helm uninstall deletes the Spark namespace it made; this is for a release that failed
    env.cluster.kubectl(
        "delete", "namespace", env.spark_namespace, "--wait=false", "--ignore-not-found", check=False
    )


def helm_install_args(env: Env, verb: str, chart: Path, *extra: str) -> list[str]:
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
        # The tests start the CronJobs' Jobs themselves; a scheduled run (retention at :17) would
        # compete for the node's CPU and name its executors as the test's do.
        "--set",
        f"spark.retention.schedule={NEVER}",
        "--set",
        f"spark.rebalance.schedule={NEVER}",
        *os.environ.get(HELM_ARGS_ENV, "").split(),
        *extra,
    ]


def _helm_install(env: Env, chart: Path, *extra: str) -> None:
    done = subprocess.run(
        helm_install_args(env, "install", chart, *extra),
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    if done.returncode != 0:
        raise AssertionError(f"helm install failed: {done.stderr.strip()}")
