"""Smoke tests of the benchmark harness: generators, process handling, report. Not performance."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from relayfleet_testing.bench import main, report, scenarios, targets, wrk
from relayfleet_testing.bench.loadgen import Conn, _dechunk, closed_loop
from relayfleet_testing.bench.procs import BenchError, Procs, free_port, wait_port
from relayfleet_testing.bench.results import Results, Row, percentile
from relayfleet_testing.localredis import LocalRedis

from relay.storage.store import QueueLimits
from tests.conftest import RelayFactory

WRK_MISSING = not Path(wrk.WRK).exists()


@pytest.fixture
def procs(tmp_path: Path) -> Procs:
    return Procs(tmp_path)


@pytest.fixture
async def ceiling(procs: Procs) -> AsyncIterator[targets.Target]:
    try:
        yield await targets.start_ceiling(procs, 1)
    finally:
        procs.stop_all()


def relay_target(base_url: str) -> targets.Target:
    port = urlsplit(base_url).port
    assert port is not None
    return targets.Target("relay-test", "relay", [port])


# -- process handling ----------------------------------------------------------------------


def test_stop_all_ends_every_child_by_pid(procs: Procs) -> None:
    children = [procs.start("sleeper", ["sleep", "30"]) for _ in range(3)]
    procs.stop_all()
    for child in children:
        assert child.popen.returncode is not None
        assert (
            not os.path.exists(f"/proc/{child.pid}")
            or "zombie" in Path(f"/proc/{child.pid}/status").read_text()
        )
    assert procs.running() == []


def test_a_child_ignoring_sigterm_is_killed(procs: Procs) -> None:
    child = procs.start(
        "stubborn",
        [
            sys.executable,
            "-c",
            "import signal,time; signal.signal(15, signal.SIG_IGN); print('x', flush=True); time.sleep(30)",
        ],
    )
    deadline = time.monotonic() + 5
    while not child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)  # the handler is installed once it printed
    started = time.monotonic()
    procs.stop(child, timeout=0.3)
    assert child.popen.returncode == -9
    assert time.monotonic() - started < 3


async def test_a_server_that_dies_is_a_clear_error(procs: Procs) -> None:
    child = procs.start("broken", [sys.executable, "-c", "import sys; print('bad config'); sys.exit(3)"])
    with pytest.raises(BenchError, match=r"broken exited with status 3 before listening:\nbad config"):
        await wait_port(free_port(), child, within=5)


def test_missing_binary_is_a_clear_error(procs: Procs) -> None:
    with pytest.raises(BenchError, match="cannot start ghost"):
        procs.start("ghost", ["/nonexistent/ghost"])


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-such-flag"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


# -- the own generator ---------------------------------------------------------------------


def test_chunked_bodies_decode_only_when_complete() -> None:
    raw = bytearray(b"HEAD\r\n\r\n4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\n\r\nNEXT")
    assert _dechunk(raw, 8) == (b"abcdefg", len(raw) - 4)
    assert _dechunk(bytearray(b"4\r\nab"), 0) is None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 1001)]
    assert percentile(values, 50) == 500
    assert percentile(values, 99) == 990
    assert percentile(values, 99.9) == 999
    assert percentile([7.0], 99.9) == 7


async def test_own_generator_against_the_ceiling(ceiling: targets.Target) -> None:
    conn = await Conn.open("127.0.0.1", ceiling.ports[0])
    try:
        resp = await conn.request("POST", "/v1/queues/abc/messages", b"x" * 70000)
        assert resp.status == 201
        assert resp.body == b'{"seq":1,"duplicate":false}'
    finally:
        conn.close()
    req = b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n"
    result = await closed_loop("127.0.0.1", ceiling.ports, lambda _: req, 4, 0.3)
    assert result.requests > 50
    assert result.errors == 0


async def test_wake_probes_against_the_ceiling(ceiling: targets.Target) -> None:
    values = await scenarios.wake_probes(ceiling, 5, 256, 0.003)
    assert values["probes"] == 5
    assert values["missed"] == 0
    assert 0 <= values["p50_ms"] < 1000


async def test_longpoll_memory_and_wakeups_on_a_real_relay(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url)
    target = relay_target(relay.base_url)
    target.children = []  # in-process: RSS is this test process's; only the plumbing is checked
    idle = scenarios.IdlePolls(target)
    try:
        await idle.grow(20)
        await asyncio.sleep(0.2)
        values = await scenarios.wake_probes(target, 10, 256, 0.003)
    finally:
        await idle.close()
    assert values["probes"] == 10
    assert values["missed"] == 0
    assert idle.early == 0


async def test_read_ack_drains_every_prefilled_message(
    redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    relay = await relay_factory(redis_server.url)
    row = await scenarios.read_ack(relay_target(relay.base_url), redis_server.url, 10, 400, 4)
    assert row.values["messages"] == 400
    assert row.values["rate"] > 0


# -- wrk -----------------------------------------------------------------------------------


def test_lua_literals_escape_quotes_backslashes_and_binary() -> None:
    script = wrk.lua_script("POST", ["/a]]b"], [b'{"x":"]]"}', b"\\\x00\xff"], {"K": "v"})
    assert '"/a]]b"' in script
    assert '"{\\034x\\034:\\034]]\\034}"' in script
    assert '"\\092\\000\\255"' in script


@pytest.mark.skipif(WRK_MISSING, reason="wrk is not installed")
async def test_wrk_enqueue_run_against_the_ceiling(procs: Procs, ceiling: targets.Target) -> None:
    run = scenarios.Run(procs, 1, 0)
    row = await scenarios.enqueue(run, ceiling, 4096, 4)
    assert row.values["rate"] > 50
    assert row.values["errors"] == 0
    assert row.values["p99_ms"] >= row.values["p50_ms"] > 0


@pytest.mark.skipif(WRK_MISSING, reason="wrk is not installed")
async def test_wrk_fanout_counts_per_recipient_refusals(
    procs: Procs, redis_server: LocalRedis, relay_factory: RelayFactory
) -> None:
    # one message per queue per window: every reuse of a body is refused per recipient
    relay = await relay_factory(redis_server.url, limits=QueueLimits(rate_count=1))
    row = await scenarios.fanout(scenarios.Run(procs, 1, 0), relay_target(relay.base_url), 256, 3, 2)
    assert row.values["rate"] > 0
    assert row.values["errors"] == 0
    assert row.values["inner_errors"] > 0
    assert row.note.startswith("a sample request got 200")


def test_wrk_output_parsing_sums_instances() -> None:
    line = (
        'WRKJSON {"requests":%d,"duration_us":2000000,"bytes":1,"connect":0,"read":0,"write":0,'
        '"status":%d,"timeout":0,"p50_us":1000,"p90_us":2000,"p99_us":%d,"max_us":9000,"inner":0}'
    )
    parts = [wrk.parse_output("noise\n" + line % (100, 0, 3000)), wrk.parse_output(line % (300, 10, 5000))]
    res = wrk.combine(parts)
    assert res.requests == 400
    assert res.errors == 10
    assert res.ok_rate == pytest.approx(195)
    assert res.p99_ms == 5
    with pytest.raises(BenchError):
        wrk.parse_output("Running 1s test")


# -- configuration and report ---------------------------------------------------------------


def test_nchan_config_is_rendered_not_edited(tmp_path: Path) -> None:
    template = targets.NCHAN_CONF.read_text() if targets.NCHAN_CONF.exists() else _MINI_NCHAN
    text = targets.render_nchan_conf(template, tmp_path, 4321, "redis://127.0.0.1:9/0", 19000, 4096)
    assert "${" not in text
    assert "listen 127.0.0.1:4321;" in text
    assert "worker_connections 19000;" in text
    assert "nchan_max_reserved_memory 4096M;" in text
    assert "location = /bench/static" in text
    with pytest.raises(BenchError, match="unknown variable"):
        targets.render_nchan_conf(template + "${OTHER}", tmp_path, 1, "redis://x", 1, 1)


_MINI_NCHAN = """events { worker_connections 8192; }
http {
  nchan_max_reserved_memory 256M;
  upstream r { nchan_redis_server ${REDIS_URL}; }
  server {
    listen 127.0.0.1:${PORT};
    client_body_temp_path ${PREFIX}/tmp-body;
  }
}
"""


def _results() -> Results:
    res = Results()
    for target, rate in (("relay-1p", 9000.0), ("aiohttp-1p", 20000.0), ("nchan-redis", 15000.0)):
        res.add(
            Row("enqueue", target, {"size": 256, "conns": 64}, {"rate": rate, "p50_ms": 1.0, "p99_ms": 5.0})
        )
    res.add(Row("limit", "redis XADD", {"size": 256, "conns": 64}, {"rate": 300000.0}))
    res.add(
        Row(
            "longpoll",
            "relay-1p",
            {"idle": 10000, "size": 256},
            {"p50_ms": 0.5, "p99_ms": 3.0, "p999_ms": 4.0, "rss_per_poll_kib": 9.5, "probes": 1000.0},
        )
    )
    res.skip("live", "relay-1p", "WebSocket handshake answered 404")
    return res


def test_report_shows_ratios_targets_and_skips() -> None:
    text = report.render(
        _results(), "quick", "relayfleet bench --quick", {"CPU": "test"}, "now", 12.0, 64, ["n"]
    )
    assert "| relay-1p | 256 B | 9,000 | 0.03 | - | 0.45 (aiohttp-1p) | 0.60 |" in text
    assert "| enqueue 256 B, relay-1p | ≥ 15,000 msg/s | 9,000 | missed (at 0.60 of goal) |" in text
    assert "| RSS per idle poll (10,000) | ≤ 15.0 KiB | 9.5 | met |" in text
    assert "- live / relay-1p: WebSocket handshake answered 404" in text


def test_report_write_keeps_hand_written_text(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.md"
    report.write(path, "quick", "first\n")
    path.write_text(path.read_text() + "\n## Analysis\n\nhand-written\n")
    report.write(path, "quick", "second\n")
    report.write(path, "full", "full run\n")
    text = path.read_text()
    assert "first" not in text
    assert text.count("second") == 1
    assert "hand-written" in text
    assert "full run" in text


def test_bench_writes_under_the_current_directory_not_next_to_the_module(tmp_path: Path) -> None:
    from relayfleet_testing.bench.runner import default_output

    assert default_output(tmp_path) == tmp_path / "benchmarks.md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    assert default_output(tmp_path) == tmp_path / "docs" / "benchmarks.md"
