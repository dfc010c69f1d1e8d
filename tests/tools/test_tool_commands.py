"""`relayfleet bench|dev|demo` come from the relayfleet-testing distribution (tools/), found
through the relayfleet.commands entry points: the relay never imports the tools by name.
(tests/project/test_release.py runs the built wheel without the tools.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from relay import cli
from tests.support.procs import RELAYFLEET, stop_process
from tests.support.prometheus import free_port


def test_the_tools_register_bench_dev_and_demo() -> None:
    found = {ep.name: ep for ep in entry_points(group=cli.COMMANDS_GROUP)}
    assert set(cli.TOOL_COMMANDS) <= set(found)
    for name in cli.TOOL_COMMANDS:
        ep = found[name]
        assert ep.dist is not None
        assert ep.dist.name == cli.TOOLS_DIST
        assert ep.value.startswith("relayfleet_testing.")
        assert callable(ep.load())


@pytest.mark.parametrize("command", sorted(cli.TOOL_COMMANDS))
def test_a_missing_tool_command_is_one_line_and_exit_2(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_plugin_commands", dict)
    assert cli.main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"`{command}` comes with the tools: pip install relayfleet-testing" in err


def test_an_unknown_command_is_still_argparse_s_one_line() -> None:
    out = subprocess.run(
        [*RELAYFLEET, "nosuch"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("relayfleet: argument command: invalid choice: 'nosuch'")


@pytest.mark.parametrize(
    ("module", "usage"),
    [
        ("relayfleet_testing.bench", "usage: relayfleet bench"),
        ("relayfleet_testing.devfleet", "usage: relayfleet dev"),
    ],
)
def test_the_tools_run_without_the_relayfleet_command(module: str, usage: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(usage)


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        found |= kids
        todo.extend(kids)
    return found


def test_dev_fleet_stopped_by_sigterm_leaves_no_process_behind() -> None:
    # a supervisor or a test stops `relayfleet dev` with SIGTERM: its relay and Redis go too,
    # and so does its folder (shard map, Redis data); its Redis port is the one asked for
    port, redis_port = str(free_port()), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayfleet_testing.devfleet",
            "--shards",
            "1",
            "--no-demo",
            "--port",
            port,
            "--auth",
            "none",
            "--redis-port",
            str(redis_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "relay ready" in line:
                break
        assert any(f"a=redis://127.0.0.1:{redis_port}/0" in line for line in seen), seen
        map_line = next(line for line in seen if line.startswith("shard map: "))
        workdir = Path(map_line.split()[2]).parent
        assert workdir.name.startswith("relayfleet-dev-")
        assert workdir.is_dir()
        children = _descendants(proc.pid)
        assert len(children) >= 2, children  # the relay and a redis-server
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        alive = {p for p in children if os.path.exists(f"/proc/{p}")}
        assert not alive, f"left running: {alive}"
        assert not workdir.exists(), f"left behind: {workdir}"
    finally:
        stop_process(proc, 10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_dev_does_not_take_another_process_on_its_port_for_its_relay() -> None:
    # another process answers /readyz on the port: dev says the port is taken, at once
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "relayfleet_testing.devfleet", "--no-demo", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert out.stderr == f"relayfleet dev: --port: port {port} is already in use\n"
    assert "relay ready" not in out.stdout
