"""What a waiter may answer from carried wakeups (relay/storage/wakeups.py), and the wakeup format."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from relay.storage.message import Message
from relay.storage.wakeups import Waiter, WakeupHub, parse_wakeup

E = "e0e0e0e0e0e0e0e0"
BUDGET = 1 << 20


def m(seq: int, payload: bytes = b"p") -> Message:
    return Message(seq, payload, 1000 + seq, None)


def answerer(answered: list[list[Message]], writes: bool = True) -> Callable[[list[Message]], bool]:
    """An `expect` answerer that records what it is handed; `writes`: whether it answers it."""

    def answer(got: list[Message]) -> bool:
        answered.append(got)
        return writes

    return answer


@pytest.fixture
async def waiter() -> Waiter:
    hub = WakeupHub("redis://127.0.0.1:1/0")  # never started: waiters need only its bookkeeping
    return hub.register("chan")


async def test_take_answers_exactly_the_messages_after_the_read(waiter: Waiter) -> None:
    waiter.carry(1000, E, [m(5)])
    waiter.carry(1000, E, [m(6), m(7)])
    assert waiter.take(E, 4, None, 10, BUDGET) == [m(5), m(6), m(7)]
    assert waiter.take(E, 7, None, 10, BUDGET) == []  # consumed: nothing new since


async def test_take_skips_what_the_read_saw_and_messages_carried_twice(waiter: Waiter) -> None:
    # the local hand-over and the published wakeup both carry seq 5; 3 was seen by the read
    waiter.carry(1000, E, [m(3)])
    waiter.carry(1000, E, [m(5)])
    waiter.carry(1000, E, [m(5)])
    assert waiter.take(E, 4, None, 10, BUDGET) == [m(5)]
    waiter.carry(1000, E, [m(5)])  # arriving after it was answered: old news, not an answer
    assert waiter.take(E, 5, None, 10, BUDGET) == []


@pytest.mark.parametrize(
    ("carried", "last_seq", "from_seq", "limit", "budget", "why"),
    [
        ([(E, 6)], 4, None, 10, BUDGET, "a gap: seq 5 was not carried"),
        ([(E, 5), (E, 7)], 4, None, 10, BUDGET, "a gap after the first"),
        ([("other", 5)], 4, None, 10, BUDGET, "another epoch: the queue's history changed"),
        ([(E, 5)], 4, 9, 10, BUDGET, "before fromSeq: a read would not return it"),
        ([(E, 5), (E, 6)], 4, None, 1, BUDGET, "more than the limit: the rest must be read"),
        ([(E, 5), (E, 6)], 4, None, 10, 1, "past the byte budget"),
    ],
)
async def test_take_reads_whenever_the_carried_messages_are_not_all_of_it(
    waiter: Waiter,
    carried: list[tuple[str, int]],
    last_seq: int,
    from_seq: int | None,
    limit: int,
    budget: int,
    why: str,
) -> None:
    for epoch, seq in carried:
        waiter.carry(1000, epoch, [m(seq)])
    assert waiter.take(E, last_seq, from_seq, limit, budget) is None, why


async def test_a_plain_wakeup_means_read(waiter: Waiter) -> None:
    waiter.carry(1000, E, [m(5)])
    waiter.wake(None)  # e.g. a reconnect, a migration, an older relay's wakeup
    waiter.carry(1000, E, [m(6)])
    assert waiter.take(E, 4, None, 10, BUDGET) is None
    # forget (before a read) starts over
    waiter.wake(None)
    waiter.forget()
    waiter.carry(1000, E, [m(5)])
    assert waiter.take(E, 4, None, 10, BUDGET) == [m(5)]


async def test_too_many_carried_messages_mean_read(waiter: Waiter) -> None:
    for seq in range(1, 66):
        waiter.carry(1000, E, [m(seq)])
    assert waiter.take(E, 0, None, 1000, BUDGET) is None
    # and bytes: a waiter whose client stopped taking them pins at most 256 KiB
    for seq in range(1, 5):
        waiter.carry(1000, E, [m(seq, b"x" * 65536)])
    assert waiter.take(E, 0, None, 1000, BUDGET) == [m(seq, b"x" * 65536) for seq in range(1, 5)]
    for seq in range(5, 10):
        waiter.carry(1000, E, [m(seq, b"x" * 65536)])
    assert waiter.take(E, 4, None, 1000, BUDGET) is None


async def test_expect_answers_as_the_carrying_wakeup_arrives(waiter: Waiter) -> None:
    answered: list[list[Message]] = []
    waiter.expect(answerer(answered), E, 4, None, 10, BUDGET)
    # what the read saw already: nothing to answer (nothing for the task either), still expecting
    assert waiter.carry(1000, E, [m(4)])
    assert answered == []
    assert waiter.carry(1000, E, [m(5), m(6)])  # answered there and then
    assert answered == [[m(5), m(6)]]  # handed over inside carry, before any task runs
    assert waiter.taken == [m(5), m(6)]
    assert await waiter.wait(1.0)  # and the waiting task is woken to finish the request
    waiter.carry(1000, E, [m(7)])
    assert answered == [[m(5), m(6)]]  # answered once: the expectation ended with its answer


@pytest.mark.parametrize(
    ("wakeup", "why"),
    [
        ("gap", "seq 5 never carried: only a read can tell"),
        ("plain", "a wakeup that carries nothing: read"),
        ("epoch", "the queue's history changed: read"),
    ],
)
async def test_expect_leaves_to_a_read_what_carried_messages_cannot_answer(
    waiter: Waiter, wakeup: str, why: str
) -> None:
    answered: list[list[Message]] = []
    waiter.expect(answerer(answered), E, 4, None, 10, BUDGET)
    if wakeup == "gap":
        waiter.carry(1000, E, [m(6)])
    elif wakeup == "plain":
        waiter.wake(1000)
    else:
        waiter.carry(1000, "other", [m(5)])
    assert not waiter.carry(1000, E, [m(5)])  # a later wakeup that would have fitted is no answer either
    assert answered == [], why
    assert waiter.taken is None
    assert waiter.take(E, 4, None, 10, BUDGET) is None  # the task re-reads


async def test_a_read_ends_the_expectation(waiter: Waiter) -> None:
    answered: list[list[Message]] = []
    waiter.expect(answerer(answered), E, 4, None, 10, BUDGET)
    waiter.forget()  # the task reads again (it sees whatever comes next)
    waiter.carry(1000, E, [m(5)])
    assert answered == []


class Sent:
    payload = b"p"
    message_id = ""


async def test_hub_carry_says_whether_a_waiter_still_answers_from_its_task() -> None:
    # the enqueue that carried the message answers its sender at once when every waiter here
    # answered there and then, else a loop turn later, behind the waiters' tasks
    hub = WakeupHub("redis://127.0.0.1:1/0")  # never started: waiters need only its bookkeeping
    assert not hub.carry("chan", 1000, E.encode(), 5, Sent())  # nobody waits here
    answered: list[list[Message]] = []
    first, second = hub.register("chan"), hub.register("chan")
    for w in (first, second):
        w.expect(answerer(answered), E, 4, None, 10, BUDGET)
    assert not hub.carry("chan", 1000, E.encode(), 5, Sent())  # both answered from it
    assert len(answered) == 2
    first.expect(answerer(answered), E, 5, None, 10, BUDGET)
    second.expect(answerer(answered, writes=False), E, 5, None, 10, BUDGET)  # declines: its task sends
    assert hub.carry("chan", 1000, E.encode(), 6, Sent())
    first.expect(answerer(answered), E, 6, None, 10, BUDGET)
    second.forget()  # reading: not expecting, its task answers whatever comes
    assert hub.carry("chan", 1000, E.encode(), 7, Sent())
    first.expect(answerer(answered), E, 7, None, 10, BUDGET)
    second.forget()
    second.expect(answerer(answered), E, 5, None, 10, BUDGET)  # 6 and 7 never carried: a gap
    assert hub.carry("chan", 1000, E.encode(), 8, Sent())  # its task re-reads
    assert second.take(E, 5, None, 10, BUDGET) is None


async def test_prepare_tells_an_expecting_waiter_of_the_first_enqueue_sent_only() -> None:
    hub = WakeupHub("redis://127.0.0.1:1/0")  # never started: waiters need only its bookkeeping
    waiter = hub.register("chan")
    told: list[tuple[str, int]] = []
    hub.prepare("chan", 1, Sent())  # nobody expects yet
    waiter.expect(
        lambda got: True, E, 4, None, 10, BUDGET, lambda epoch, ms, stored: told.append((epoch, ms))
    )
    hub.prepare("chan", 2, Sent())
    hub.prepare("chan", 3, Sent())  # a burst: the first one carries the answer
    hub.prepare("other", 4, Sent())
    assert told == [(E, 2)]
    waiter.expect(
        lambda got: True, E, 5, None, 10, BUDGET, lambda epoch, ms, stored: told.append((epoch, ms))
    )
    hub.prepare("chan", 5, Sent())
    assert told == [(E, 2), (E, 5)]
    waiter.forget()  # reading: nothing expected until the next wait
    hub.prepare("chan", 6, Sent())
    assert told == [(E, 2), (E, 5)]


def test_parse_wakeup() -> None:
    data = b"6:1700:%b\n5:1700:3:2\nmidab\n6:1701:0:0\n" % E.encode()
    assert parse_wakeup(data) == (1700, E, [Message(5, b"ab", 1700, "mid"), Message(6, b"", 1701, None)])
    # payloads may hold anything, newlines and colons included
    tricky = b"\n1:2:3\n"
    data = b"1:1700:%b\n1:1700:0:%d\n%b" % (E.encode(), len(tricky), tricky)
    assert parse_wakeup(data) == (1700, E, [Message(1, tricky, 1700, None)])
    # the head of a wakeup whose messages come next: nothing yet
    assert parse_wakeup(b"6:1700:%b:+" % E.encode()) == (1700, "", [])
    # plain wakeups: no carried messages (the waiter reads)
    assert parse_wakeup(b"6:1700:%b" % E.encode()) == (1700, "", None)
    assert parse_wakeup(b"6:1700:%b\n" % E.encode()) == (1700, "", None)
    assert parse_wakeup(b"6:1700") == (1700, "", None)  # an older relay's
    assert parse_wakeup(b"moved") == (None, "", None)  # a migration's
    # malformed or cut short: plain, never a half-parsed message
    for bad in (
        b"6:1700:%b\n5:1700:3:20\nmidab" % E.encode(),
        b"6:1700:%b\n5:1700\nab" % E.encode(),
        b"6:1700:%b\n5:x:0:2\nab" % E.encode(),
        b"6:1700:%b\n5:1700:-1:2\nab" % E.encode(),
        b"6:1700:%b\n5:1700:2:0\n\xff\xfe" % E.encode(),
    ):
        assert parse_wakeup(bad) == (1700, "", None), bad
