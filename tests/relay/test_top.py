"""`relayfleet top` against a real relay (in-process, real Redis): figures, bad input, a down relay."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis

from relay.client import RelayClient, wait_ready
from relay.shard_health import MONITOR
from relay.top import Scrape, quantile, shard_table, top_main
from tests.support.in_process_relay import RunningRelay
from tests.support.procs import stop_process
from tests.support.prometheus import free_port


async def test_once_shows_rates_relays_and_shards(relay: RunningRelay) -> None:
    stop = asyncio.Event()

    async def traffic() -> None:
        async with relay.client() as c:
            while not stop.is_set():
                r = os.urandom(32)
                await c.enqueue(r, b"x" * 100)
                await c.read(r)
                await asyncio.sleep(0.005)

    task = asyncio.ensure_future(traffic())
    try:
        await asyncio.sleep(0.3)
        # The shard figures come from the relay's own load round, which follows a scrape;
        # run one now rather than rely on gauges an earlier test left in this process.
        async with aiohttp.ClientSession() as http, http.get(relay.base_url + "/metrics") as resp:
            assert resp.status == 200
        await relay.app[MONITOR].tick()
        out = io.StringIO()
        code = await asyncio.to_thread(top_main, [relay.base_url, "http://127.0.0.1:1"], True, out)
    finally:
        stop.set()
        await task
    text = out.getvalue()
    assert code == 0
    assert "1/2 relays answering" in text
    enqueued = float(text.split("enqueued", 1)[1].split("/s", 1)[0])
    assert enqueued > 0
    assert "http://127.0.0.1:1" in text
    assert "down" in text
    shard_rows = text.split("SHARD", 1)[1].splitlines()[1:]
    assert any(" up " in row and "16384" in row for row in shard_rows), text


def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert top_main(["not a url"], once=True) == 2
    assert "not an http(s) URL" in capsys.readouterr().err
    assert top_main([], once=True) == 2


def test_no_relay_answering_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert top_main(["http://127.0.0.1:1"], once=True, out=io.StringIO()) == 1
    assert "no relay answered" in capsys.readouterr().err


def test_quantile_from_bucket_deltas() -> None:
    def scrape(counts: dict[str, float]) -> Scrape:
        s = Scrape("u")
        for le, v in counts.items():
            s.samples[("h_bucket", (("le", le),))] = v
        return s

    before = scrape({"0.1": 10, "1.0": 10, "+Inf": 10})
    after = scrape({"0.1": 60, "1.0": 110, "+Inf": 110})  # 50 under 0.1 s, 50 in (0.1, 1]
    p50 = quantile(0.5, "h", [before], [after])
    p99 = quantile(0.99, "h", [before], [after])
    assert p50 == pytest.approx(0.1)
    assert p99 == pytest.approx(0.1 + 0.9 * 0.98)
    assert quantile(0.5, "h", [after], [after]) is None  # nothing happened in between


def test_unread_and_stale_figures_are_marked() -> None:
    def relay(shard: str, read_at: float | None) -> Scrape:
        s = Scrape("http://r")
        s.samples[("relayfleet_shard_up", (("shard", shard),))] = 1.0
        if read_at is not None:
            for name, value in [
                ("relayfleet_shard_messages", 4000.0),
                ("relayfleet_shard_slots", 8192.0),
                ("relayfleet_shard_stats_last_success_timestamp_seconds", read_at),
            ]:
                s.samples[(name, (("shard", shard),))] = value
        return s

    now = 1_000_000.0
    rows = shard_table([relay("fresh", now - 3), relay("old", now - 100), relay("new", None)], now)
    by_shard = {row.split()[0]: row.split() for row in rows[1:4]}
    assert by_shard["fresh"][2] == "4000"
    assert (by_shard["fresh"][6], by_shard["fresh"][8]) == ("8192", "3s")
    assert by_shard["old"][8] == "100s*"
    assert by_shard["new"][2:9] == ["-"] * 7  # not 0: not read yet
    assert any(line.startswith("- not read yet") for line in rows)
    assert any(line.startswith("* stale") for line in rows)


def test_once_on_a_fresh_relay_shows_what_the_fleet_holds(redis_server: LocalRedis) -> None:
    # a relay process nobody scraped before: --once waits for its first load read
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relay",
            "--port",
            str(port),
            "--redis-url",
            redis_server.url,
            "--auth",
            "none",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, 30))

        async def fill() -> None:
            async with RelayClient(url) as c:
                for _ in range(40):
                    await c.enqueue(os.urandom(32), b"held")

        asyncio.run(fill())
        out = subprocess.run(
            [sys.executable, "-c", TOP, url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop_process(proc, grace=10)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("default "))
    cells = row.split()
    assert (cells[2], cells[6]) == ("40", "16384"), out.stdout


TOP = "import sys; from relay.cli import main; sys.exit(main(['top', '--once', sys.argv[1]]))"
