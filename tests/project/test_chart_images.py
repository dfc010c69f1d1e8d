"""The images as the chart names them (helm template): the operator takes the images of
RelayShards that name none from the chart's values, and `make release` builds every image the
chart names by default, under the name its archive gives it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from relayfleet_operator.config import OPERATOR_SETTINGS
from relayfleet_operator.spec import DEFAULT_IMAGE, DEFAULT_REDIS_IMAGE

from tests.support.chart import needs_helm, render

pytestmark = needs_helm

ROOT = Path(__file__).resolve().parents[2]


def operator_container(*sets: str) -> dict[str, Any]:
    (dep,) = (
        d
        for d in render(*sets, include_crds=False)
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
    )
    container: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """Each variable's value; one from the downward API (valueFrom) as its field path."""
    return {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}


def test_the_operator_takes_the_shards_default_images_from_the_values() -> None:
    container = operator_container()
    env = env_of(container)
    # by default: this release's images, the ones the operator falls back to without the chart
    assert env["RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE"] == container["image"] == DEFAULT_IMAGE
    assert env["RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE"] == DEFAULT_REDIS_IMAGE
    # a mirror (an air-gapped cluster, a private registry) reaches the shards' Pods through the values
    env = env_of(
        operator_container(
            "image.repository=registry.local/relayfleet",
            "image.tag=v7",
            "redis.image.repository=registry.local/redis",
            "redis.image.tag=7.2-debian",
        )
    )
    assert env["RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE"] == "registry.local/relayfleet:v7"
    assert env["RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE"] == "registry.local/redis:7.2-debian"


def test_every_variable_the_chart_sets_is_one_the_operator_reads_and_its_help_names() -> None:
    names = {v.env for v in OPERATOR_SETTINGS}
    assert set(env_of(operator_container())) <= names
    assert set(env_of(operator_container("operator.manageCRDs=true"))) <= names


def test_make_release_builds_every_image_the_chart_names_under_that_name() -> None:
    version = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "version.py")], capture_output=True, text=True, check=True
    ).stdout.strip()
    docs = render(include_crds=False)
    named = {
        operator_container()["image"],
        env_of(operator_container())["RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE"],
    }
    for d in docs:
        if d["kind"] == "CronJob":
            named |= {c["image"] for c in d["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]}
    images = {re.fullmatch(rf"ghcr\.io/relayfleet/([a-z-]+):{re.escape(version)}", n) for n in named}
    assert None not in images, named
    wanted = {m.group(1) for m in images if m is not None}
    assert wanted == {"relayfleet", "relayfleet-spark", "redis"}
    release = (ROOT / "hack" / "release.sh").read_text()
    # the daemonless path: hack/cluster-images.sh build NAME... (hack/images.sh), which packs each
    # as ghcr.io/relayfleet/NAME:<v>, the name a plain `ctr images import` gives it
    # (tests/project/test_release.py checks the index)
    (listed,) = [line.strip() for line in release.splitlines() if line.strip().startswith("images=(")]
    assert set(listed.removeprefix("images=(").removesuffix(")").split()) == wanted, listed
    assert 'hack/cluster-images.sh build "${images[@]}"' in release
    assert '--name "ghcr.io/relayfleet/${name}:${tag}"' in (ROOT / "hack" / "images.sh").read_text()
    # the Docker path: docker build -t ghcr.io/relayfleet/NAME:<v> of each Dockerfile
    for name in wanted:
        assert re.search(rf'"{name}:Dockerfile(\.[a-z]+)?"', release), name
