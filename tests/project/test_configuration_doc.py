"""docs/configuration.md is generated from the settings' declarations (`make docs`) and checked
here; every relay, operator or Spark job variable named anywhere (docs, the chart, the CRDs, the code's
strings) is one that is declared, so a name cannot drift (RELAYFLEET_SHARD_MAP was once written
where the variable is RELAY_SHARD_MAP); and the defaults and mappings the other pages repeat
(docs/api.md's table, "`VARIABLE` (default)" in prose, docs/operator.md's spec.limits table) are
the declared ones."""

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
from relayfleet_operator.spec import DEFAULTABLE_LIMITS

from relay.envconfig import DEPRECATED_ENV, REMOVED_ENV
from relay.settings import COMMAND_SETTINGS, RELAY_SETTINGS
from relay.storage.limits import QueueLimits
from spark_jobs.settings import SPARK_SETTINGS
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
# the product's prefixes (the tools' RELAYFLEET_BENCH_*, RELAYFLEET_CACHE_DIR ... are not settings)
NAME = re.compile(
    r"\b(?:(?:RELAY|RELAYFLEET_OPERATOR|RELAYFLEET_SHARD)_[A-Z0-9_]*[A-Z0-9]|RELAYFLEET_PUSHGATEWAY\w*)\b"
)


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
    rows: dict[str, list[str]] = {}  # a variable several programs read has a row in each one's table
    for line in PAGE.read_text().splitlines():
        if line.startswith("| `"):
            rows.setdefault(line.split("|")[1].strip(), []).append(line)
    for s in (*RELAY_SETTINGS, *OPERATOR_SETTINGS, *COMMAND_SETTINGS, *SPARK_SETTINGS):
        names = " / ".join(f"`{n}`" for n in s.names)
        flag = f"`{s.flag}`" if s.flag else ""
        start = f"| {names} | {flag} | `{s.shown_default}` |"
        assert any(r.startswith(start) and s.help.replace("|", "\\|") in r for r in rows[names]), start


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
    declared = {
        n for s in (*RELAY_SETTINGS, *OPERATOR_SETTINGS, *COMMAND_SETTINGS, *SPARK_SETTINGS) for n in s.names
    }
    found, identifiers = named_anywhere()
    known = declared | set(DEPRECATED_ENV) | set(REMOVED_ENV) | NOT_SETTINGS | identifiers
    assert {"RELAY_SHARD_MAP", "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS"} <= set(found)  # the scan works
    unknown = {name: sorted(where) for name, where in found.items() if name not in known}
    assert unknown == {}, "variables named but never declared (a typo, or a setting to declare)"


# -- defaults written in prose and tables elsewhere in the docs -------------------------------------

QUANTITY = re.compile(r"(\d+(?:\.\d+)?)\s*(bytes|MiB|KiB|days|ms|s)?\b")
UNITS = {"": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "days": 86400, "ms": 0.001, "s": 1}


def _quantities(text: str) -> list[float]:
    """The numbers of `text` in bytes or seconds ("32 MiB", "5 s", "7 days")."""
    text = re.sub(r"`[^`]*`", "", text)  # variables and code are not quantities
    return [float(n) * UNITS[u] for n, u in QUANTITY.findall(text)]


def effective_default(env: str) -> float:
    """The default a relay or operator setting has, in bytes or seconds (a derived one as derived)."""
    s = next(s for s in (*RELAY_SETTINGS, *OPERATOR_SETTINGS) if s.env == env)
    field = s.field or ""
    if field == "limits.retention_s":
        value: float = QueueLimits().retention_ms / 1000
    elif field.startswith("limits."):
        value = getattr(QueueLimits(), field.removeprefix("limits."))
    else:
        value = s.default
    return value / 1000 if env.endswith("_MS") else value


def api_defaults_table() -> list[tuple[str, list[str]]]:
    """docs/api.md's defaults: (the default cell, its variables) per row that names some."""
    page = (ROOT / "docs" / "api.md").read_text()
    section = page.split("### Defaults", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`RELAY_"):
            rows.append((cells[1], re.findall(r"`(RELAY_[A-Z0-9_]+)`", cells[2])))
    return rows


def test_the_api_pages_defaults_are_the_declared_ones() -> None:
    rows = api_defaults_table()
    assert len(rows) >= 12
    checked = 0
    for cell, names in rows:
        for name, value in zip(names, _quantities(cell), strict=False):
            assert value == pytest.approx(effective_default(name)), (name, cell)
            checked += 1
    assert checked >= 15


def test_defaults_named_in_prose_are_the_declared_ones() -> None:
    """`VARIABLE` (N unit ...) anywhere in the docs: N is the declared default."""
    pattern = re.compile(
        r"(twice )?`\$?((?:RELAY|RELAYFLEET_OPERATOR)_[A-Z0-9_]+)` \((\d[\d.]*(?: (?:MiB|KiB|s|days))?)"
    )
    found = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for twice, name, quantity in pattern.findall(page.read_text()):
            (value,) = _quantities(quantity)
            expected = effective_default(name) * (2 if twice else 1)
            assert value == pytest.approx(expected), (page.name, name, quantity)
            found += 1
    assert found >= 10


def test_operator_pages_limits_table_is_the_declared_mapping() -> None:
    """docs/operator.md's `spec.limits` key → relay variable table: the quota keys, as the relay's
    declarations map them (relay/settings.py, each setting's limit_key)."""
    page = (ROOT / "docs" / "operator.md").read_text()
    section = page.split("| `spec.limits` key | relay variable |", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)`[^|]*\| `(RELAY_[A-Z0-9_]+)`", section, flags=re.M))
    assert rows == {s.limit_key: s.env for s in RELAY_SETTINGS if s.limit_key in DEFAULTABLE_LIMITS}
