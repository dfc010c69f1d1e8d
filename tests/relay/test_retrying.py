"""The retry policies (relay/retrying.py): what every retrying loop of the project runs on."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from relay import retrying as r
from relay.retrying import Policy, retrying, retrying_blocking

QUICK = Policy(first_s=0.001, cap_s=0.004)


class Flaky(Exception):
    pass


class Calls:
    """An operation that fails with `errors` in turn, then returns "done"."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.count = 0

    async def __call__(self) -> str:
        self.count += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


async def test_retries_the_named_errors_until_it_succeeds() -> None:
    call = Calls(Flaky(), Flaky(), OSError())
    seen: list[tuple[str, float]] = []
    result: str = await retrying(
        QUICK, (Flaky, OSError), on_retry=lambda e, s: seen.append((type(e).__name__, s))
    )(call)
    assert (result, call.count) == ("done", 4)
    # one report per retry made, with the wait about to be slept: 1, 2, 4 ms (capped)
    assert seen == [("Flaky", 0.001), ("Flaky", 0.002), ("OSError", 0.004)]


async def test_gives_up_after_its_attempts_with_the_last_error_itself() -> None:
    call = Calls(*(Flaky(i) for i in range(10)))
    with pytest.raises(Flaky) as err:
        await retrying(Policy(first_s=0.001, cap_s=0.001, attempts=3), Flaky)(call)
    assert call.count == 3
    assert err.value.args == (2,)  # the third attempt's error, not a wrapper (no RetryError)
    # a call site may ask for fewer or more than its policy
    call = Calls(*(Flaky(i) for i in range(10)))
    with pytest.raises(Flaky):
        await retrying(Policy(first_s=0.001, cap_s=0.001, attempts=3), Flaky, attempts=5)(call)
    assert call.count == 5


async def test_does_not_retry_what_it_does_not_name() -> None:
    call = Calls(ValueError("bad input"), Flaky())
    with pytest.raises(ValueError, match="bad input"):
        await retrying(QUICK, Flaky)(call)
    assert call.count == 1
    # a predicate decides per error, not per type only
    call = Calls(Flaky("again"), Flaky("final"))
    with pytest.raises(Flaky, match="final"):
        await retrying(QUICK, lambda e: isinstance(e, Flaky) and e.args != ("final",))(call)
    assert call.count == 2


async def test_cancellation_is_never_retried() -> None:
    call = Calls(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await retrying(QUICK, BaseException)(call)  # not even when told to retry everything
    assert call.count == 1


async def test_cancelled_while_waiting_it_stops_at_once() -> None:
    first = asyncio.Event()

    async def flaky() -> None:
        first.set()
        raise Flaky

    calls = Calls()

    async def counted() -> None:
        await calls()
        await flaky()

    task: asyncio.Task[None] = asyncio.create_task(retrying(Policy(first_s=10.0, cap_s=10.0), Flaky)(counted))
    await first.wait()  # failed once: now in its 10 s wait
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls.count == 1


async def test_a_deadline_ends_it_before_a_wait_that_would_pass_it() -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.12
    call = Calls(*(Flaky() for _ in range(100)))
    ends: list[float] = []  # when each wait it began was planned to end
    with pytest.raises(Flaky):
        await retrying(
            Policy(first_s=0.05, cap_s=0.05),
            Flaky,
            deadline=deadline,
            on_retry=lambda e, s: ends.append(loop.time() + s),
        )(call)
    assert all(end <= deadline for end in ends)  # never began a wait past the deadline
    assert loop.time() + 0.05 > deadline  # and gave up only when the next one would be
    assert call.count == len(ends) + 1 <= 3  # 0.05 s waits: at most two fit in 0.12 s


async def test_a_wait_the_error_asks_for_replaces_the_policys() -> None:
    call = Calls(Flaky(0.0), Flaky(0.03))
    waits: list[float] = []
    await retrying(
        Policy(first_s=5.0, cap_s=5.0),
        Flaky,
        wait=lambda e, retry: float(e.args[0]),
        on_retry=lambda e, s: waits.append(s),
    )(call)
    assert waits == [0.0, 0.03]


def test_waits_grow_to_the_cap_with_jitter_above_it() -> None:
    p = Policy(first_s=0.1, cap_s=0.5)
    assert [p.wait_s(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    jittered = Policy(first_s=0.2, cap_s=3.0, jitter_s=0.1)
    for n, base in ((1, 0.2), (5, 3.0), (9, 3.0)):
        got = [jittered.wait_s(n) for _ in range(200)]
        assert all(base <= w <= base + 0.1 for w in got)
        assert len(set(got)) > 100  # clients at the cap do not come back together
    # the policies the project runs on: bounded waits, a bound on what has attempts
    for name in dir(r):
        policy = getattr(r, name)
        if isinstance(policy, Policy):
            assert 0 <= policy.first_s <= policy.cap_s <= 10.0, name
            assert policy.attempts is None or policy.attempts >= 2, name


def test_blocking_form_retries_and_a_stop_ends_its_wait_at_once() -> None:
    count = [0]

    def flaky() -> str:
        count[0] += 1
        if count[0] < 3:
            raise Flaky
        return "done"

    assert retrying_blocking(QUICK, Flaky)(flaky) == "done"
    assert count[0] == 3

    stop = threading.Event()

    def never() -> None:
        count[0] += 1
        raise Flaky

    threading.Timer(0.1, stop.set).start()
    count[0] = 0
    start = time.monotonic()
    with pytest.raises(Flaky):
        retrying_blocking(Policy(first_s=30.0, cap_s=30.0), Flaky, stop=stop)(never)
    assert time.monotonic() - start < 10.0  # not the 30 s wait
    assert count[0] <= 2
