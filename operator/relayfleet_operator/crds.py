"""The operator keeps its own CRDs current: server-side apply at start, guarded.

`helm upgrade` never touches a chart's crds/ directory, so new RelayShard fields would never
reach a cluster installed with an older chart. The chart therefore mounts its crds/ files into
the operator (a ConfigMap) and sets RELAYFLEET_OPERATOR_CRDS_DIR; at start the operator applies
them before it watches anything. Guards:

* only its own CRDs: every file must be a CustomResourceDefinition named in OWN_CRDS (any other
  file fails the start: a chart packaging mistake, never something to apply);
* never downgrade: each CRD carries the release version (annotation VERSION_ANNOTATION, stamped
  by hack/version.py); a live CRD with a newer version is left alone (an older operator rolled
  back over a newer install keeps working: v1alpha1 only ever gains optional fields);
* a live CRD without the annotation (charts up to 0.1.0) counts as older.

RBAC: `get` and `patch` on exactly these two CRD names (no `create`: the first install comes
from the chart's crds/; see docs/upgrade.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from relay.fleet.contract import Obj
from relayfleet_operator.kube import Kube

log = logging.getLogger("relayfleet.operator.crds")

CRDS_DIR_ENV = "RELAYFLEET_OPERATOR_CRDS_DIR"
VERSION_ANNOTATION = "relayfleet.dev/version"
OWN_CRDS = frozenset({"relayshards.relayfleet.dev", "relayrebalances.relayfleet.dev"})
CRD_API = "apiextensions.k8s.io/v1"
_SEMVER = re.compile(r"^([0-9]+)\.([0-9]+)\.([0-9]+)(?:-([0-9A-Za-z.]+))?$")


class CRDError(RuntimeError):
    """A CRD file the operator must not apply, or an apply the API server refused."""


def version_key(text: str | None) -> tuple[int, int, int, int, str] | None:
    """Sortable form of MAJOR.MINOR.PATCH[-PRE] (a pre-release sorts before its release)."""
    m = _SEMVER.match(text or "")
    if m is None:
        return None
    major, minor, patch, pre = m.groups()
    return (int(major), int(minor), int(patch), 0 if pre else 1, pre or "")


def crd_version(obj: Mapping[str, Any] | None) -> str | None:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    value = annotations.get(VERSION_ANNOTATION)
    return value if isinstance(value, str) else None


def load(directory: Path, own: Collection[str] = OWN_CRDS) -> list[Obj]:
    """The CRDs in `directory` (*.yaml), each checked to be one of `own` and versioned."""
    crds: list[Obj] = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            name = (doc.get("metadata") or {}).get("name")
            if doc.get("kind") != "CustomResourceDefinition" or name not in own:
                raise CRDError(f"{path.name}: {doc.get('kind')} {name!r} is not one of the operator's CRDs")
            if version_key(crd_version(doc)) is None:
                raise CRDError(f"{path.name}: {name} has no {VERSION_ANNOTATION} annotation")
            crds.append(doc)
    if not crds:
        raise CRDError(f"no CRD files in {directory}")
    return crds


@dataclass(frozen=True)
class Decision:
    name: str
    apply: bool
    why: str


def decide(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> Decision:
    """Apply unless the live CRD is newer than ours."""
    name = desired["metadata"]["name"]
    ours = crd_version(desired)
    if live is None:
        return Decision(name, True, f"absent; installing {ours}")
    theirs = crd_version(live)
    live_key, our_key = version_key(theirs), version_key(ours)
    assert our_key is not None  # load() checked
    if live_key is None:
        return Decision(name, True, f"unversioned (before 0.2.0); upgrading to {ours}")
    if live_key > our_key:
        return Decision(name, False, f"live {theirs} is newer than this operator's {ours}: not downgrading")
    if live_key == our_key:
        return Decision(name, True, f"at {ours}; re-applying (a no-op unless edited)")
    return Decision(name, True, f"upgrading {theirs} to {ours}")


async def install(kube: Kube, crds: list[Obj], timeout_s: float = 60.0) -> list[Decision]:
    """Apply each CRD `decide` allows, then wait until each is Established."""
    decisions: list[Decision] = []
    for crd in crds:
        name = crd["metadata"]["name"]
        live = await kube.get(CRD_API, "CustomResourceDefinition", None, name)
        decision = decide(crd, live)
        decisions.append(decision)
        if not decision.apply:
            log.warning("CRD %s: %s", name, decision.why)
            continue
        log.info("CRD %s: %s", name, decision.why)
        # force: the first install's fields belong to helm; the operator takes them over.
        await kube.apply(crd, force=True)
    for decision in decisions:
        if decision.apply:
            await _established(kube, decision.name, timeout_s)
    return decisions


async def _established(kube: Kube, name: str, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        live = await kube.get(CRD_API, "CustomResourceDefinition", None, name)
        conditions = ((live or {}).get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return
        if loop.time() > deadline:
            raise CRDError(f"CRD {name} not Established after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


def install_from_dir(kube: Kube, directory: Path) -> list[Decision]:
    """Blocking entry for the operator's start (before kopf's loop exists)."""

    async def run() -> list[Decision]:
        try:
            return await install(kube, load(directory))
        finally:
            await kube.close()

    return asyncio.run(run())
