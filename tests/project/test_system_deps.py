"""`make test` on a fresh machine: missing Debian packages are installed (root) or named with the
exact apt-get line; under CI=true a test skipped for a missing tool fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "system-deps.sh"
PACKAGES = (
    "redis-server redis-tools redis-sentinel nginx libnginx-mod-nchan wrk prometheus "
    "prometheus-pushgateway shellcheck debootstrap skopeo"
)


def test_missing_packages_fail_with_the_exact_apt_get_line(tmp_path: Path) -> None:
    out = subprocess.run(
        ["bash", str(SCRIPT), "--check"],
        env={**os.environ, "SYSTEM_DEPS_ROOT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert f"apt-get install -y --no-install-recommends {PACKAGES}" in out.stderr


def test_nothing_missing_on_this_machine() -> None:
    # make test ran the script first; as root it installed what was missing
    out = subprocess.run(["bash", str(SCRIPT), "--check"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def _run_pytest(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    # the conftest's CI hook, without its fixtures
    (tmp_path / "conftest.py").write_text(
        (Path(__file__).parents[1] / "conftest.py").read_text().split("\n\n@pytest.fixture")[0]
    )
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.skipif(True, reason="apt-get install prometheus")
            def test_needs_tool():
                pass

            @pytest.mark.skip(reason="soak test: run with --soak")
            def test_opt_in():
                pass
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["CI"] = ci
    # the copied conftest imports tests.support: the checkout first on the path, whatever ran before
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ci_turns_missing_tool_skips_into_failures(tmp_path: Path) -> None:
    local = _run_pytest(tmp_path, "")
    assert "2 skipped" in local.stdout, local.stdout
    assert "apt-get install prometheus" in local.stdout  # -rs: listed at the end with why
    ci = _run_pytest(tmp_path, "true")
    assert ci.returncode == 1
    assert "1 skipped, 1 error" in ci.stdout, ci.stdout  # the skip happens at setup: an error
    assert "CI=true and a required tool is missing" in ci.stdout
