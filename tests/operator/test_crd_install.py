"""The operator applies its own CRDs at start (relayfleet_operator/crds.py): the guard's
decisions, the files it refuses, and the apply itself on a real API server.

On the API server the CRDs are renamed into a test-only group, so the session's real
relayfleet.dev CRDs (which other tests use) are never downgraded or touched."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from relayfleet_operator import crds
from relayfleet_operator.kube import Kube

from tests.support.chart import CRDS, crd, needs_helm, render
from tests.support.k8s_cluster import KubeCluster

VERSION = crds.crd_version(crd("relayshards.yaml"))


def versioned(doc: dict[str, Any], version: str | None) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    annotations = out["metadata"].setdefault("annotations", {})
    if version is None:
        annotations.pop(crds.VERSION_ANNOTATION, None)
    else:
        annotations[crds.VERSION_ANNOTATION] = version
    return out


def test_version_order() -> None:
    keys = [crds.version_key(v) for v in ("0.1.0", "0.2.0-rc.1", "0.2.0", "0.10.0", "1.0.0")]
    assert all(k is not None for k in keys)
    assert keys == sorted(keys)  # type: ignore[type-var]
    assert crds.version_key("v1") is None


def test_decide_never_downgrades() -> None:
    ours = crd("relayshards.yaml")
    assert VERSION is not None
    assert crds.decide(ours, None).apply
    assert crds.decide(ours, versioned(ours, None)).apply  # charts before 0.2.0 had no annotation
    assert crds.decide(ours, versioned(ours, "0.1.0")).apply
    assert crds.decide(ours, versioned(ours, VERSION)).apply
    newer = crds.decide(ours, versioned(ours, "99.0.0"))
    assert not newer.apply
    assert "not downgrading" in newer.why


def test_load_takes_only_the_operators_own_versioned_crds(tmp_path: Path) -> None:
    assert {d["metadata"]["name"] for d in crds.load(CRDS)} == crds.OWN_CRDS
    foreign = copy.deepcopy(crd("relayshards.yaml"))
    foreign["metadata"]["name"] = "widgets.example.com"
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(foreign))
    with pytest.raises(crds.CRDError, match="not one of the operator's CRDs"):
        crds.load(tmp_path)
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(versioned(crd("relayshards.yaml"), None)))
    with pytest.raises(crds.CRDError, match=r"has no relayfleet\.dev/version"):
        crds.load(tmp_path)
    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"kind": "ConfigMap", "metadata": {"name": "x"}}))
    with pytest.raises(crds.CRDError):
        crds.load(tmp_path)


@needs_helm
def test_chart_mounts_exactly_its_crds_into_the_operator() -> None:
    docs = render(include_crds=False)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-crds")]
    assert set(cm["data"]) == {"relayshards.yaml", "relayrebalances.yaml"}
    for name, text in cm["data"].items():
        assert yaml.safe_load(text) == crd(name)
    (op,) = [d for d in docs if d["kind"] == "Deployment"]
    container = op["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "crds")
    assert env[crds.CRDS_DIR_ENV] == mount["mountPath"]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("crd-apply")]
    (rule,) = role["rules"]
    assert sorted(rule["resourceNames"]) == sorted(crds.OWN_CRDS)
    assert sorted(rule["verbs"]) == ["get", "patch"]
    off = render("operator.manageCRDs=false", include_crds=False)
    assert not [d for d in off if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-crds")]
    assert not [d for d in off if d["metadata"]["name"].endswith("crd-apply")]


# --- on a real API server ------------------------------------------------------------------------

TEST_GROUP = "crd-install-test.relayfleet.dev"


def regrouped(doc: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out["spec"]["group"] = TEST_GROUP
    out["metadata"]["name"] = f"{out['spec']['names']['plural']}.{TEST_GROUP}"
    return out


@pytest.fixture
def test_crds(kube_apiserver: KubeCluster) -> Iterator[list[dict[str, Any]]]:
    docs = [regrouped(crd(n)) for n in ("relayshards.yaml", "relayrebalances.yaml")]
    yield docs
    for d in docs:
        kube_apiserver.kubectl("delete", "crd", d["metadata"]["name"], "--wait=false", check=False)


def live(cluster: KubeCluster, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        cluster.kubectl("get", "crd", name, "-o", "json", "--show-managed-fields").stdout
    )
    return doc


def has_relay_field(doc: dict[str, Any]) -> bool:
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return "relay" in spec["properties"]


@pytest.mark.k8s
def test_install_upgrades_an_older_crd_and_leaves_a_newer_one(
    kube_apiserver: KubeCluster, test_crds: list[dict[str, Any]]
) -> None:
    shards = test_crds[0]
    name = shards["metadata"]["name"]
    # As a 0.1.0 chart left it: installed by someone else (helm; here kubectl), unversioned,
    # without spec.relay, defaulting both images at admission.
    old = versioned(shards, None)
    old_spec = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del old_spec["relay"]
    old_spec["image"]["default"] = "ghcr.io/relayfleet/relayfleet:0.1.0"
    old_spec["redis"]["properties"]["managed"]["properties"]["image"]["default"] = "redis:7.2"
    kube_apiserver.kubectl("create", "-f", "-", input=json.dumps(old))

    async def install(docs: list[dict[str, Any]]) -> list[crds.Decision]:
        kube = await Kube.from_config(str(kube_apiserver.kubeconfig))
        try:
            return await crds.install(kube, docs)
        finally:
            await kube.close()

    decisions = asyncio.run(install(test_crds))
    assert [d.apply for d in decisions] == [True, True]
    got = live(kube_apiserver, name)
    assert has_relay_field(got)
    assert crds.crd_version(got) == VERSION
    # the image defaults are gone with the fields the operator's apply took over (the operator's
    # configured images apply to shards created from now on)
    spec = got["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "default" not in spec["image"]
    assert "default" not in spec["redis"]["properties"]["managed"]["properties"]["image"]
    managers = {m["manager"] for m in got["metadata"]["managedFields"]}
    assert "relayfleet-operator" in managers

    # A newer CRD (a later release installed, then this operator rolled back): untouched.
    newer = versioned(shards, "99.0.0")
    newer["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Marker", "type": "string", "jsonPath": ".spec.fleet", "priority": 9}
    )
    kube_apiserver.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(newer))
    decisions = asyncio.run(install([shards]))
    assert not decisions[0].apply
    got = live(kube_apiserver, name)
    assert crds.crd_version(got) == "99.0.0"
    assert any(c["name"] == "Marker" for c in got["spec"]["versions"][0]["additionalPrinterColumns"])
