"""E2E fixtures: a real cluster, a namespace with the chart installed, and a way to reach
Services from the test process.

The cluster is the one ``--kubeconfig PATH`` or ``RELAYFLEET_KUBECONFIG`` names: ``make e2e``
brings up the single-node cluster of ``make cluster`` and passes its kubeconfig; kind on a
laptop works the same (e2e/kind/run.sh). Pods run from the images imported into the node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.cluster import CHART, cluster_env
from e2e.env import Env

if TYPE_CHECKING:  # at run time pytest_plugins imports it, after assertion rewriting is set up
    from tests.support.k8s_cluster import KubeCluster

pytest_plugins = ["tests.support.k8s_cluster", "tests.support.didcomm_stock_agents"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "e2e" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.k8s)
            item.add_marker(pytest.mark.e2e)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end tests on a real Kubernetes cluster (e2e/)")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> KubeCluster:
    """The real cluster the run was given (never the kwok cluster of `make test`: its nodes run
    no containers)."""
    from tests.support.k8s_cluster import external_cluster, external_kubeconfig

    path = external_kubeconfig(request.config)
    if path is None:
        pytest.fail(
            "the e2e suite runs on a real cluster: `make e2e` brings one up (make cluster), or pass "
            "--kubeconfig PATH / RELAYFLEET_KUBECONFIG (docs/e2e.md)"
        )
    return external_cluster(path)


@pytest.fixture(scope="module")
def e2e(cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[Env]:
    """A namespace with the chart installed; a module's HELM_VALUES are added `--set`s."""
    extra = [arg for value in getattr(request.module, "HELM_VALUES", ()) for arg in ("--set", value)]
    with cluster_env(cluster, request, CHART, *extra) as env:
        yield env
