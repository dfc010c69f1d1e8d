"""Query integers: `[0-9]+` only, clamped above their maximum, never a 500.

On read, drain, live and inbox: `--1`, `-1`, `+1`, `1e3`, ` 1`, `0x10`, `1_0`, digits
beyond what int() parses (over 4300) all get a 400 JSON or a clamped value.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.hostile.harness import SECRET_INBOX_ID, Relay, RelayWith, http, recipient, request_answer

pytestmark = pytest.mark.timeout(120)

BAD_INTEGERS = ["--1", "-1", "+1", "1e3", "%201", "0x10", "1_0", "1.5", "%EF%BC%91", "1%00", "abc"]


def _paths(query: str) -> list[tuple[str, str]]:
    r = recipient(21)
    return [
        ("GET", f"/v1/queues/{r}/messages?{query}"),
        ("POST", f"/v1/queues/{r}/drain?{query}"),
        ("GET", f"/v1/inbox/messages?{query}"),
    ]


@pytest.mark.parametrize("value", BAD_INTEGERS)
@pytest.mark.parametrize("name", ["fromSeq", "limit"])
async def test_non_digit_integers_are_400_json(hostile_relay: Relay, name: str, value: str) -> None:
    for method, path in _paths(f"{name}={value}"):
        if name == "fromSeq" and "drain" in path:
            continue  # drain takes no fromSeq
        answer = await request_answer(
            hostile_relay, http(method, path, headers={"X-Inbox-ID": SECRET_INBOX_ID})
        )
        assert answer.status == 400, (method, path, answer)
        assert answer.json()["code"] == "bad_request", answer


@pytest.mark.parametrize("value", ["--1", "-1", "1e3", "inf", "nan", "1_0", "0x1"])
async def test_bad_wait_is_400_json(hostile_relay: Relay, value: str) -> None:
    answer = await request_answer(
        hostile_relay, http("GET", f"/v1/queues/{recipient(22)}/messages?wait={value}")
    )
    assert answer.status == 400, answer
    assert answer.json()["code"] == "bad_request", answer


async def test_fractional_and_huge_wait_are_clamped(hostile_relay: Relay) -> None:
    r = recipient(23)
    await request_answer(hostile_relay, http("POST", f"/v1/queues/{r}/messages", b"x"))
    for value in ("0.25", ".5", "1.", "9" * 5000):
        answer = await request_answer(hostile_relay, http("GET", f"/v1/queues/{r}/messages?wait={value}"))
        assert answer.status == 200, (value[:20], answer)


async def test_huge_limit_is_clamped_to_1000(relay_with: RelayWith) -> None:
    relay = relay_with({"RELAY_RATE_LIMIT": "5000"})
    r = recipient(24)
    async with aiohttp.ClientSession() as session:

        async def put(i: int) -> int:
            async with session.post(f"{relay.url}/v1/queues/{r}/messages", data=b"m%d" % i) as resp:
                return resp.status

        for start in range(0, 1001, 100):
            statuses = await asyncio.gather(*(put(i) for i in range(start, min(start + 100, 1001))))
            assert set(statuses) == {201}
    for value in ("99999999999999999999", "9" * 5000, "0" * 30 + "5000"):
        answer = await request_answer(
            relay, http("GET", f"/v1/queues/{r}/messages?limit={value}"), timeout=30
        )
        assert answer.status == 200, (value[:20], answer)
        assert len(answer.json()["messages"]) == 1000
    inbox = await request_answer(
        relay,
        http("GET", "/v1/inbox/messages?limit=99999999999999999999&fromSeq=99999999999999999999",
             headers={"X-Inbox-ID": SECRET_INBOX_ID}),
    )  # fmt: skip
    assert inbox.status == 200
    assert inbox.json()["messages"] == []
    relay.assert_log_clean()


async def test_huge_from_seq_reads_nothing(hostile_relay: Relay) -> None:
    r = recipient(25)
    await request_answer(hostile_relay, http("POST", f"/v1/queues/{r}/messages", b"x"))
    answer = await request_answer(hostile_relay, http("GET", f"/v1/queues/{r}/messages?fromSeq={'9' * 40}"))
    assert answer.status == 200
    assert answer.json()["messages"] == []


@pytest.mark.parametrize("query", ["fromSeq=--1", "fromSeq=-1", "fromSeq=1e9", "fromSeq=" + "9" * 5000])
async def test_live_integer_attacks(hostile_relay: Relay, query: str) -> None:
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    answer = await request_answer(
        hostile_relay,
        http(
            "GET",
            f"/v1/queues/{recipient(26)}/live?{query}",
            headers={
                "Upgrade": "websocket",
                "Connection": "Upgrade",
                "Sec-WebSocket-Key": key,
                "Sec-WebSocket-Version": "13",
            },
        ),
    )
    if query.endswith("9" * 50):
        assert answer.status == 101, answer  # clamped: a live socket from past the end
    else:
        assert answer.status == 400, answer
        assert answer.json()["code"] == "bad_request", answer
