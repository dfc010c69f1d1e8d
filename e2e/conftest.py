"""E2E fixtures: a cluster (any KUBECONFIG, else the kwok fixture plus the test-only pod runner),
a namespace with the chart installed, and a way to reach Services from the test process.

* ``--kubeconfig PATH`` / ``RELAYFLEET_KUBECONFIG``: a real cluster (kind: e2e/kind/run.sh).
  Pods run for real; Services are reached through ``kubectl port-forward``.
* otherwise: the session's kwok cluster (tests/support/k8s_cluster.py). e2e/podrunner/ stands in
  for the kubelet of one extra node; the kwok nodes get a NoSchedule taint for the duration so
  every pod of the test lands there. Services are reached through the runner's address table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.cluster import cluster_env
from e2e.env import Env

if TYPE_CHECKING:  # at run time pytest_plugins imports it, after assertion rewriting is set up
    from tests.support.k8s_cluster import KubeCluster

pytest_plugins = ["tests.support.k8s_cluster"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "e2e" in Path(str(item.fspath)).parts and item.path.name != "test_podrunner.py":
            item.add_marker(pytest.mark.k8s)
            item.add_marker(pytest.mark.e2e)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end tests on a Kubernetes cluster (e2e/)")


@pytest.fixture(scope="module")
def e2e(kwok_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[Env]:
    with cluster_env(kwok_cluster, request) as env:
        yield env
