"""A real Prometheus (/usr/bin/prometheus) on a free port, scraping given targets every second with the
chart's rendered alert rules (RelayfleetShardRedisDown's `for` cut to 2 s), and a subprocess whose
output a test can wait on."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart import helm_binary
from tests.support.observability import PROMETHEUS, alert_rules, rendered_rule_groups
from tests.support.procs import stop_process

FAST_ALERT = "RelayfleetShardRedisDown"  # its `for` is cut to 2 s so a test sees it fire


# Prometheus and the chart's rendered rules (helm) are needed by every live observability test.
NEEDS_PROMETHEUS = [
    pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="apt-get install prometheus"),
    pytest.mark.skipif(helm_binary() is None, reason="helm not built yet: run hack/control-plane.sh"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        try:
            for line in self.popen.stdout:
                self.lines.append(line.rstrip("\n"))
        except (ValueError, OSError):
            pass  # the pipe was closed under us at teardown: nothing more to read

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {needle!r} within {timeout}s; output:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        stop_process(self.popen, 20)
        self._reader.join(10)  # EOF once the process (and its children holding the pipe) ended
        if self.popen.stdout is not None and not self._reader.is_alive():
            self.popen.stdout.close()


@dataclass
class Prometheus:
    url: str

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url + path + query, timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = (
            data["result"] if data["resultType"] in ("vector", "matrix") else [data]
        )
        return result


@contextlib.contextmanager
def run_prometheus(tmp_path: Path, targets: list[str]) -> Iterator[Prometheus]:
    """/usr/bin/prometheus on a free port: 1 s scrapes of `targets` (host:port), the chart's
    rendered rules evaluated every second."""
    groups = rendered_rule_groups()
    for rule in alert_rules(groups):
        if rule["alert"] == FAST_ALERT:
            rule["for"] = "2s"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [{"job_name": "relayfleet", "static_configs": [{"targets": targets}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    popen = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc = Proc(popen)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60  # a starting TSDB on a loaded machine
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(prom.url + "/-/ready", timeout=1) as resp,
            ):
                if resp.status == 200:
                    break
            assert popen.poll() is None, "\n".join(proc.lines)
            assert time.monotonic() < deadline, "prometheus not ready:\n" + "\n".join(proc.lines)
            time.sleep(0.2)
        yield prom
    finally:
        proc.stop()


def wait_until(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last})")
