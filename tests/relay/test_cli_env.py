"""The CLI's configuration surface: every flag names its variable and default, bad values exit 2
with one line, deprecated names still work (with a log line), Settings read the environment once."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay import cli
from relay.envconfig import resolve_flags
from relay.settings import DEPRECATED_ENV, RELAY_SETTINGS, REMOVED_ENV, Settings
from tests.support.in_process_relay import RelayFactory
from tests.support.procs import RELAYFLEET


def test_every_flag_of_every_subcommand_names_its_variable_and_default() -> None:
    """As written in relay/cli.py, not as EnvHelpParser completes it: the code names them."""
    for name, parser in cli.subcommand_parsers().items():
        for action, written in parser.flags_as_written:
            if not action.option_strings and not written:
                continue
            assert written, (name, action.dest)
            assert "[env " in written or "[no env" in written, (name, action.dest)
            assert "default" in written or "required" in written, (name, action.dest)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "RELAYFLEET_"))}
    full.update(env or {})
    return subprocess.run(
        [*RELAYFLEET, *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_relay_help_lists_every_variable() -> None:
    out = run_cli("relay", "--help")
    assert out.returncode == 0
    for flag_env in ("RELAY_HOST", "RELAY_PORT", "RELAY_REDIS_URL", "RELAY_AUTH", "RELAY_LOG_LEVEL"):
        assert f"env {flag_env}" in out.stdout
    for var in RELAY_SETTINGS:
        for name in var.names:
            assert name in out.stdout
    relay_names = {v.env for v in RELAY_SETTINGS}
    for old, new in DEPRECATED_ENV.items():
        assert (f"{old} -> {new}" in out.stdout) == (new in relay_names)
    for removed in REMOVED_ENV:
        assert removed in out.stdout
    assert "default 8080" in out.stdout


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"RELAY_PORT": "abc"}, (), "relayfleet relay: RELAY_PORT must be a port number, got 'abc'"),
        ({"RELAY_AUTH": "basic"}, (), "relayfleet relay: RELAY_AUTH must be ed25519 or none, got 'basic'"),
        ({}, ("--port", "70000"), "relayfleet relay: --port must be a port number, got '70000'"),
        (
            {"RELAY_MAX_PAYLOAD": "lots"},
            ("--redis-url", "redis://127.0.0.1:1/0"),
            "relayfleet relay: RELAY_MAX_PAYLOAD must be an integer, got 'lots'",
        ),
        (
            {"RELAY_SHARD_HEALTH_INTERVAL_S": "nan"},
            ("--redis-url", "redis://127.0.0.1:1/0"),
            "relayfleet relay: RELAY_SHARD_HEALTH_INTERVAL_S must be a number, got 'nan'",
        ),
        (
            {"RELAY_REDIS_URL": "rediss://u:secret@h:1/0?ssl_ca_cert=/ca.pem"},
            (),
            "relayfleet relay: unknown Redis URL option 'ssl_ca_cert'",
        ),
    ],
)
def test_bad_values_exit_2_with_one_line(env: dict[str, str], args: tuple[str, ...], message: str) -> None:
    out = run_cli("relay", *args, env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == message  # one line, no traceback, no secret


def test_bad_value_of_another_subcommand_does_not_matter() -> None:
    out = run_cli("keygen", env={"RELAY_PORT": "abc"})
    assert out.returncode == 0, out.stderr


def test_settings_read_the_environment_only_in_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_BODY_TIMEOUT_S", "1.5")
    monkeypatch.setenv("RELAY_FLEET", "blue")
    monkeypatch.setenv("RELAY_MAX_WAITERS", "7")
    assert Settings().body_timeout_s == 30.0  # a plain dataclass: no env reads in defaults
    s = Settings.from_env(port=9000)
    assert (s.body_timeout_s, s.fleet_name, s.max_waiters, s.port) == (1.5, "blue", 7, 9000)


def test_deprecated_names_still_work_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import relay.envconfig

    monkeypatch.setattr(relay.envconfig, "_warned", set())
    monkeypatch.setenv("RELAYFLEET_SHARD_HEALTH_INTERVAL", "7")
    with caplog.at_level(logging.WARNING, logger="relay.settings"):
        assert Settings.from_env().shard_health_interval_s == 7.0
    assert "RELAYFLEET_SHARD_HEALTH_INTERVAL is deprecated: set RELAY_SHARD_HEALTH_INTERVAL_S" in caplog.text
    monkeypatch.setenv("RELAY_SHARD_HEALTH_INTERVAL_S", "9")  # the new name wins
    assert Settings.from_env().shard_health_interval_s == 9.0


def test_removed_names_are_ignored_with_a_log_line_naming_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import relay.envconfig

    monkeypatch.setattr(relay.envconfig, "_warned", set())
    monkeypatch.setenv("RELAY_BUSY_POLL_US", "not-a-number-s3cret")  # not parsed: it is gone
    monkeypatch.setenv("RELAY_BUSY_POLL_SHARE", "1")
    with caplog.at_level(logging.WARNING, logger="relay.settings"):
        s = Settings.from_env()
        Settings.from_env()  # once per process, not per read
    assert not hasattr(s, "busy_poll_us")
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(m.split(" ")[0] for m in lines) == ["RELAY_BUSY_POLL_SHARE", "RELAY_BUSY_POLL_US"]
    assert all("is ignored: busy-polling was removed" in m for m in lines)
    assert "s3cret" not in caplog.text  # the name, never the value


def test_operator_namespace_new_and_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = run_cli("operator", "--help")
    assert "env RELAYFLEET_OPERATOR_NAMESPACE" in " ".join(shown.stdout.split())
    monkeypatch.setenv("RELAY_OPERATOR_NAMESPACE", "old")
    args = cli.build_parser().parse_args(["operator"])
    resolve_flags(args)
    assert args.namespace == "old"
    monkeypatch.setenv("RELAYFLEET_OPERATOR_NAMESPACE", "new")
    args = cli.build_parser().parse_args(["operator"])
    resolve_flags(args)
    assert args.namespace == "new"


@pytest.mark.parametrize(
    "command", ["relay", "dev", "demo", "migrate", "operator", "top", "plan", "bench", "backup", "restore"]
)
def test_every_flag_in_every_help_screen_names_env_and_default(command: str) -> None:
    out = run_cli(command, "--help")
    assert out.returncode == 0, out.stderr
    options = out.stdout.split("options:", 1)[1].split("\n\n", 1)[0]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", options) if e.strip()]
    entries = [e for e in entries if not e.startswith("-h,")]
    assert entries
    for entry in entries:
        assert re.search(r"\b(no )?env\b", entry), entry
        assert "default" in entry or "required" in entry, entry


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"RELAYFLEET_OPERATOR_RESYNC_SECONDS": "abc"},
            "relayfleet operator: RELAYFLEET_OPERATOR_RESYNC_SECONDS must be a number, got 'abc'",
        ),
        (
            {"RELAYFLEET_OPERATOR_HEALTH_PORT": "99999"},
            "relayfleet operator: RELAYFLEET_OPERATOR_HEALTH_PORT must be a port number, got 99999",
        ),
    ],
)
def test_bad_operator_values_exit_2_before_the_operator_starts(env: dict[str, str], message: str) -> None:
    out = run_cli("operator", "--namespace", "x", env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == message


async def test_relay_reads_shard_credentials_from_the_dir_settings_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relay_factory: RelayFactory
) -> None:
    """RELAY_REDIS_CREDENTIALS_DIR, read once into Settings, gives the fleet the full URL
    (with the password) the shard map leaves out."""
    server = LocalRedis(binary="/usr/bin/redis-server", password="from-the-secret").start()
    try:
        (tmp_path / "default").write_text(server.url + "\n")
        monkeypatch.setenv("RELAY_REDIS_CREDENTIALS_DIR", str(tmp_path))
        relay = await relay_factory(f"redis://127.0.0.1:{server.port}/0")  # no password in the map
        assert relay.settings.credentials_dir == str(tmp_path)
        async with relay.client() as c:
            assert await c.enqueue(os.urandom(32), b"x") == (1, False)
    finally:
        server.stop()


def test_operator_and_other_help_screens_name_every_variable_they_read() -> None:
    from relayfleet_operator.config import OPERATOR_SETTINGS

    from relay.settings import COMMAND_SETTINGS

    out = run_cli("operator", "--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for var in OPERATOR_SETTINGS:
        assert any(ln.split()[:1] == [var.env] and f"[default {var.shown_default}]" in ln for ln in lines), (
            var.env
        )
    top = " ".join(run_cli("top", "--help").stdout.split())
    for var in COMMAND_SETTINGS:
        assert f"env {var.env}; default {var.shown_default}" in top, var.env
