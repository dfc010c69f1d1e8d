"""`relayfleet bench|dev|demo` come from the relayfleet-testing distribution (tools/), found
through the relayfleet.commands entry points: the relay never imports the tools by name.
(tests/test_release.py runs the built wheel without the tools.)"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from relay import cli


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
        [sys.executable, "-c", "import sys; from relay.cli import main; sys.exit(main())", "nosuch"],
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
