"""One version (pyproject.toml) stamped everywhere a release carries it; hack/version.py finds drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMPED = [
    "pyproject.toml",
    "hack/version.py",
    "charts/relayfleet/Chart.yaml",
    "crds/relayshards.yaml",
    "charts/relayfleet/crds/relayshards.yaml",
    "crds/relayrebalances.yaml",
    "charts/relayfleet/crds/relayrebalances.yaml",
    "operator/relayfleet_operator/spec.py",
]


def version_py(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "hack" / "version.py"), *args], capture_output=True, text=True, timeout=30
    )


def test_the_repository_carries_one_version() -> None:
    proc = version_py(ROOT, "--check")
    assert proc.returncode == 0, proc.stderr
    version = version_py(ROOT).stdout.strip()
    assert f'appVersion: "{version}"' in (ROOT / "charts/relayfleet/Chart.yaml").read_text()


def test_drift_is_found_and_sync_fixes_it(tmp_path: Path) -> None:
    for rel in STAMPED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    py = tmp_path / "pyproject.toml"
    py.write_text(
        py.read_text().replace(f'version = "{version_py(ROOT).stdout.strip()}"', 'version = "9.8.7"')
    )
    proc = version_py(tmp_path, "--check")
    assert proc.returncode == 1
    assert proc.stderr.count("version drift:") == 9, proc.stderr
    assert version_py(tmp_path, "--sync").returncode == 0
    assert version_py(tmp_path, "--check").returncode == 0
    assert "relayfleet:9.8.7" in (tmp_path / "crds/relayshards.yaml").read_text()
