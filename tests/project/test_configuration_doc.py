"""docs/configuration.md is generated from the settings' declarations (`make docs`) and checked
here, and every relay or operator variable named anywhere (docs, the chart, the CRDs, the code's
strings) is one that is declared: a name cannot drift (RELAYFLEET_SHARD_MAP was once written
where the variable is RELAY_SHARD_MAP)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from relayfleet_operator.config import OPERATOR_SETTINGS

from relay.envconfig import DEPRECATED_ENV, REMOVED_ENV
from relay.settings import COMMAND_SETTINGS, RELAY_SETTINGS
from tests.support.chart import ROOT

SCRIPT = ROOT / "hack" / "configuration_doc.py"
PAGE = ROOT / "docs" / "configuration.md"
# Named but not settings, each with its reason.
NOT_SETTINGS = {
    # the secret's plain name: never read (the seed only comes as a file), reserved in spec.relay.env
    # so a seed never sits in a pod spec
    "RELAY_DIDCOMM_SEED",
    # docs/reliability.md: a proposed setting, named as such
    "RELAY_REDIS_TIMEOUT_S",
    # the test suite's own knobs (tests/), not the product's
    "RELAY_FUZZ_EXAMPLES",
    "RELAY_FAULTS_REPORT",
    "RELAY_FAULTS_SEED",
}
NAME = re.compile(r"\b(?:RELAY|RELAYFLEET_OPERATOR|RELAYFLEET_SHARD)_[A-Z0-9_]*[A-Z0-9]\b")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("configuration_doc", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_declarations_render() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert PAGE.read_text() == _generator().render()


def test_the_check_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("RELAY_MAX_WAITERS", "RELAY_MAX_WAITER"))
    monkeypatch.setattr(gen, "PAGE", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0  # `make docs` rewrites it
    assert gen.main(["--check"]) == 0


def test_every_setting_is_on_the_page_with_its_default_and_help() -> None:
    rows = {
        line.split("|")[1].strip(): line for line in PAGE.read_text().splitlines() if line.startswith("| `")
    }
    for s in (*RELAY_SETTINGS, *OPERATOR_SETTINGS, *COMMAND_SETTINGS):
        row = rows[" / ".join(f"`{n}`" for n in s.names)]
        assert f"`{s.shown_default}`" in row, row
        assert s.help.replace("|", "\\|") in row, row
        if s.flag:
            assert f"`{s.flag}`" in row, row


def _named_in_code(path: Path) -> tuple[set[str], set[str]]:
    """Names in the module's strings (its docstrings and messages), and its identifiers (a
    docstring may name a constant such as RELAY_SETTINGS)."""
    names: set[str] = set()
    identifiers: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= set(NAME.findall(node.value))
        elif isinstance(node, ast.Name):
            identifiers.add(node.id)
    return names, identifiers


def named_anywhere() -> tuple[dict[str, set[str]], set[str]]:
    """Every relay/operator variable name and where it is written; the code's identifiers."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "crds").glob("*.yaml")]
    files += [p for p in (ROOT / "charts").rglob("*") if p.suffix in {".yaml", ".tpl", ".txt", ".json"}]
    found: dict[str, set[str]] = {}
    identifiers: set[str] = set()
    for path in files:
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for package in ("relay", "operator", "spark_jobs"):
        for path in (ROOT / package).rglob("*.py"):
            names, idents = _named_in_code(path)
            identifiers |= idents
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found, identifiers


def test_every_variable_named_anywhere_is_declared() -> None:
    declared = {n for s in (*RELAY_SETTINGS, *OPERATOR_SETTINGS, *COMMAND_SETTINGS) for n in s.names}
    found, identifiers = named_anywhere()
    known = declared | set(DEPRECATED_ENV) | set(REMOVED_ENV) | NOT_SETTINGS | identifiers
    assert {"RELAY_SHARD_MAP", "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS"} <= set(found)  # the scan works
    unknown = {name: sorted(where) for name, where in found.items() if name not in known}
    assert unknown == {}, "variables named but never declared (a typo, or a setting to declare)"
