"""A shard whose name cannot be resolved while DNS does not answer (a cluster whose DNS server
is not up yet): the relay says it cannot connect, and nothing else. A connect cut short by our
timeout while the name was being resolved left a future behind on uvloop, logged as "Future
exception was never retrieved ... gaierror". The relay runs as `relayfleet relay` does (on
uvloop), in a mount namespace whose /etc/resolv.conf names a DNS server that never answers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from relayfleet_testing.localredis import free_port

SILENT_DNS = "127.0.0.77"


@pytest.fixture
def silent_dns() -> Iterator[None]:
    """A DNS server that takes every query and never answers."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        udp.bind((SILENT_DNS, 53))
    except OSError as exc:
        udp.close()
        pytest.skip(f"cannot serve DNS on {SILENT_DNS}:53 ({exc.strerror}): needs root")
    udp.settimeout(0.2)
    done = threading.Event()

    def swallow() -> None:
        while not done.is_set():
            try:
                udp.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=swallow, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(2)
        udp.close()


def _private_resolv_conf_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def test_an_unresolvable_shard_leaves_no_unretrieved_future(silent_dns: None, tmp_path: Path) -> None:
    if not _private_resolv_conf_works():
        pytest.skip("needs root and unshare -m (a private /etc/resolv.conf for the relay)")
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {SILENT_DNS}\noptions timeout:3 attempts:1\n")
    port = free_port()
    relay = [sys.executable, "-m", "relay", "--port", str(port), "--auth", "none"]
    relay += ["--redis-url", "redis://shard-a.relayfleet.test:6379/0"]
    script = f"mount --bind {resolv} /etc/resolv.conf && exec {' '.join(relay)}"
    env = {**os.environ, "RELAY_SHARD_HEALTH_INTERVAL_S": "1"}
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script], stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 60
        while _get(f"http://127.0.0.1:{port}/healthz") != 200:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        # Readiness probes, health rounds and requests, each cut short while the name resolves.
        until = time.monotonic() + 12
        while time.monotonic() < until:
            assert _get(f"http://127.0.0.1:{port}/readyz") == 503
            _get(f"http://127.0.0.1:{port}/metrics")
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "shard-a.relayfleet.test" in text or "cannot connect" in text, text
    assert "never retrieved" not in text, text
