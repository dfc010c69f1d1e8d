"""Metric labels fed by client input stay a bounded set: 300 problem-reports with invented
`@type` families and 300 requests with invented HTTP methods (and six WebDAV ones the HTTP parser
knows) add no series to /metrics and
none of the attacker's text. Before: one series per invented `@type` (300 messages took
/metrics from 31.5 to 112.8 KB) with the attacker's text in it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from tests.hostile.didcomm_attacker import mediated, serving
from tests.hostile.harness import Relay, report, request_answer

pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("metric-labels")]  # one relay per module

MARK = "PLANTEDLABEL"
WEBDAV = ("PROPFIND", "MKCOL", "LOCK", "SEARCH", "PURGE", "REPORT")


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    yield from serving(tmp_path_factory.mktemp("labels"))


async def _metrics(http: aiohttp.ClientSession, relay: Relay) -> str:
    async with http.get(relay.url + "/metrics") as resp:
        return await resp.text()


async def test_invented_types_and_methods_add_no_series(http: aiohttp.ClientSession, relay: Relay) -> None:
    m = await mediated(relay, http)
    # one of each first, so the series an honest client would create exist before measuring
    report_type = "https://didcomm.org/notification/1.0/problem-report"
    await m.agent.send({"@type": report_type, "@id": "warm"}, return_route=False)
    await m.agent.send({"@type": f"https://didcomm.org/{MARK}-0/1.0/problem-report"}, return_route=False)
    await request_answer(relay, f"{MARK}0 /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await request_answer(relay, b"PROPFIND /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await _metrics(http, relay)  # the scrape's own series
    before = await _metrics(http, relay)
    for i in range(1, 301):
        invented = {"@type": f"https://didcomm.org/{MARK}-{i}/1.0/problem-report", "@id": str(i)}
        assert await m.agent.send(invented, return_route=False) is None
    answers = await asyncio.gather(
        *(
            request_answer(
                relay, f"{MARK}{i} /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
            )
            for i in range(1, 301)
        )
    )
    assert all(a.status < 500 for a in answers)
    # methods the HTTP parser knows but the API does not serve share the series "other"
    for method in WEBDAV:
        answer = await request_answer(relay, f"{method} /healthz HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert 400 <= answer.status < 500
    after = await _metrics(http, relay)
    assert MARK not in after
    assert not [method for method in WEBDAV if f'"{method}"' in after]
    assert 'type="other"' in after
    assert 'method="other"' in after
    series = [line.split(" ")[0] for line in before.splitlines() if not line.startswith("#")]
    series_after = [line.split(" ")[0] for line in after.splitlines() if not line.startswith("#")]
    new = sorted(set(series_after) - set(series))
    assert new == []
    report(
        "300 invented @types + 300 invented methods",
        metrics_bytes_before=len(before),
        metrics_bytes_after=len(after),
        new_series=len(new),
    )
