"""The operator's configuration is read once: OperatorSettings.from_env(), validated before the
operator starts (`python -m relayfleet_operator` exits 2 with one line naming the variable),
listed with defaults in --help, and never read while its modules are imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import kopf
import pytest
from relayfleet_operator import handlers
from relayfleet_operator.config import OPERATOR_SETTINGS, OperatorSettings
from relayfleet_operator.kube import Kube
from relayfleet_operator.spec import (
    DEFAULT_IMAGE,
    DEFAULTABLE_LIMITS,
    ImageDefaults,
    LimitDefaults,
    Neighbours,
)

from relay.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def run_module(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m relayfleet_operator ARGS` with only the given operator variables set."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "RELAYFLEET_", "KUBECONFIG"))}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "relayfleet_operator", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"RELAYFLEET_OPERATOR_RESYNC_SECONDS": "abc"},
            "relayfleet operator: RELAYFLEET_OPERATOR_RESYNC_SECONDS must be a number, got 'abc'",
        ),
        (
            {"RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS": "0"},
            "relayfleet operator: RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS must be a positive number of"
            " seconds",
        ),
        (
            {"RELAYFLEET_OPERATOR_RETRY_SECONDS": "inf"},
            "relayfleet operator: RELAYFLEET_OPERATOR_RETRY_SECONDS must be a number, got 'inf'",
        ),
        (
            {"RELAYFLEET_OPERATOR_HEALTH_PORT": "99999"},
            "relayfleet operator: RELAYFLEET_OPERATOR_HEALTH_PORT must be a port number, got 99999",
        ),
        (
            {"RELAYFLEET_OPERATOR_METRICS_PORT": "http"},
            "relayfleet operator: RELAYFLEET_OPERATOR_METRICS_PORT must be a port number, got 'http'",
        ),
        (
            {"RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE": "redis 7"},
            "relayfleet operator: RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE must be an image reference of"
            " at most 512 characters, no spaces, got 'redis 7'",
        ),
        (
            {"RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS": '{"maxPayloadBytes": 5}'},
            "relayfleet operator: RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS: 'maxPayloadBytes' is not one of "
            + ", ".join(DEFAULTABLE_LIMITS),
        ),
        (
            {"RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS": '{"clientRateMessages": "many"}'},
            "relayfleet operator: RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS: clientRateMessages: not a"
            " non-negative integer",
        ),
        (
            {"RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS": "clientRateMessages=5"},
            "relayfleet operator: RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS: Expecting value: line 1 column 1"
            " (char 0)",
        ),
        (
            {"RELAYFLEET_OPERATOR_POD_LABELS": "app.kubernetes.io/name"},
            "relayfleet operator: RELAYFLEET_OPERATOR_POD_LABELS must be a list K=V,... of labels, got"
            " 'app.kubernetes.io/name'",
        ),
        (
            {"RELAYFLEET_OPERATOR_SPARK_FLEETS": "relay/main"},
            "relayfleet operator: RELAYFLEET_OPERATOR_SPARK_FLEETS needs RELAYFLEET_OPERATOR_SPARK_NAMESPACE",
        ),
        (
            {"RELAYFLEET_OPERATOR_SPARK_NAMESPACE": "spark", "RELAYFLEET_OPERATOR_SPARK_FLEETS": "main"},
            "relayfleet operator: RELAYFLEET_OPERATOR_SPARK_FLEETS must be a list NS/FLEET,..., got 'main'",
        ),
        (
            {"RELAY_LOG_LEVEL": "loud"},
            "relayfleet operator: RELAY_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL,"
            " got 'loud'",
        ),
    ],
)
def test_bad_value_exits_2_with_one_line_naming_the_variable(env: dict[str, str], message: str) -> None:
    out = run_module("--namespace", "x", env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == message  # one line: no traceback, no kopf start-up
    assert out.stdout == ""


def test_a_flag_wins_over_its_variable_and_is_checked_by_the_same_rule() -> None:
    # both entry points take the operator's flags from the same declarations (config.add_arguments)
    out = run_module("--namespace", "x", "--log-level", "loud", env={"RELAY_LOG_LEVEL": "DEBUG"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "relayfleet operator: --log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"
    )


def test_help_names_every_variable_with_its_default() -> None:
    out = run_module("-h")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for var in OPERATOR_SETTINGS:
        line = next((ln for ln in text.splitlines() if ln.split()[:1] == [var.env]), None)
        assert line is not None, f"{var.env} missing from --help"
        assert f"[default {var.shown_default}]" in line, line
    # the images of shards that name none: the chart sets both, without it this release's own
    for name, image in [
        ("RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE", DEFAULT_IMAGE),
        (
            "RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE",
            "ghcr.io/relayfleet/redis:" + DEFAULT_IMAGE.split(":")[-1],
        ),
    ]:
        assert any(ln.split()[:1] == [name] and f"[default {image}]" in ln for ln in text.splitlines()), name
    assert "RELAY_OPERATOR_NAMESPACE -> RELAYFLEET_OPERATOR_NAMESPACE" in text  # deprecated, still read
    assert "env RELAYFLEET_OPERATOR_NAMESPACE" in " ".join(text.split())


def test_from_env_reads_every_variable_and_the_defaults_are_plain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in OPERATOR_SETTINGS:
        monkeypatch.delenv(var.env, raising=False)
    monkeypatch.delenv("RELAY_OPERATOR_NAMESPACE", raising=False)
    assert OperatorSettings.from_env() == OperatorSettings()
    monkeypatch.setenv("RELAYFLEET_OPERATOR_RESYNC_SECONDS", "7.5")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS", "1")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_RETRY_SECONDS", "4")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_HEALTH_PORT", "8181")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_METRICS_PORT", "0")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_CRDS_DIR", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join(["/k/one", "/k/two"]))
    monkeypatch.setenv("RELAY_LOG_LEVEL", "debug")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE", "registry.test/relay:7")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE", "registry.test/redis@sha256:" + "0" * 64)
    monkeypatch.setenv("RELAY_OPERATOR_NAMESPACE", "old-name")  # deprecated name, still read
    monkeypatch.setenv(
        "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS",
        '{"clientRateMessages": 0, "shardReserveFraction": 0.25, "trustedProxies": ["10.1.2.3"]}',
    )
    monkeypatch.setenv("RELAYFLEET_OPERATOR_POD_NAMESPACE", "ops")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_POD_LABELS", "app.kubernetes.io/name=relayfleet,a=b")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_SPARK_NAMESPACE", "ops-spark")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_SPARK_FLEETS", "ops/main,ops/two")
    got = OperatorSettings.from_env()
    assert got == OperatorSettings(
        namespace="old-name",
        health_port=8181,
        metrics_port=0,
        resync_seconds=7.5,
        rebalance_tick_seconds=1.0,
        retry_seconds=4.0,
        images=ImageDefaults(relay="registry.test/relay:7", redis="registry.test/redis@sha256:" + "0" * 64),
        limit_defaults=LimitDefaults(
            (("clientRateMessages", 0), ("shardReserveFraction", 0.25), ("trustedProxies", ("10.1.2.3/32",)))
        ),
        neighbours=Neighbours(
            operator_namespace="ops",
            operator_labels=(("a", "b"), ("app.kubernetes.io/name", "relayfleet")),
            spark_namespace="ops-spark",
            spark_fleets=frozenset({("ops", "main"), ("ops", "two")}),
        ),
        crds_dir=tmp_path,
        kubeconfig="/k/one",
        log_level="DEBUG",
    )
    monkeypatch.setenv("RELAYFLEET_OPERATOR_NAMESPACE", "new-name")  # the new name wins
    monkeypatch.setenv("RELAYFLEET_OPERATOR_KUBECONFIG", "/k/operator")
    got = OperatorSettings.from_env()
    assert (got.namespace, got.kubeconfig) == ("new-name", "/k/operator")
    monkeypatch.setenv("RELAYFLEET_OPERATOR_HEALTH_PORT", "-1")
    with pytest.raises(ConfigError, match="RELAYFLEET_OPERATOR_HEALTH_PORT must be a port number"):
        OperatorSettings.from_env()


def test_handlers_take_their_periods_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # kopf has no public accessor for a registered timer's interval: record what register()
    # asks kopf.timer for, and still register through it
    timers: dict[str, tuple[object, object]] = {}
    real_timer = kopf.timer

    def recording_timer(*args: Any, **kwargs: Any) -> Any:
        decorate = real_timer(*args, **kwargs)

        def record(fn: Any) -> Any:
            timers[fn.__name__] = (kwargs.get("interval"), kwargs.get("initial_delay"))
            return decorate(fn)

        return record

    monkeypatch.setattr(kopf, "timer", recording_timer)
    handlers.register(
        kopf.OperatorRegistry(), OperatorSettings(resync_seconds=7.0, rebalance_tick_seconds=3.0)
    )
    assert timers == {"shard_resync": (7.0, 7.0), "rebalance_tick": (3.0, None)}


async def test_the_handlers_context_carries_the_configured_images() -> None:
    images = ImageDefaults(relay="registry.test/relay:7", redis="registry.test/redis:7")
    memo = kopf.Memo(kube=Kube(None), settings=OperatorSettings(images=images))
    await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)
    assert memo["ctx"].images == images  # shards.reconcile parses each RelayShard with them


async def test_the_handlers_context_carries_the_configured_limit_defaults() -> None:
    defaults = LimitDefaults.parse({"recipientMaxChannels": 8})
    memo = kopf.Memo(kube=Kube(None), settings=OperatorSettings(limit_defaults=defaults))
    await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)
    assert memo["ctx"].limit_defaults == defaults  # shards.reconcile and drain parse with them


def test_importing_the_operator_reads_no_environment() -> None:
    """Every module of the operator imported with os.environ watched: none of them may read
    a variable while it is imported (kopf, kubernetes and the rest may)."""
    script = textwrap.dedent(
        """
        import os, pkgutil, importlib, sys
        pkg_dir = os.path.join(os.getcwd(), "operator", "relayfleet_operator")
        reads = []
        # os.environ.get and `in` reach __getitem__ through these; the caller is above them
        SKIP = ("os.py", "<frozen os>", "_collections_abc.py", "<frozen _collections_abc>")

        class Watched(type(os.environ)):
            def __getitem__(self, key):
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename.endswith(SKIP):
                    frame = frame.f_back
                if frame is not None and frame.f_code.co_filename.startswith(pkg_dir):
                    reads.append((key, frame.f_code.co_filename))
                return super().__getitem__(key)

        env = os.environ
        os.environ = Watched(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
        import relayfleet_operator
        names = [m.name for m in pkgutil.walk_packages(relayfleet_operator.__path__, "relayfleet_operator.")]
        names = [n for n in names if n != "relayfleet_operator.__main__"]
        for name in names:
            importlib.import_module(name)
        assert len(names) > 20, names
        print(reads)
        """
    )
    env = {
        **os.environ,
        "RELAYFLEET_OPERATOR_RESYNC_SECONDS": "abc",  # read at import, this would raise
        "RELAYFLEET_OPERATOR_RETRY_SECONDS": "abc",
    }
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
