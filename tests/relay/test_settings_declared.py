"""Each setting is declared once (relay/envconfig.py): the declaration is what the settings read,
what their dataclasses default to, what bounds a value and what --help shows, for the relay and
the operator alike."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from relayfleet_operator.config import OPERATOR_SETTINGS, OperatorSettings

from relay import cli
from relay.envconfig import BOOL, FLOAT, INT, PORT_NUMBER, ConfigError, Setting, add_flag, resolve_flags
from relay.settings import COMMAND_SETTINGS, RELAY_ENV_ONLY, RELAY_FLAGS, RELAY_SETTINGS, Settings
from relay.storage.limits import FOLLOW_QUEUE, QueueLimits


def _other_value(s: Setting[Any]) -> tuple[str, Any]:
    """A valid value unlike the default, as text and as the setting reads it."""
    if s.kind is BOOL:
        return ("0", False) if s.default else ("1", True)
    if s.kind in (INT, PORT_NUMBER):
        value = 7 if s.default in (None, FOLLOW_QUEUE) else int(s.default) + 1
        value = min(value, int(s.hi)) if s.hi is not None and value > s.hi else value
        return str(value), value
    if s.kind is FLOAT:
        number = float(s.default) + 0.5
        number = float(s.hi) - 0.05 if s.hi is not None and number > s.hi else number
        return str(number), number
    if s.env == "RELAY_TRUSTED_PROXIES":
        return "10.0.0.0/8", ("10.0.0.0/8",)
    if s.env == "RELAY_ENQUEUE_TOKENS":
        return "one,two", ("one", "two")
    if s.env == "RELAY_AUTH":
        return "none", "none"
    return "/some/where", "/some/where"


def _field(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in (*RELAY_SETTINGS, *OPERATOR_SETTINGS, *COMMAND_SETTINGS):
        for name in s.names:
            monkeypatch.delenv(name, raising=False)


def test_the_dataclass_defaults_are_the_declared_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    assert Settings.from_env() == Settings()
    for s in RELAY_SETTINGS:
        if s.field and s.field != "limits.retention_s":
            expected = s.default
            if s.default == FOLLOW_QUEUE:  # twice the per-queue limit, as QueueLimits derives it
                expected = _field(QueueLimits(), s.field.removeprefix("limits."))
            assert _field(Settings(), s.field) == expected, s.env
    assert Settings().limits.retention_ms == 1000 * next(
        s.default for s in RELAY_SETTINGS if s.env == "RELAY_RETENTION_SECONDS"
    )
    assert OperatorSettings.from_env() == OperatorSettings()
    for s in OPERATOR_SETTINGS:
        if s.field and s.field != "crds_dir":
            assert _field(OperatorSettings(), s.field) == s.default, s.env


@pytest.mark.parametrize("setting", [s for s in RELAY_SETTINGS if s.field], ids=lambda s: s.env)
def test_from_env_reads_every_declared_relay_setting_into_its_field(
    setting: Setting[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear(monkeypatch)
    raw, value = _other_value(setting)
    monkeypatch.setenv(setting.env, raw)
    got = Settings.from_env()
    if setting.field == "limits.retention_s":
        assert got.limits.retention_ms == value * 1000
    else:
        assert _field(got, setting.field or "") == value
    assert got != Settings()


@pytest.mark.parametrize("setting", [s for s in OPERATOR_SETTINGS if s.field], ids=lambda s: s.env)
def test_from_env_reads_every_declared_operator_setting_into_its_field(
    setting: Setting[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear(monkeypatch)
    raw, value = {
        "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS": ('{"clientRateMessages": 3}', None),
        "RELAYFLEET_OPERATOR_POD_LABELS": ("a=b", (("a", "b"),)),
        "RELAYFLEET_OPERATOR_SPARK_FLEETS": ("ns/f", frozenset({("ns", "f")})),
        "RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE": ("registry.test/r:1", "registry.test/r:1"),
        "RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE": ("registry.test/r:1", "registry.test/r:1"),
    }.get(setting.env) or _other_value(setting)
    monkeypatch.setenv(setting.env, raw)
    if setting.env == "RELAYFLEET_OPERATOR_SPARK_FLEETS":
        monkeypatch.setenv("RELAYFLEET_OPERATOR_SPARK_NAMESPACE", "spark")
    got = OperatorSettings.from_env()
    assert got != OperatorSettings()
    if value is not None and setting.field != "crds_dir":
        assert _field(got, setting.field or "") == value


@pytest.mark.parametrize(
    "setting", [s for s in RELAY_SETTINGS if s.lo is not None or s.hi is not None], ids=lambda s: s.env
)
def test_bounds_move_a_relay_value_or_refuse_it_as_declared(
    setting: Setting[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear(monkeypatch)
    for bound, outside in ((setting.lo, -1), (setting.hi, 10**9)):
        if bound is None:
            continue
        monkeypatch.setenv(setting.env, str(outside))
        if setting.refuse:
            with pytest.raises(ConfigError, match=f"^{setting.env} must be"):
                setting.read()
        else:
            assert setting.read() == bound


def test_every_relay_flag_and_only_those_are_on_relay_and_its_help_shows_the_rest() -> None:
    parser = cli.subcommand_parsers()["relay"]
    flags = {a.option_strings[0] for a, _ in parser.flags_as_written if a.option_strings}
    assert flags == {s.flag for s in RELAY_FLAGS}
    assert all(s.flag is None for s in RELAY_ENV_ONLY)
    text = parser.format_help()
    for s in RELAY_ENV_ONLY:
        assert any(
            line.split()[:1] == [s.env] and f"[default {s.shown_default}]" in line
            for line in text.splitlines()
        )


def test_a_flag_and_its_variable_are_checked_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    port = next(s for s in RELAY_FLAGS if s.env == "RELAY_PORT")
    parser = argparse.ArgumentParser()
    add_flag(parser, port)
    monkeypatch.setenv("RELAY_PORT", "9001")
    args = parser.parse_args([])
    resolve_flags(args)
    assert args.port == 9001  # from the variable
    args = parser.parse_args(["--port", "9002"])
    resolve_flags(args)
    assert args.port == 9002  # the flag wins
    with pytest.raises(ConfigError, match=r"^--port must be a port number, got '0'$"):
        resolve_flags(parser.parse_args(["--port", "0"]))
    monkeypatch.setenv("RELAY_PORT", "65536")
    with pytest.raises(ConfigError, match=r"^RELAY_PORT must be a port number, got '65536'$"):
        resolve_flags(parser.parse_args([]))


def test_declared_names_are_unique_and_the_prefix_policy_holds() -> None:
    relay = [n for s in RELAY_SETTINGS for n in s.names]
    operator = [n for s in OPERATOR_SETTINGS for n in s.names]
    assert len(relay) == len(set(relay))
    assert len(operator) == len(set(operator))
    assert all(n.startswith("RELAY_") for n in relay)
    shared = {"RELAY_LOG_LEVEL", "KUBECONFIG"}  # every relayfleet command's, and kubectl's
    assert all(n.startswith("RELAYFLEET_OPERATOR_") for n in set(operator) - shared)
    for declared in (RELAY_SETTINGS, OPERATOR_SETTINGS):
        fields = [s.field for s in declared if s.field]
        assert len(fields) == len(set(fields))
    relay_fields = {f.name for f in dataclasses.fields(Settings)}
    assert {s.field for s in RELAY_SETTINGS if s.field and "." not in s.field} <= relay_fields


# Environment reads outside relay/envconfig.py that are not settings, each with its reason: the
# variables of other programs (Kubernetes, Spark, Python), and test hooks. Everything else a
# product module reads from the environment goes through a declared Setting.
NOT_SETTINGS_READ = {
    # Kubernetes sets it in every pod: "in a cluster?", not something a user configures
    ("relay/kubeapi.py", "KUBERNETES_SERVICE_HOST"),
    # the migration's crash test hook (tests/relay/fleet/test_migration_crash.py)
    ("relay/fleet/migration/crash_points.py", "CRASH_ENV"),
    # Spark's and Python's own: spark-submit's gateway, the executors' interpreter and path
    ("spark_jobs/session.py", "PYSPARK_GATEWAY_PORT"),
    ("spark_jobs/session.py", "PYSPARK_PYTHON"),
    ("spark_jobs/session.py", "SPARK_LOCAL_IP"),
    ("spark_jobs/session.py", "PYTHONPATH"),
}


def _environment_reads(path: Path) -> set[str]:
    """What `path` reads from os.environ / os.getenv: the name given (a literal, or a constant's
    identifier); "*" for a read of the whole environment."""
    out: set[str] = set()

    def environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    def name(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return node.id if isinstance(node, ast.Name) else "*"

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            reads = node.func.attr in {"get", "setdefault", "pop"} and environ(owner)
            if (reads or node.func.attr == "getenv") and node.args:
                out.add(name(node.args[0]))
        elif isinstance(node, ast.Subscript) and environ(node.value):
            out.add(name(node.slice))
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            out.add(name(node.left))
    return out


def test_no_product_module_reads_a_setting_around_its_declaration() -> None:
    root = Path(__file__).resolve().parents[2]
    found = set()
    for package in ("relay", "operator/relayfleet_operator", "spark_jobs"):
        for path in (root / package).rglob("*.py"):
            where = str(path.relative_to(root))
            if where != "relay/envconfig.py":
                found |= {(where, name) for name in _environment_reads(path)}
    assert ("relay/kubeapi.py", "KUBERNETES_SERVICE_HOST") in found  # the scan sees reads
    assert found - NOT_SETTINGS_READ == set(), "read through its Setting (relay/envconfig.py)"
