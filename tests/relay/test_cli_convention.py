"""One convention for every `relayfleet` subcommand (docs/api.md, "Command line"): a usage or
configuration error is one line on stderr naming the command, exit 2 (a port in use included);
a runtime failure exits 1 with a one-line reason; never a traceback; `--help` is clean. Each
case runs the real command in a fresh interpreter."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay import cli
from tests.support.procs import RELAYFLEET
from tests.support.prometheus import free_port


def commands() -> list[str]:
    """Every subcommand `relayfleet --help` offers (its usage line: {relay,migrate,...})."""
    usage = cli.build_parser().format_usage()
    return sorted(usage[usage.index("{") + 1 : usage.index("}")].split(","))


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "KUBECONFIG"))}
    full_env.update(env or {})
    return subprocess.run([*RELAYFLEET, *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, command: str) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert lines, "no reason given"
    assert lines[-1].startswith(f"relayfleet {command}: "), lines[-1]
    return lines[-1]


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def down_map(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A shard map whose shards' Redis servers are not running."""
    path = tmp_path_factory.mktemp("down") / "map.json"
    shards = {name: {"redis": f"redis://127.0.0.1:{free_port()}/0"} for name in "ab"}
    path.write_text(json.dumps({"fleet": "f", "epoch": 1, "shards": shards, "slots": [[0, 16383, "a"]]}))
    return str(path)


def test_every_subcommand_is_covered() -> None:
    assert set(commands()) == {
        "relay", "migrate", "plan", "keygen", "operator", "backup", "restore", "top", "bench", "dev", "demo"
    }  # fmt: skip


@pytest.mark.parametrize("command", commands())
def test_help_is_clean(command: str) -> None:
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.startswith(f"usage: relayfleet {command}")


def test_top_level_help_lists_commands_without_flag_notes() -> None:
    out = run("--help")
    assert out.returncode == 0
    assert "[no env" not in out.stdout
    for command in commands():
        assert f"    {command} " in out.stdout


@pytest.mark.parametrize("command", commands())
def test_an_unknown_flag_is_one_line_exit_2(command: str) -> None:
    out = run(command, "--no-such-flag")
    line = assert_one_line(out, 2, command)
    assert out.stderr.strip() == line
    assert "--no-such-flag" in line or "arguments are required" in line


def configuration_errors(port: int, tmp: Path) -> list[tuple[str, tuple[str, ...], dict[str, str], str]]:
    nowhere = str(tmp / "nowhere")
    return [
        ("relay", ("--port", str(port), "--redis-url", "redis://127.0.0.1:1/0"), {}, "already in use"),
        ("relay", ("--port", "70000"), {}, "must be a port number"),
        ("relay", (), {}, "required"),
        ("migrate", ("--slots", "0-9", "--to", "b"), {}, "one of --shard-map or --shard-map-configmap"),
        ("migrate", ("--slots", "0-9", "--to", "b"), {"RELAY_SHARD_MAP": nowhere}, "cannot read shard map"),
        ("migrate", ("--shard-map-configmap", "nons", "--slots", "0", "--to", "b"), {}, "NAMESPACE/NAME"),
        ("plan", (), {}, "one of --shard-map or --shard-map-configmap"),
        ("plan", ("--shard-map", nowhere), {}, "cannot read shard map"),
        ("keygen", ("extra",), {}, "unrecognized arguments"),
        ("operator", ("--namespace", "x"), {"KUBECONFIG": nowhere}, "no usable Kubernetes configuration"),
        ("top", ("notaurl",), {}, "not an http(s) URL"),
        ("top", ("--kube", "--once", "--kubeconfig", nowhere), {}, "no usable Kubernetes configuration"),
        ("backup", ("--shard", "a", "--to", nowhere), {}, "--redis-url"),
        ("restore", ("--from", nowhere), {}, "--redis-url"),
        ("demo", ("--url", "notaurl"), {}, "not an http(s) URL"),
        ("demo", ("--url", "127.0.0.1:8080"), {}, "not an http(s) URL"),
        ("demo", ("--url", "http://127.0.0.1:8080/v1"), {}, "without /v1"),
        ("dev", ("--port", str(port), "--no-demo"), {}, f"port {port} is already in use"),
        ("dev", ("--redis-port", str(port), "--no-demo"), {}, f"port {port} is already in use"),
        ("bench", ("--quick", "--quick=x"), {}, "--quick"),
    ]


@pytest.mark.parametrize("case", range(20))
def test_configuration_errors_are_one_line_exit_2(case: int, taken_port: int, tmp_path: Path) -> None:
    cases = configuration_errors(taken_port, tmp_path)
    assert len(cases) == 20
    command, args, env, text = cases[case]
    out = run(command, *args, env=env)
    line = assert_one_line(out, 2, command)
    assert text in line
    assert out.stderr.strip() == line  # at once: nothing started, nothing logged


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("migrate", ("--slots", "0-9", "--to", "b")),
        ("plan", ()),
        ("top", ("--once", "http://127.0.0.1:{port}")),
        ("backup", ("--redis-url", "redis://127.0.0.1:{port}/0", "--shard", "a", "--to", "{tmp}/backup")),
        ("demo", ("--url", "http://127.0.0.1:{port}")),
    ],
)
def test_runtime_failures_exit_1_with_a_one_line_reason(
    command: str, args: tuple[str, ...], down_map: str, tmp_path: Path
) -> None:
    port = free_port()
    argv = [a.format(port=port, tmp=tmp_path) for a in args]
    out = run(command, *argv, env={"RELAY_SHARD_MAP": down_map})
    assert_one_line(out, 1, command)
