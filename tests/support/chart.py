"""The chart and the CRDs as the tests read them: the CRD documents, the pinned helm (built by
hack/control-plane.sh, never built here) and the chart rendered by it."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
CHART = ROOT / "charts" / "relayfleet"
K8S_VERSION = "1.36"  # the control plane tests run against (hack/control-plane.sh)


def crd(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CRDS / name).read_text())
    return doc


def schema_of(doc: dict[str, Any]) -> dict[str, Any]:
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    result: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return result


def helm_binary() -> str | None:
    """The pinned helm hack/control-plane.sh builds (without building it), else PATH."""
    explicit = os.environ.get("RELAYFLEET_HELM")
    if explicit:
        return explicit
    script = (
        (ROOT / "hack" / "control-plane.sh").read_text()
        if (ROOT / "hack" / "control-plane.sh").exists()
        else ""
    )
    pin = re.search(r'^HELM_VERSION="(v[0-9.]+)"', script, re.MULTILINE)
    version = pin.group(1) if pin else "*"
    cache = os.environ.get("RELAYFLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "relayfleet"
    )
    for pattern in (f"{cache}/helm/{version}/bin/helm", str(ROOT / ".cache" / "k8s" / "*" / "bin" / "helm")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return shutil.which("helm")


HELM = helm_binary()


needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm not built yet: run hack/control-plane.sh (or set RELAYFLEET_HELM)"
)


def helm(*args: str) -> str:
    assert HELM is not None
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def render(
    *sets: str, include_crds: bool = True, release: str = "relayfleet", namespace: str = "relay"
) -> list[dict[str, Any]]:
    # as on a cluster running the Prometheus operator, so monitoring objects render too
    args = [
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--api-versions",
        "monitoring.coreos.com/v1",
    ]
    if include_crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]
