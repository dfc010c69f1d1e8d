"""The history test: slots move back and forth between three real redis-servers while two
relay processes serve producers, read+ack consumers, drainers and long-polls; the
recorded history must satisfy every guarantee (tests.support.history). Plus unit tests showing
the checker catches each kind of violation.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.support.fleet_harness import (
    Migrator,
    Workload,
    final_placement_problems,
    fleet_procs,
    make_queues,
    retries,
)
from tests.support.history import History, check, main


async def _run_history(tmp_path: Path, seconds: float, seed: int) -> None:
    with fleet_procs(tmp_path, shards=3, relays=2) as fleet:
        queues = make_queues(24, seed=seed)
        slots = sorted({q.slot for q in queues})
        work = Workload(fleet.urls, queues, producers=8, seed=seed)
        migrator = Migrator(fleet, slots, seed=seed)
        await work.start()
        moving = asyncio.get_running_loop().create_task(migrator.run())
        try:
            await asyncio.sleep(seconds)
        finally:
            migrator.stop()
            await moving
        await work.stop()
        retried = retries(fleet)
        history_path = tmp_path / "history.jsonl"
        work.history.save(str(history_path))
        verdict = work.history.check()
        pauses = sorted(migrator.pauses())
        print(verdict.render())
        if pauses:
            print(
                f"migrations: {len(migrator.reports)} runs, {migrator.moved} slot moves, "
                f"pause p50 {pauses[len(pauses) // 2] * 1000:.0f} ms, max {pauses[-1] * 1000:.0f} ms"
            )
        assert verdict.ok, f"{verdict.render()}\nhistory: {history_path}\n{fleet.relay_logs()}"
        assert verdict.counts["messages_acknowledged"] >= 20 * seconds
        assert verdict.counts["idempotent_duplicates"] > 0
        assert migrator.moved >= 2 * seconds, "the slots hardly moved"
        # the relays met fenced slots and MOVED answers, and rode them out inside the deadline
        assert retried.get("migrating", 0) > 0, retried
        assert retried.get("moved", 0) > 0, retried
        assert not await final_placement_problems(fleet, slots)


@pytest.mark.timeout(300)
async def test_history_holds_while_slots_move_between_three_shards(tmp_path: Path) -> None:
    await _run_history(tmp_path, seconds=25, seed=11)


@pytest.mark.soak
@pytest.mark.timeout(0)
async def test_history_soak(tmp_path: Path, soak_seconds: float) -> None:
    await _run_history(tmp_path, seconds=soak_seconds, seed=29)


# -- the checker catches what it must -----------------------------------------------------


def _base() -> History:
    h = History()
    h.enqueue("q", "a", 0.0, 1.0, 201, seq=1, key="a")
    h.enqueue("q", "b", 2.0, 3.0, 201, seq=2, key="b")
    return h


def _kinds(h: History, exactly_once: bool = True) -> set[str]:
    return {v.kind for v in h.check(exactly_once).violations}


def test_checker_accepts_a_valid_history() -> None:
    h = _base()
    h.enqueue("q", "b", 3.5, 3.6, 200, seq=2, key="b")  # idempotent retry
    h.deliver("q", "read", 4.0, 5.0, 200, [(1, "a"), (2, "b")], from_seq=None, epoch="e1")
    h.ack("q", 5.0, 6.0, 200, upto=2)
    h.deliver("q", "read", 6.0, 7.0, 503, retry_after=True)
    h.deliver("q", "read", 7.0, 8.0, 200, [], from_seq=3, epoch="e1")
    verdict = h.check()
    assert verdict.ok, verdict.render()
    assert verdict.counts["idempotent_duplicates"] == 1


def test_checker_finds_a_lost_message() -> None:
    h = _base()
    h.deliver("q", "read", 4.0, 5.0, 200, [(2, "b")], from_seq=2)
    assert "lost" in _kinds(h)


def test_checker_finds_a_delivery_after_ack() -> None:
    h = _base()
    h.deliver("q", "read", 4.0, 5.0, 200, [(1, "a"), (2, "b")])
    h.ack("q", 5.0, 6.0, 200, upto=2)
    h.deliver("q", "read", 7.0, 8.0, 200, [(2, "b")], from_seq=2)
    assert "after_removal" in _kinds(h, exactly_once=False)
    assert "duplicate" in _kinds(h)


def test_checker_finds_a_frame_on_a_displaced_live_connection() -> None:
    h = _base()
    h.deliver("q", "read", 4.0, 4.1, 200, [(1, "a")], conn=0)
    h.deliver("q", "read", 4.2, 5.0, 200, [(1, "a")], conn=1)  # the newer socket: again, unacked
    h.deliver("q", "read", 4.0, 5.5, 200, [(2, "b")], from_seq=2, conn=1)
    assert h.check(exactly_once=False).ok
    h.deliver("q", "read", 4.0, 5.2, 200, [(2, "b")], from_seq=2, conn=0)  # after conn 1's first
    assert _kinds(h, exactly_once=False) == {"displaced"}


def test_checker_finds_two_drains_of_one_message() -> None:
    h = _base()
    h.deliver("q", "drain", 4.0, 5.0, 200, [(1, "a"), (2, "b")])
    h.deliver("q", "drain", 4.5, 5.5, 200, [(2, "b")])
    assert "duplicate" in _kinds(h, exactly_once=False)


def test_checker_finds_reordering_and_skips() -> None:
    h = _base()
    h.enqueue("q", "c", 2.5, 2.9, 201, seq=0, key="c")  # began after a finished, got a smaller seq
    assert "fifo" in _kinds(h)
    h2 = _base()
    h2.deliver("q", "read", 4.0, 5.0, 200, [(2, "b"), (1, "a")])
    assert "fifo" in _kinds(h2)
    h3 = _base()
    h3.deliver("q", "read", 4.0, 5.0, 200, [(2, "b")], from_seq=1)  # seq 1 was there, and left out
    h3.deliver("q", "read", 6.0, 7.0, 200, [(1, "a")], from_seq=1)
    assert "skipped" in _kinds(h3)


def test_checker_finds_phantoms_and_idempotency_breaks() -> None:
    h = _base()
    h.deliver("q", "read", 4.0, 5.0, 200, [(1, "a"), (2, "b"), (3, "zz")])
    assert "phantom" in _kinds(h)
    h2 = _base()
    h2.deliver("q", "read", 4.0, 5.0, 200, [(1, "a"), (3, "b")])
    assert "phantom" in _kinds(h2)
    h3 = _base()
    h3.enqueue("q", "b", 3.5, 3.6, 201, seq=3, key="b")  # the retry was stored again
    assert "idempotency" in _kinds(h3)


def test_checker_tells_a_copy_stored_again_in_a_new_epoch_from_a_duplicate() -> None:
    """A message read in epoch e1 whose epoch was then lost, stored again by its producer's
    retry in e2: `restored` (and the epoch change), not a duplicate; read twice within one
    epoch, or two copies in one epoch, it still is one."""
    h = History()
    h.enqueue("q", "a", 1.0, 2.0, 201, seq=1, key="a")
    h.enqueue("q", "b", 2.0, 9.0, 201, seq=1_000_001, key="b")  # the first answer lost, retried
    h.deliver("q", "read", 3.0, 4.0, 200, [(1, "a"), (2, "b")], epoch="e1")
    h.ack("q", 4.0, 5.0, 200, upto=2)
    h.deliver("q", "read", 10.0, 11.0, 200, [(1_000_001, "b")], from_seq=1_000_001, epoch="e2")
    # and a phantom: b was delivered as seq 2, its enqueue answered 1,000,001
    assert _kinds(h) == {"restored", "epoch", "phantom"}
    h.deliver("q", "read", 12.0, 13.0, 200, [(1_000_001, "b")], from_seq=1_000_001, epoch="e2")
    assert "duplicate" in _kinds(h)  # the new copy read twice
    h2 = History()
    h2.enqueue("q", "b", 2.0, 9.0, 201, seq=5, key="b")
    h2.deliver("q", "read", 3.0, 4.0, 200, [(2, "b")], epoch="e1")
    h2.deliver("q", "read", 10.0, 11.0, 200, [(5, "b")], from_seq=3, epoch="e1")
    assert {"duplicate", "phantom"} <= _kinds(h2)
    assert "restored" not in _kinds(h2)  # both copies in e1


def test_checker_finds_bad_statuses_and_epoch_resets() -> None:
    h = _base()
    h.deliver("q", "read", 4.0, 5.0, 200, [(1, "a"), (2, "b")], epoch="e1")
    h.deliver("q", "read", 5.0, 5.5, 200, [], from_seq=3, epoch="e2")
    h.enqueue("q", "c", 6.0, 7.0, 503, key="c")  # no Retry-After
    h.enqueue("q", "d", 6.0, 7.0, 500, key="d")
    h.ack("q", 6.0, 7.0, 0, upto=2)
    kinds = _kinds(h)
    assert {"epoch", "status"} <= kinds
    assert sum(v.kind == "status" for v in h.check().violations) == 3


def test_epochs_before_the_queue_exists_do_not_count() -> None:
    h = History()
    # reads of a queue nothing was sent to yet answer a placeholder epoch per shard
    h.deliver("q", "read", 0.0, 1.0, 200, [], epoch="shard-a-placeholder")
    h.deliver("q", "read", 1.0, 2.0, 200, [], epoch="shard-b-placeholder")
    h.enqueue("q", "a", 3.0, 4.0, 201, seq=1, key="a")
    # a read overlapping the first enqueue may still reach the old shard's placeholder
    h.deliver("q", "read", 3.5, 4.5, 200, [], epoch="shard-a-placeholder")
    h.deliver("q", "read", 5.0, 6.0, 200, [(1, "a")], epoch="e1")
    assert h.check().ok, h.check().render()
    h.deliver("q", "read", 4.5, 4.8, 200, [], epoch="e0")  # begun after the answer: counts
    assert "epoch" in _kinds(h)
    h.events.pop()
    h.deliver("q", "read", 7.0, 8.0, 200, [(1, "a")], from_seq=1, epoch="e2")
    assert "epoch" in _kinds(h)


def test_history_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _base()
    good.deliver("q", "drain", 4.0, 5.0, 200, [(1, "a"), (2, "b")])
    good.save(str(tmp_path / "good.jsonl"))
    assert main([str(tmp_path / "good.jsonl")]) == 0
    assert "verdict: OK" in capsys.readouterr().out
    bad = _base()
    bad.save(str(tmp_path / "bad.jsonl"))
    assert main([str(tmp_path / "bad.jsonl")]) == 1
    assert "lost" in capsys.readouterr().out
    (tmp_path / "junk.jsonl").write_text('{"op": "enqueue"}\n')
    assert main([str(tmp_path / "junk.jsonl")]) == 2
    assert "lacks" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    records = [json.loads(line) for line in (tmp_path / "good.jsonl").read_text().splitlines()]
    assert check(records).ok
