"""The client example in README.md and docs/api.md runs as written: a real `relayfleet relay`
process on a real redis-server, the block executed by a fresh interpreter, its output checked."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.client import wait_ready
from tests.support.procs import stop_process
from tests.support.prometheus import free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def example(page: str) -> str:
    blocks = [b for b in BLOCK.findall((ROOT / page).read_text()) if "RelayClient(" in b]
    assert len(blocks) == 1, f"{page}: expected one client example, found {len(blocks)}"
    return str(blocks[0])


def test_readme_and_api_md_show_the_same_example() -> None:
    code = example("README.md")
    assert code == example("docs/api.md")
    assert len([line for line in code.splitlines() if line.strip()]) <= 11


@pytest.fixture
def relay_url(redis_server: LocalRedis) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--port", str(port), "--redis-url", redis_server.url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, timeout=30))
        yield url
    finally:
        stop_process(proc, grace=10)


def test_the_example_runs_as_written(relay_url: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(example("README.md"))
    env = dict(os.environ, RELAY_URL=relay_url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `relayfleet keygen`
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[b'ciphertext for me']\n"
