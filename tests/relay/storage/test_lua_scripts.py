"""Each Lua script's contract, on a real redis-server, one script at a time (no relay, no Spark).

The scripts run exactly as the relay, the migrator, the retention job and `relayfleet restore`
load them (relay/storage/scripts.py: prelude + file, by SHA), with the key names from
relay/storage/keys.py. The last test fails when a script file has no test here.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from relay.storage import keys as K
from relay.storage import scripts
from relay.storage.maintenance import ROWS, SWEEP_REFUSED, TOTALS, sweep_args
from relay.storage.scripts import Script

SLOT = 7
QID = "q1"
NOW = 1_700_000_000_000
MINUTE = NOW - NOW % 60_000  # the minute NOW falls in (enqueue.lua counts enqueues per minute)


def run(r: redis.Redis, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int] = ()) -> Any:
    """EVALSHA, loading the script first (as the runners do after NOSCRIPT)."""
    if not r.script_exists(script.sha)[0]:
        assert r.script_load(script.source) == script.sha
    return r.evalsha(script.sha, len(keys), *keys, *args)


def q() -> K.QueueKeys:
    return K.queue_keys_for_id(SLOT, QID)


def enqueue(
    r: redis.Redis,
    payload: bytes = b"hello",
    *,
    now: int = NOW,
    ikey: str = "",
    digest: str = "",
    token: str = "tok",
    resend: str = "",
    rate: int = 100,
    cap_msgs: int = 100,
    cap_bytes: int = 1 << 20,
    recipient: tuple[int, int, int] = (0, 0, 0),
    reserve: int = 0,
    k: K.QueueKeys | None = None,
) -> list[Any]:
    k = k or q()
    keys = (k.state, k.meta, k.msgs, k.idem, k.idemx, k.rate, k.index, k.stats, K.slot_recipients(k.slot))
    fixed = (rate, 60_000, cap_msgs, cap_bytes, 86_400_000, *recipient, reserve)
    args = (*fixed, payload, now, ikey, digest, "mid", k.qid, k.wake, token, resend)
    replies = run(r, scripts.ENQUEUE, keys, args)
    assert len(replies) == 1
    return list(replies[0])


def fence(r: redis.Redis, state: str) -> None:
    r.set(K.slot_state(SLOT), state)


def test_enqueue_stores_counts_dedups_limits_and_publishes(r: redis.Redis) -> None:
    k = q()
    sub = r.pubsub()  # type: ignore[no-untyped-call]
    sub.subscribe(k.wake)
    sub.get_message(timeout=1)
    stored = enqueue(r, b"abc", ikey="i1", digest="d1", token="t1")
    assert stored[:3] == [b"ok", 1, 1]
    meta = r.hgetall(k.meta)
    assert stored[3] == meta[b"epoch"]  # the queue's epoch, for waiters answered from the wakeup
    # one wakeup, as someone listens: newest seq, first enqueue time, epoch, and the (small)
    # message it announces
    head = b"1:%d:%b" % (NOW, cast(bytes, meta[b"epoch"]))
    assert sub.get_message(timeout=2)["data"] == head + b"\n1:%d:3:3\nmidabc" % NOW
    assert sub.get_message(timeout=0.2) is None
    sub.close()
    assert meta[b"seq"] == b"1"
    assert meta[b"bytes"] == b"3"
    assert b"created" not in meta  # not written any more (docs/memory.md); trim.lua still reads an old one
    assert r.sismember(k.index, QID)
    assert r.xrange(k.msgs) == [(b"1-0", {b"p": b"abc", b"t": str(NOW).encode(), b"m": b"mid", b"n": b"3"})]
    stats = r.hgetall(k.stats)
    minute = str(MINUTE).encode()
    assert stats == {b"msgs": b"1", b"bytes": b"3", b"w" + minute: b"1", b"wlast": minute}
    # idempotency: same key + digest is a duplicate, another digest a conflict, '*' any payload
    assert enqueue(r, b"abc", ikey="i1", digest="d1") == [b"dup", 1]
    assert enqueue(r, b"xyz", ikey="i1", digest="d2") == [b"conflict", 1]
    assert enqueue(r, b"xyz", ikey="i1", digest="*") == [b"dup", 1]
    # a resend of an attempt that did store the message answers its seq, storing nothing
    assert enqueue(r, b"abc", token="t1", resend="1") == [b"ok", 1, 0]
    assert r.xlen(k.msgs) == 1
    # caps and the rate limit
    assert enqueue(r, b"x" * 10, cap_bytes=12) == [b"full", b"bytes"]
    assert enqueue(r, b"x", cap_msgs=1) == [b"full", b"messages"]
    assert enqueue(r, b"x", rate=1, now=NOW + 1000)[:1] == [b"rate"]
    assert enqueue(r, b"x", rate=1, now=NOW + 1000)[1] == 59_000
    assert enqueue(r, b"de", token="t2", now=NOW + 5)[:2] == [b"ok", 2]
    # a new queue's seqs start above the restore floor
    r.delete(*k.all_keys())
    r.srem(k.index, QID)
    r.set(K.SHARD_SEQ_FLOOR, 500)
    assert enqueue(r, token="t3")[:2] == [b"ok", 501]
    # one whose meta was lost while its index entry stayed keeps the attempt's token as its epoch
    r.delete(*k.all_keys())
    assert r.sismember(k.index, QID)
    assert enqueue(r, token="t4") == [b"ok", 501, 0, b"t4"]
    assert r.hget(k.meta, "epoch") == b"t4"


Item = tuple[K.QueueKeys, dict[str, Any]]


def enqueue_many(r: redis.Redis, items: Sequence[Item], rate: int = 2) -> list[Any]:
    """One enqueue.lua call carrying several items (as a relay sends a loop tick's enqueues)."""
    keys: list[str] = []
    args: list[bytes | str | int] = [rate, 60_000, 100, 1 << 20, 86_400_000, 0, 0, 0, 0]
    for k, o in items:
        keys += [
            k.state,
            k.meta,
            k.msgs,
            k.idem,
            k.idemx,
            k.rate,
            k.index,
            k.stats,
            K.slot_recipients(k.slot),
        ]
        args += [o.get("payload", b"m"), o.get("now", NOW), o.get("ikey", ""), o.get("digest", ""), ""]
        args += [k.qid, k.wake, o["token"], o.get("resend", "")]
    return [list(x) for x in run(r, scripts.ENQUEUE, keys, args)]


def test_enqueue_rate_window_is_exact_and_ranked_by_time(r: redis.Redis) -> None:
    # 3 per 60 s: refused while the 3rd newest stored message is younger than the window,
    # retryAfterMs = when it leaves; times may arrive out of order (relays' clocks differ)
    for i, t in enumerate((NOW + 20, NOW, NOW + 10)):
        assert enqueue(r, rate=3, now=t, token=f"t{i}")[:2] == [b"ok", i + 1]
    assert enqueue(r, rate=3, now=NOW + 30) == [b"rate", 59_970]
    assert enqueue(r, rate=3, now=NOW + 59_999) == [b"rate", 1]
    # at NOW + 60000 the message of NOW has left the window (a window is (now - 60000, now])
    assert enqueue(r, rate=3, now=NOW + 60_000, token="t3")[:2] == [b"ok", 4]
    # newest three now NOW+60000, NOW+20, NOW+10: retry when NOW+10 leaves
    assert enqueue(r, rate=3, now=NOW + 60_001) == [b"rate", 9]
    assert enqueue(r, rate=3, now=NOW + 60_010, token="t4")[:2] == [b"ok", 5]
    # entries past the window were trimmed once the rank lookup met one; a resend still
    # finds its attempt while that is in the window
    assert r.zcard(q().rate) <= 4
    assert enqueue(r, now=NOW + 60_010, token="t4", resend="1") == [b"ok", 5, 0]


def test_enqueue_keeps_a_window_of_one_in_the_meta(r: redis.Redis) -> None:
    """A rate window holding one enqueue is the meta's field 'w', with no rate key (its key cost
    a queue ~190 B: docs/memory.md); a second enqueue inside the window moves both entries to
    the sorted set. The limit, its retryAfterMs and resends read them as one window."""
    k = q()
    assert enqueue(r, rate=2, now=NOW, token="a")[:2] == [b"ok", 1]
    assert not r.exists(k.rate)
    assert r.hget(k.meta, "w") == b"%d:1:a" % NOW
    assert enqueue(r, rate=1, now=NOW + 10) == [b"rate", 59_990]  # the field is the 1st newest
    assert enqueue(r, now=NOW, token="a", resend="1") == [b"ok", 1, 0]
    assert enqueue(r, now=NOW + 1, token="a", resend="1")[:2] == [b"ok", 2]  # not that attempt: stored
    assert r.hget(k.meta, "w") is None
    assert r.zrange(k.rate, 0, -1, withscores=True) == [(b"1:a", NOW), (b"2:a", NOW + 1)]
    assert 0 < r.pttl(k.rate) <= 60_000
    assert enqueue(r, rate=2, now=NOW + 20) == [b"rate", 59_980]
    assert enqueue(r, now=NOW, token="a", resend="1") == [b"ok", 1, 0]
    # once the set expired (one window after its newest entry), a window of one is the field again
    r.delete(k.rate)
    assert enqueue(r, rate=1, now=NOW + 60_001, token="c")[:2] == [b"ok", 3]
    assert (r.exists(k.rate), r.hget(k.meta, "w")) == (0, b"%d:3:c" % (NOW + 60_001))
    # a field the window has left counts for nothing and is replaced
    assert enqueue(r, rate=1, now=NOW + 120_001, token="d")[:2] == [b"ok", 4]
    assert (r.exists(k.rate), r.hget(k.meta, "w")) == (0, b"%d:4:d" % (NOW + 120_001))
    # an entry a relay of an earlier version added to the set beside the field: one window of two
    r.zadd(k.rate, {"9:old": NOW + 120_011})
    assert enqueue(r, rate=2, now=NOW + 120_021) == [b"rate", 59_980]  # its 2nd newest: the field's
    assert enqueue(r, rate=3, now=NOW + 120_021, token="e")[:2] == [b"ok", 5]
    assert r.hget(k.meta, "w") is None
    assert r.zrange(k.rate, 0, -1) == [b"4:d", b"9:old", b"5:e"]
    # the recipient's rate counts the field too, and retries when it leaves
    d = K.queue_keys_for_id(SLOT, K.queue_id(RCPT, b""))
    assert enqueue(r, token="f", k=d, recipient=(0, 0, 1))[:2] == [b"ok", 1]
    assert not r.exists(d.rate)
    assert enqueue(r, k=d, now=NOW + 10, recipient=(0, 0, 1)) == [b"rrate", 59_990]
    assert admit(r, b"a", now=NOW + 10, caps=(2, 5, 100, 1)) == [b"rrate", 59_990]
    assert admit(r, b"a", now=NOW + 10, caps=(2, 5, 100, 2))[0] == b"ok"


def test_enqueue_counts_each_minute_and_keeps_the_last_two(r: redis.Redis) -> None:
    def load(now: int) -> tuple[int, int, float]:
        """SLOT's messages, bytes and enqueues per minute as slot_sweep.lua reads them."""
        keys, args = sweep_args([SLOT], ROWS, now)
        ((_, _, _, msgs, nbytes, rate),) = run(r, scripts.SLOT_SWEEP, keys, args)
        return msgs, nbytes, float(rate)

    def counters() -> dict[bytes, bytes]:
        stats: dict[bytes, bytes] = cast(dict[bytes, bytes], r.hgetall(q().stats))
        return {f: v for f, v in stats.items() if f.startswith(b"w") and f != b"wlast"}

    for i in range(3):
        enqueue(r, b"ab", now=MINUTE + i, token=f"a{i}")
    assert load(MINUTE + 30_000) == (3, 6, 3.0)
    enqueue(r, b"ab", now=MINUTE + 60_000, token="b")  # next minute: the last one still counts
    assert load(MINUTE + 60_001) == (4, 8, 3.0)
    assert counters() == {f"w{MINUTE}".encode(): b"3", f"w{MINUTE + 60_000}".encode(): b"1"}
    enqueue(r, b"ab", now=MINUTE + 120_000, token="c")  # two minutes on: the first is dropped
    assert counters() == {f"w{MINUTE + 60_000}".encode(): b"1", f"w{MINUTE + 120_000}".encode(): b"1"}
    enqueue(r, b"ab", now=MINUTE + 600_000, token="d")  # after an idle spell: only its own
    assert counters() == {f"w{MINUTE + 600_000}".encode(): b"1"}
    assert load(MINUTE + 600_000) == (6, 12, 1.0)
    assert load(MINUTE + 720_000)[2] == 0.0  # idle since: no rate
    enqueue(r, b"ab", now=MINUTE + 540_000, token="e")  # a relay whose clock is behind
    assert r.hget(q().stats, "wlast") == str(MINUTE + 600_000).encode()
    # the counters of relays before 2026-11 are still read
    r.hset(q().stats, mapping={"wstart": MINUTE + 600_000, "wcur": 9, "wprev": 4})
    assert load(MINUTE + 600_000)[2] == 9.0
    assert load(MINUTE + 660_000)[2] == 9.0


def test_enqueue_call_with_mixed_items_answers_each(r: redis.Redis) -> None:
    a, b = K.queue_keys_for_id(SLOT, "qa"), K.queue_keys_for_id(SLOT, "qb")
    fenced = K.queue_keys_for_id(SLOT + 1, "qf")
    r.set(K.slot_state(SLOT + 1), "moved s2 9")
    assert enqueue_many(r, [(a, {"token": "a1", "ikey": "k", "digest": "d"})])[0][:3] == [b"ok", 1, 0]
    sub = r.pubsub()  # type: ignore[no-untyped-call]
    sub.subscribe(a.wake, b.wake)
    sub.get_message(timeout=1)
    sub.get_message(timeout=1)
    replies = enqueue_many(
        r,
        [
            (fenced, {"token": "f1"}),
            (a, {"token": "a2", "ikey": "k", "digest": "d"}),  # duplicate of a1
            (a, {"token": "a1", "resend": "1"}),  # resend of a stored attempt: its seq
            (a, {"token": "a3", "now": NOW + 1}),  # ok: the second in the window
            (a, {"token": "a4", "now": NOW + 2}),  # rate: the limit is 2
            (a, {"token": "a5", "ikey": "k", "digest": "other"}),  # conflict
            (b, {"token": "b1", "payload": b"xyz"}),
            (b, {"token": "b2", "payload": b"uv", "now": NOW + 3}),
        ],
    )
    epoch_a, epoch_b = cast(bytes, r.hget(a.meta, "epoch")), cast(bytes, r.hget(b.meta, "epoch"))
    assert [reply[3] for reply in (replies[3], replies[6], replies[7])] == [epoch_a, epoch_b, epoch_b]
    assert [reply[:3] for reply in replies] == [
        [b"moved", b"s2", b"9"],
        [b"dup", 1],
        [b"ok", 1, 0],
        [b"ok", 2, 1],
        [b"rate", 59_998],
        [b"conflict", 1],
        [b"ok", 1, 1],
        [b"ok", 2, 1],
    ]
    # one wakeup per channel and call, after its writes: newest seq, first enqueue time, epoch,
    # and each message it stored on that channel in this call
    got: dict[bytes, list[bytes]] = {}
    for _ in range(2):
        m = sub.get_message(timeout=2)
        got.setdefault(m["channel"], []).append(m["data"])
    sub.close()
    head_a, head_b = b"2:%d:%b" % (NOW + 1, epoch_a), b"2:%d:%b" % (NOW, epoch_b)
    assert got == {
        a.wake.encode(): [head_a + b"\n2:%d:0:1\nm" % (NOW + 1)],
        b.wake.encode(): [head_b + b"\n1:%d:0:3\nxyz\n2:%d:0:2\nuv" % (NOW, NOW + 3)],
    }
    # the slot statistics count every stored message once (one write per call)
    stats = r.hgetall(K.slot_stats(SLOT))
    assert (stats[b"msgs"], stats[b"bytes"], stats[f"w{MINUTE}".encode()]) == (b"4", b"7", b"4")
    assert not r.exists(fenced.meta, K.slot_stats(SLOT + 1))
    assert [m[0] for m in r.xrange(b.msgs) or []] == [b"1-0", b"2-0"]


def test_wakeup_carries_only_small_messages(r: redis.Redis) -> None:
    """A call's messages ride in the wakeup up to 8 KiB in total (payloads and messageIds);
    past that the wakeup is the head alone and the waiters read the queue."""
    a = K.queue_keys_for_id(SLOT, "qa")
    sub = r.pubsub()  # type: ignore[no-untyped-call]
    sub.subscribe(a.wake)
    sub.get_message(timeout=1)
    big = enqueue_many(r, [(a, {"token": "t1", "payload": b"x" * 8192})], rate=10)
    epoch = cast(bytes, r.hget(a.meta, "epoch"))
    assert big[0][3] == epoch
    assert sub.get_message(timeout=2)["data"] == b"1:%d:%b\n1:%d:0:8192\n%b" % (NOW, epoch, NOW, b"x" * 8192)
    items: list[Item] = [
        (a, {"token": "t2", "payload": b"y" * 8000}),
        (a, {"token": "t3", "payload": b"z" * 200}),
    ]
    two = enqueue_many(r, items, rate=10)
    assert [reply[:2] for reply in two] == [[b"ok", 2], [b"ok", 3]]
    assert sub.get_message(timeout=2)["data"] == b"3:%d:%b" % (NOW, epoch)  # the head alone
    sub.close()
    # nobody listening: stored all the same
    assert enqueue_many(r, [(a, {"token": "t4", "payload": b"w"})], rate=10)[0][:3] == [b"ok", 4, 0]


def test_wakeup_published_once_and_only_when_a_channel_subscriber_listens(r: redis.Redis) -> None:
    """One PUBLISH per channel and call that carries its messages, and none when PUBSUB NUMSUB
    counts no subscriber (a pattern subscriber, which relays never are, sees every PUBLISH)."""
    a = K.queue_keys_for_id(SLOT, "qa")
    watch = r.pubsub()  # type: ignore[no-untyped-call]
    watch.psubscribe(a.wake)
    watch.get_message(timeout=1)
    assert enqueue_many(r, [(a, {"token": "t1", "payload": b"p1"})], rate=10)[0][:3] == [b"ok", 1, 0]
    assert watch.get_message(timeout=0.3) is None
    sub = r.pubsub()  # type: ignore[no-untyped-call]
    sub.subscribe(a.wake)
    sub.get_message(timeout=1)
    replies = enqueue_many(
        r,
        [(a, {"token": "t2", "payload": b"p2"}), (a, {"token": "t3", "payload": b"p3", "now": NOW + 1})],
        rate=10,
    )
    assert [reply[:3] for reply in replies] == [[b"ok", 2, 2], [b"ok", 3, 2]]  # PUBLISH's receivers
    epoch = cast(bytes, r.hget(a.meta, "epoch"))
    text = b"3:%d:%b\n2:%d:0:2\np2\n3:%d:0:2\np3" % (NOW, epoch, NOW, NOW + 1)
    assert sub.get_message(timeout=2)["data"] == text
    assert watch.get_message(timeout=2)["data"] == text
    assert sub.get_message(timeout=0.3) is None
    assert watch.get_message(timeout=0.3) is None
    sub.close()
    watch.close()


def test_enqueue_refused_at_maxmemory_changes_nothing(r: redis.Redis) -> None:
    a, b = K.queue_keys_for_id(SLOT, "qa"), K.queue_keys_for_id(SLOT, "qb")
    assert enqueue_many(r, [(a, {"token": "a1"})])[0][:3] == [b"ok", 1, 0]
    before = {k: r.dump(k) for k in r.keys("*")}
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            enqueue_many(r, [(a, {"token": "a2", "ikey": "k", "digest": "d"}), (b, {"token": "b1"})])
    finally:
        r.config_set("maxmemory", 0)
    assert {k: r.dump(k) for k in r.keys("*")} == before


def test_fenced_scripts_answer_the_fence_and_write_nothing(r: redis.Redis) -> None:
    k = q()
    for state, reply in (("migrating", [b"migrating"]), ("moved b 3", [b"moved", b"b", b"3"])):
        fence(r, state)
        assert enqueue(r) == reply
        assert list(run(r, scripts.READ, (k.state, k.meta, k.msgs, k.stats), ("", 10, 1000, QID))) == reply
        assert list(run(r, scripts.DRAIN, (k.state, k.meta, k.msgs, k.stats), (10, 1000, QID))) == reply
        assert list(run(r, scripts.ACK, (k.state, k.meta, k.msgs, k.stats), ("upto", 5))) == reply
        assert list(run(r, scripts.STATUS, (k.state, k.meta, k.msgs, k.stats), (QID,))) == reply
        assert list(run(r, scripts.NONCE, (k.state, K.slot_nonces(SLOT)), ("a.b", NOW, 1000))) == reply
        assert list(run(r, scripts.TRIM, trim_keys(), trim_args())) == reply
        dc = (k.state, K.slot_didcomm(SLOT), K.slot_didcomm_idle(SLOT))
        assert list(run(r, scripts.DC_GET, dc, (NOW, 1000, "f"))) == reply
        assert list(run(r, scripts.DC_SET, dc, (NOW, 1000, 1, "f", "v"))) == reply
        assert list(run(r, scripts.DC_CLAIM, dc, ("k:x", "c1", "add", NOW, 1000, "0"))) == reply
        assert list(run(r, scripts.DC_LIST, dc, ("r:c1", "add", 5, "m"))) == reply
        assert list(run(r, scripts.DC_STAMP, dc, (NOW, 1000, "w:c1"))) == reply
        assert list(run(r, scripts.DC_SWAP, dc, (NOW, 1000, "d:x", "", "1 2 0"))) == reply
        assert sorted(r.keys()) == [k.state.encode()]


def test_read_status_drain_ack(r: redis.Redis) -> None:
    k = q()
    four = (k.state, k.meta, k.msgs, k.stats)
    # an unknown queue: the pending epoch, the same from every script, and no state created
    empty = list(run(r, scripts.READ, four, ("", 10, 1000, QID)))
    assert empty[0] == b"ok"
    assert empty[2:] == [0, []]
    assert len(empty[1]) == 16
    status = list(run(r, scripts.STATUS, four, (QID,)))
    assert status == [b"ok", 0, 0, empty[1], 0, b"", b"", 0]
    assert list(run(r, scripts.DRAIN, four, (10, 1000, QID))) == [b"ok", empty[1], 0, [], 0]
    assert r.keys() == []
    for i in range(1, 6):
        enqueue(r, b"m%d" % i, token=f"t{i}", now=NOW + i)
    assert r.hget(k.meta, "epoch") == empty[1]  # the first enqueue keeps the epoch reads answered
    status = list(run(r, scripts.STATUS, four, (QID,)))
    assert status == [b"ok", 5, 10, empty[1], 5, str(NOW + 1).encode(), str(NOW + 5).encode(), 5]
    # above a seq (a Pickup lease's cursor): none, some, all of them past it
    aboves = [run(r, scripts.STATUS, four, (QID, c))[7] for c in (0, 1, 3, 5, 10**15)]
    assert aboves == [5, 4, 2, 0, 0]
    # read: from a seq, a limit, and a byte budget that still returns one message
    got = list(run(r, scripts.READ, four, (2, 2, 1000, QID)))
    assert [e[0] for e in got[3]] == [b"2-0", b"3-0"]
    got = list(run(r, scripts.READ, four, ("", 10, 1, QID)))
    assert [e[0] for e in got[3]] == [b"1-0"]
    got = list(run(r, scripts.READ, four, ("", 10, 5, QID)))
    assert [e[0] for e in got[3]] == [b"1-0", b"2-0"]
    # ack: 'upto' and 'seqs', idempotent, counters follow
    assert list(run(r, scripts.ACK, four, ("upto", 2))) == [b"ok", 2, 4]  # removed, their bytes
    assert list(run(r, scripts.ACK, four, ("upto", 2))) == [b"ok", 0, 0]
    assert list(run(r, scripts.ACK, four, ("seqs", 4, 9))) == [b"ok", 1, 2]
    assert r.hget(k.meta, "bytes") == b"4"
    assert r.hget(k.stats, "msgs") == b"2"
    # drain: deletes exactly what it returns; 'more' while messages remain
    got = list(run(r, scripts.DRAIN, four, (1, 1000, QID)))
    assert [e[0] for e in got[3]] == [b"3-0"]
    assert got[4] == 1
    got = list(run(r, scripts.DRAIN, four, (10, 1000, QID)))
    assert [e[0] for e in got[3]] == [b"5-0"]
    assert got[4] == 0
    assert got[2] == 5
    assert r.xlen(k.msgs) == 0
    assert r.hget(k.meta, "bytes") == b"0"
    assert r.hget(k.stats, "bytes") == b"0"


def test_nonce_accepts_once_within_its_lifetime(r: redis.Redis) -> None:
    keys = (K.slot_state(SLOT), K.slot_nonces(SLOT))
    assert list(run(r, scripts.NONCE, keys, ("k.n1", NOW, 1000))) == [b"ok", 1]
    assert list(run(r, scripts.NONCE, keys, ("k.n1", NOW + 999, 1000))) == [b"ok", 0]
    assert list(run(r, scripts.NONCE, keys, ("k.n1", NOW + 1000, 1000))) == [b"ok", 1]  # expired


def trim_keys() -> tuple[str, ...]:
    k = q()
    return (k.state, k.meta, k.msgs, k.idem, k.idemx, k.rate, k.index, k.stats)


def trim_args(
    now: int = NOW, cutoff: int = 0, cap: int = -1, idle: int = -1, budget: int = 100
) -> tuple[Any, ...]:
    return (now, cutoff, cap, idle, QID, budget)


def test_trim_age_cap_budget_idle_delete(r: redis.Redis) -> None:
    k = q()
    for i in range(1, 6):
        enqueue(r, b"xx", token=f"t{i}", now=NOW + i * 1000, ikey=f"i{i}", digest="d")
    # age: messages received before the cutoff go, oldest first
    assert list(run(r, scripts.TRIM, trim_keys(), trim_args(NOW + 6000, cutoff=NOW + 2500))) == [
        b"ok",
        2,
        4,
        0,
        0,
    ]
    assert [e[0] for e in r.xrange(k.msgs) or []][:1] == [b"3-0"]
    assert r.hget(k.meta, "bytes") == b"6"
    # cap, within a budget: 'more' until done; a repeat changes nothing
    assert list(run(r, scripts.TRIM, trim_keys(), trim_args(NOW + 6000, cap=1, budget=1))) == [
        b"ok",
        1,
        2,
        0,
        1,
    ]
    assert list(run(r, scripts.TRIM, trim_keys(), trim_args(NOW + 6000, cap=1, budget=2))) == [
        b"ok",
        1,
        2,
        0,
        0,
    ]
    assert list(run(r, scripts.TRIM, trim_keys(), trim_args(NOW + 6000, cap=1))) == [b"ok", 0, 0, 0, 0]
    assert r.xlen(k.msgs) == 1
    assert r.hget(k.stats, "msgs") == b"1"
    # idle: an emptied queue is deleted only once provably idle and its idempotency keys expired;
    # the enqueue time of the last message is remembered in 'tseen'
    run(r, scripts.ACK, (k.state, k.meta, k.msgs, k.stats), ("upto", 5))
    late = NOW + 86_400_000 + 10_000  # past every idempotency key's expiry
    first = list(run(r, scripts.TRIM, trim_keys(), trim_args(late, idle=late)))
    assert first[3] == 0
    assert r.hget(k.meta, "tseen") == f"5:{late}".encode()
    deleted = list(run(r, scripts.TRIM, trim_keys(), trim_args(late + 10, idle=10)))
    assert deleted[3] == 1
    assert not r.exists(k.meta, k.msgs, k.idem, k.idemx, k.rate)
    assert not r.sismember(k.index, QID)
    assert r.hget(k.stats, "qgen") == b"1"  # a queue created again gets another epoch
    # a stale index entry (no keys left) is dropped
    r.sadd(k.index, QID)
    assert list(run(r, scripts.TRIM, trim_keys(), trim_args())) == [b"ok", 0, 0, 1, 0]
    assert not r.sismember(k.index, QID)
    assert r.hget(k.stats, "qgen") == b"2"


def trim_slot_call(
    r: redis.Redis, cursor: str = "0", count: int = 100, budget: int = 100, cutoff: int = 0, idle: int = -1
) -> list[Any]:
    keys = (K.slot_state(SLOT), K.slot_index(SLOT), K.slot_stats(SLOT))
    args = (NOW, cutoff, -1, idle, budget, cursor, count, K.slot_queue_prefix(SLOT), *K.QUEUE_SUFFIXES)
    return list(run(r, scripts.TRIM_SLOT, keys, args))


def test_trim_slot_trims_each_queue_of_the_slot_as_trim_does(r: redis.Redis) -> None:
    queues = [K.queue_keys_for_id(SLOT, f"q{i}") for i in range(5)]
    for n, k in enumerate(queues):  # queue i holds i + 1 messages, a second apart
        for m in range(n + 1):
            enqueue(r, b"xyz", now=NOW - 10_000 + m * 1000, token=f"t{m}", k=k)
    # messages before NOW - 8,500 go: the first two of each queue that has them
    cutoff = NOW - 8_500
    # a page of one queue per call: the cursor walks the index, every queue once
    cursor, pages, totals, seen = "0", 0, [0, 0, 0, 0], 0
    while True:
        reply = trim_slot_call(r, cursor, count=1, cutoff=cutoff)
        assert reply[0] == b"ok"
        assert reply[6] == []
        cursor = reply[1].decode()
        seen += reply[2]
        totals = [t + v for t, v in zip(totals, reply[2:6], strict=True)]
        pages += 1
        if cursor == "0":
            break
    assert seen == 5
    assert totals[1:] == [1 + 2 * 4, 3 * 9, 0]  # the one-message queue loses 1, the others 2 each
    assert [r.xlen(k.msgs) for k in queues] == [0, 0, 1, 2, 3]
    assert r.hget(K.slot_stats(SLOT), "msgs") == b"6"
    # the budget is the call's: queues it did not reach come back to be trimmed by trim.lua
    reply = trim_slot_call(r, budget=2, cutoff=NOW + 1)
    assert reply[3] == 2
    assert len(reply[6]) >= 1
    # an empty, idle queue is deleted as trim.lua deletes it; a fenced slot answers the fence
    later = NOW + 86_400_000 + 10_000
    keys = (K.slot_state(SLOT), K.slot_index(SLOT), K.slot_stats(SLOT))
    gone = list(run(r, scripts.TRIM_SLOT, keys, (later, later, -1, 0, 1000, "0", 100,
                                                  K.slot_queue_prefix(SLOT), *K.QUEUE_SUFFIXES)))  # fmt: skip
    assert gone[0] == b"ok"
    assert gone[5] == 5
    assert not any(r.exists(*k.all_keys()) for k in queues)
    assert not r.exists(K.slot_index(SLOT))
    fence(r, "migrating")
    assert trim_slot_call(r) == [b"migrating"]


def test_didcomm_records(r: redis.Redis) -> None:
    dc = (K.slot_state(SLOT), K.slot_didcomm(SLOT), K.slot_didcomm_idle(SLOT))
    t, idle = 1_000_000, 500
    assert list(run(r, scripts.DC_SET, dc, (t, idle, 2, "a", "1", "b", "2"))) == [b"ok", 0]
    assert list(run(r, scripts.DC_GET, dc, (t, idle, "a", "b", "c"))) == [b"ok", b"1", b"2", None]
    assert list(run(r, scripts.DC_SET, dc, (t, idle, 0, "a"))) == [b"ok", 0]  # delete only
    assert list(run(r, scripts.DC_GET, dc, (t, idle, "a"))) == [b"ok", None]
    assert list(run(r, scripts.DC_GET, dc, (t, idle))) == [b"ok"]
    claim = scripts.DC_CLAIM
    assert list(run(r, claim, dc, ("k:x", "c1", "add", t, idle, "0"))) == [b"ok", 1, b""]
    assert list(run(r, claim, dc, ("k:x", "c2", "add", t, idle, "0"))) == [b"ok", 0, b""]
    assert list(run(r, claim, dc, ("k:x", "c2", "remove", t, idle, "0"))) == [b"ok", 0, b""]
    assert list(run(r, claim, dc, ("k:x", "c1", "remove", t, idle, "0"))) == [b"ok", 1, b""]
    assert list(run(r, claim, dc, ("k:x", "c1", "remove", t, idle, "0"))) == [b"ok", 1, b""]
    # a proven claim takes a live registration over; an expired one is free to anyone
    assert list(run(r, claim, dc, ("k:y", "c1", "add", t, idle, "0"))) == [b"ok", 1, b""]
    assert list(run(r, claim, dc, ("k:y", "c2", "add", t, idle, "1"))) == [b"ok", 1, b"c1"]
    assert list(run(r, claim, dc, ("k:y", "c3", "add", t + idle, idle, "0"))) == [b"ok", 1, b"c2"]
    assert list(run(r, scripts.DC_LIST, dc, ("r:c", "add", 3, "m1", "m2", "m1"))) == [b"ok", 2]
    assert list(run(r, scripts.DC_LIST, dc, ("r:c", "add", 3, "m3", "m4"))) == [b"full", 2]
    assert list(run(r, scripts.DC_LIST, dc, ("r:c", "remove", 3, "m1"))) == [b"ok", 1]
    assert r.hget(K.slot_didcomm(SLOT), "r:c") == b"m2"
    assert list(run(r, scripts.DC_LIST, dc, ("r:c", "remove", 3, "m2"))) == [b"ok", 0]
    assert not r.hexists(K.slot_didcomm(SLOT), "r:c")


def test_didcomm_records_expire_when_idle(r: redis.Redis) -> None:
    """A connection ('c:') and a registration ('k:') read as absent once their idle expiry
    passed, with what they govern ('r:', 'd:'); the next write sweeps them away; a record
    from before expiry existed gets its expiry on first read."""
    dc = (K.slot_state(SLOT), K.slot_didcomm(SLOT), K.slot_didcomm_idle(SLOT))
    t, idle = 1_000_000, 500
    run(r, scripts.DC_SET, dc, (t, idle, 2, "c:a", "{}", "r:a", "k1"))
    run(r, scripts.DC_CLAIM, dc, ("k:k1", "a", "add", t, idle, "0"))
    run(r, scripts.DC_SET, dc, (t, idle, 1, "d:k1", "1 2 3"))
    fields = ("c:a", "r:a", "k:k1", "d:k1")
    assert list(run(r, scripts.DC_GET, dc, (t + idle - 1, idle, *fields))) == [
        b"ok",
        b"{}",
        b"k1",
        b"a",
        b"1 2 3",
    ]
    assert list(run(r, scripts.DC_GET, dc, (t + idle, idle, *fields))) == [b"ok", None, None, None, None]
    assert r.hlen(K.slot_didcomm(SLOT)) == 4  # unreachable, not yet removed
    assert list(run(r, scripts.DC_SET, dc, (t + idle, idle, 1, "c:b", "{}"))) == [b"ok", 2]
    assert r.hkeys(K.slot_didcomm(SLOT)) == [b"c:b"]
    assert r.zrange(K.slot_didcomm_idle(SLOT), 0, -1) == [b"c:b"]
    r.hset(K.slot_didcomm(SLOT), "c:old", "{}")  # written before idle expiry existed
    assert list(run(r, scripts.DC_GET, dc, (t, idle, "c:old"))) == [b"ok", b"{}"]
    assert r.zscore(K.slot_didcomm_idle(SLOT), "c:old") == t + idle


def test_didcomm_lease_swap_writes_only_over_what_was_read(r: redis.Redis) -> None:
    """dc_swap: a Pickup delivery lease ('d:<key>') is replaced only when it still holds what its
    writer read ('' = none, or its registration 'k:<key>' expired): of two relays that read one
    lease, one moves it and the other is told to read again."""
    dc = (K.slot_state(SLOT), K.slot_didcomm(SLOT), K.slot_didcomm_idle(SLOT))
    t, idle = 1_000_000, 500
    run(r, scripts.DC_SET, dc, (t, idle, 1, "c:a", "{}"))
    assert list(run(r, scripts.DC_CLAIM, dc, ("k:q", "a", "add", t, idle, "0")))[1] == 1
    assert list(run(r, scripts.DC_SWAP, dc, (t, idle, "d:q", "", "5 100 0"))) == [b"ok", 1]
    assert list(run(r, scripts.DC_SWAP, dc, (t, idle, "d:q", "", "6 100 0"))) == [b"ok", 0]  # lost
    assert list(run(r, scripts.DC_SWAP, dc, (t, idle, "d:q", "5 100 0", "7 200 0"))) == [b"ok", 1]
    assert r.hget(K.slot_didcomm(SLOT), "d:q") == b"7 200 0"
    # once the registration expired the lease reads as none, and '' takes it
    assert list(run(r, scripts.DC_SWAP, dc, (t + idle, idle, "d:q", "7 200 0", "8 1 0"))) == [b"ok", 0]
    assert list(run(r, scripts.DC_SWAP, dc, (t + idle, idle, "d:q", "", "8 1 0"))) == [b"ok", 1]


def test_didcomm_push_window_and_devices_live_with_their_connection(r: redis.Redis) -> None:
    """dc_stamp takes a connection's push window at most once per interval (stamping the
    time); the window ('w:') and the devices ('p:') read and expire with their connection."""
    dc = (K.slot_state(SLOT), K.slot_didcomm(SLOT), K.slot_didcomm_idle(SLOT))
    t, idle, interval = 1_000_000, 500, 100
    run(r, scripts.DC_SET, dc, (t, idle, 2, "c:a", "{}", "p:a", '{"apns":{"t":"ab"}}'))
    assert list(run(r, scripts.DC_STAMP, dc, (t, interval, "w:a"))) == [b"ok", 1]
    assert list(run(r, scripts.DC_STAMP, dc, (t + interval - 1, interval, "w:a"))) == [b"ok", 0]
    assert r.hget(K.slot_didcomm(SLOT), "w:a") == str(t).encode()  # a refusal stamps nothing
    assert list(run(r, scripts.DC_STAMP, dc, (t + interval, interval, "w:a"))) == [b"ok", 1]
    assert list(run(r, scripts.DC_STAMP, dc, (t + interval, 0, "w:a"))) == [b"ok", 1]  # no interval
    fields = ("p:a", "w:a")
    assert list(run(r, scripts.DC_GET, dc, (t + idle - 1, idle, *fields))) == [
        b"ok",
        b'{"apns":{"t":"ab"}}',
        str(t + interval).encode(),
    ]
    assert list(run(r, scripts.DC_GET, dc, (t + idle, idle, *fields))) == [b"ok", None, None]
    run(r, scripts.DC_SET, dc, (t + idle, idle, 1, "c:b", "{}"))  # the sweep takes all three
    assert r.hkeys(K.slot_didcomm(SLOT)) == [b"c:b"]


def test_didcomm_expire_sweeps_a_batch_of_slots_within_its_budget(r: redis.Redis) -> None:
    """dc_expire removes expired records (with their keylist / lease) across a batch of slots,
    at most `budget` a call, answers where to resume, skips a fenced slot and keeps live ones."""
    t, idle = 1_000_000, 500
    slots = (SLOT, SLOT + 1, SLOT + 2)
    dc = {s: (K.slot_state(s), K.slot_didcomm(s), K.slot_didcomm_idle(s)) for s in slots}
    for s in slots:
        pairs = [x for i in range(5) for x in (f"c:a{i}", "{}", f"r:a{i}", "k")]
        run(r, scripts.DC_SET, dc[s], (t, idle, len(pairs) // 2, *pairs))
    run(r, scripts.DC_SET, dc[SLOT + 2], (t, 2 * idle, 1, "c:live", "{}"))  # expires later
    r.set(K.slot_state(SLOT + 1), "migrating")
    keys = [k for s in slots for k in dc[s]]
    assert list(run(r, scripts.DC_EXPIRE, keys, (t + idle, 3))) == [b"ok", 3, 1, 0]  # budget spent in slot 1
    assert list(run(r, scripts.DC_EXPIRE, keys, (t + idle, 3))) == [b"ok", 3, 3, 1]  # resume in slot 3
    assert list(run(r, scripts.DC_EXPIRE, keys[6:], (t + idle, 3))) == [b"ok", 3, 1, 0]
    assert list(run(r, scripts.DC_EXPIRE, keys[6:], (t + idle, 3))) == [b"ok", 1, 0, 0]
    assert r.hlen(K.slot_didcomm(SLOT)) == 0
    assert not r.exists(K.slot_didcomm_idle(SLOT))
    assert r.hlen(K.slot_didcomm(SLOT + 1)) == 10  # migrating: the copy's, swept where it lands
    assert r.hkeys(K.slot_didcomm(SLOT + 2)) == [b"c:live"]
    assert r.zrange(K.slot_didcomm_idle(SLOT + 2), 0, -1) == [b"c:live"]
    assert list(run(r, scripts.DC_EXPIRE, keys, (t + idle, 3))) == [b"ok", 0, 0, 1]


def test_slot_state_compare_and_set(r: redis.Redis) -> None:
    st = (K.slot_state(SLOT),)
    assert list(run(r, scripts.SLOT_STATE, st, ("migrating", ""))) == [1, b""]
    assert list(run(r, scripts.SLOT_STATE, st, ("moved b 4", "importing"))) == [0, b"migrating"]
    assert list(run(r, scripts.SLOT_STATE, st, ("moved b 4", "migrating"))) == [1, b"migrating"]
    assert list(run(r, scripts.SLOT_STATE, st, ("", "moved a *"))) == [0, b"moved b 4"]
    assert list(run(r, scripts.SLOT_STATE, st, ("", "moved b *"))) == [1, b"moved b 4"]
    assert not r.exists(K.slot_state(SLOT))


def test_slot_drop_only_in_an_allowed_state(r: redis.Redis) -> None:
    k = q()
    enqueue(r)
    keys = (k.state, k.meta, k.msgs, k.index)
    assert list(run(r, scripts.SLOT_DROP, keys, ("moved *",))) == [0, b""]
    assert r.exists(k.meta, k.msgs, k.index) == 3
    fence(r, "moved b 2")
    assert list(run(r, scripts.SLOT_DROP, keys, ("migrating", "moved b *"))) == [1, 3]
    assert not r.exists(k.meta, k.msgs, k.index)
    assert r.get(k.state) == b"moved b 2"  # never deleted


def test_slot_sweep_reports_only_the_slots_holding_anything(r: redis.Redis) -> None:
    """One call reads a batch of slots: for each slot holding anything, its position in the
    batch, state, queue count and its load (messages, bytes, enqueues per minute) as the
    script reads the statistics; totals over the batch, moved slots left out. (The rate
    window's cases: test_enqueue_counts_each_minute_and_keeps_the_last_two and
    tests/relay/storage/test_slot_sweep.py.)"""
    enqueue(r, b"abc")  # SLOT: a queue and its statistics
    r.set(K.slot_state(SLOT + 1), "migrating")  # a state only
    r.sadd(K.slot_index(SLOT + 2), "q")  # queues only
    r.hset(K.slot_stats(SLOT + 3), mapping={"msgs": 0, "bytes": 0, "qgen": 4})  # nothing but zeros
    r.hset(K.slot_stats(SLOT + 4), mapping={"wstart": MINUTE, "wcur": 2})  # a former relay's counters
    r.set(K.slot_state(SLOT + 6), "moved b 3")
    r.hset(K.slot_stats(SLOT + 6), mapping={"msgs": 5, "bytes": 50, "wstart": MINUTE, "wcur": 9})
    r.hset(K.slot_stats(SLOT + 7), mapping={"msgs": -2, "bytes": -9})  # a drift below zero reads 0
    slots = [SLOT + 5, SLOT, SLOT + 1, SLOT + 2, SLOT + 3, SLOT + 4, SLOT + 6, SLOT + 7]  # + 5: no keys
    keys, args = sweep_args(slots, ROWS, NOW)
    assert run(r, scripts.SLOT_SWEEP, keys, args) == [
        [2, None, 1, 1, 3, 1],
        [3, b"migrating", 0, 0, 0, 0],
        [4, None, 1, 0, 0, 0],
        [6, None, 0, 0, 0, 2],
        [7, b"moved b 3", 0, 5, 50, 9],
    ]
    keys, args = sweep_args(slots, TOTALS, NOW)
    assert run(r, scripts.SLOT_SWEEP, keys, args) == [1, 3, 2, 1 + 2, 1]  # the moved slot left out
    assert run(r, scripts.SLOT_SWEEP, keys[:3], sweep_args([SLOT + 5], ROWS, NOW)[1]) == []


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["", "msgs", "bytes"], id="the former rows call (fields by position)"),
        pytest.param([str(NOW), "msgs", "bytes"], id="the former totals call"),
        pytest.param(["rows"], id="no time"),
        pytest.param(["totals", "soon"], id="a time that is no number"),
        pytest.param(["sums", str(NOW)], id="an unknown mode"),
        pytest.param(["rows", str(NOW), "x"], id="an argument too many"),
    ],
)
def test_slot_sweep_refuses_a_call_out_of_step(r: redis.Redis, args: list[str]) -> None:
    """A caller whose arguments are not the script's fails loudly (an error naming the script)
    instead of being read by position into a wrong answer."""
    keys, _ = sweep_args([SLOT], ROWS, NOW)
    enqueue(r)
    with pytest.raises(redis.ResponseError, match=SWEEP_REFUSED):
        run(r, scripts.SLOT_SWEEP, keys, args)
    with pytest.raises(redis.ResponseError, match=SWEEP_REFUSED):  # KEYS: three per slot
        run(r, scripts.SLOT_SWEEP, keys[:2], sweep_args([SLOT], TOTALS, NOW)[1])


def test_import_stamp_and_boot_mark(r: redis.Redis) -> None:
    k = q()
    assert run(r, scripts.IMPORT_STAMP, (k.meta,)) == 0
    enqueue(r)
    r.hset(k.meta, "r", "other-run")
    assert run(r, scripts.IMPORT_STAMP, (k.meta,)) == 1
    assert not r.hexists(k.meta, "r")
    mark = run(r, scripts.BOOT_MARK, (K.SHARD_BOOT,), ("",))
    run_id = r.info("server")["run_id"]
    assert mark.decode().startswith(f"{run_id}:")
    assert r.get(K.SHARD_BOOT) == mark
    assert run(r, scripts.BOOT_MARK, (K.SHARD_BOOT,), ("",)) == mark  # once per run
    waited = run(r, scripts.BOOT_MARK, (K.SHARD_BOOT,), ("w",))  # a mode change re-marks
    assert waited.decode().startswith(run_id)  # and the replication ID's first 12 digits
    assert waited.endswith(b":w")
    assert run(r, scripts.IMPORT_STAMP, (k.meta,)) == 1
    assert r.hget(k.meta, "r") == waited.split(b":")[0]  # the run the mark names


def test_lost_tail_new_run_rekeys_the_queue(r: redis.Redis) -> None:
    """The prelude's check_boot: a queue last written by another Redis run gets a new epoch
    and a seq jump; under a WAIT-confirmed mark (':w') the epoch stays, the seq still jumps."""
    k = q()
    r.set(K.SHARD_BOOT, "runA:1")
    enqueue(r, token="t1")
    epoch = r.hget(k.meta, "epoch")
    assert r.hget(k.meta, "r") == b"runA"
    r.set(K.SHARD_BOOT, "runB:2:w")
    assert enqueue(r, token="t2")[:2] == [b"ok", 1_000_002]
    assert r.hget(k.meta, "epoch") == epoch
    assert r.hget(k.meta, "r") == b"runB"
    r.set(K.SHARD_BOOT, "runC:3")
    assert enqueue(r, token="t3")[:2] == [b"ok", 2_000_003]
    assert r.hget(k.meta, "epoch") != epoch
    assert r.hget(k.meta, "r") == b"runC"


def test_restore_epoch(r: redis.Redis) -> None:
    k = q()
    enqueue(r)
    r.hset(k.meta, "r", "run")
    epoch = r.hget(k.meta, "epoch")
    other = K.queue_keys_for_id(SLOT, "absent").meta
    assert run(r, scripts.RESTORE_EPOCH, (k.meta, other), ("restore-1", 1000)) == 1
    assert r.hget(k.meta, "seq") == b"1001"
    assert r.hget(k.meta, "epoch") != epoch
    assert not r.hexists(k.meta, "r")
    assert not r.exists(other)


def test_each_script_gets_only_the_prelude_definitions_it_uses() -> None:
    parts = scripts.prelude_parts(
        "-- a\nlocal A = 1\nlocal function f(x)\n  return x + A\nend\n\nlocal function g()\nend\n"
    )
    assert [name for name, _ in parts] == ["A", "f", "g"]
    assert (
        scripts.prelude_for("return f(1)", parts)
        == "-- a\nlocal A = 1\nlocal function f(x)\n  return x + A\nend\n"
    )
    assert scripts.prelude_for("return 1", parts) == ""
    with pytest.raises(ValueError, match="not a top-level definition"):
        scripts.prelude_parts("local x = 1\nprint(x)\n")
    with pytest.raises(ValueError, match="one name per definition"):
        scripts.prelude_parts("local x, y = 1, 2\n")
    assert "local function read_budget" in scripts.READ.source
    assert "local function read_budget" not in scripts.ENQUEUE.source


def test_every_script_file_is_tested_here() -> None:
    """Every lua/*.lua but the prelude is loaded by scripts.py and run by a test above."""
    files = {
        p.name[: -len(".lua")]
        for p in resources.files("relay.storage").joinpath("lua").iterdir()
        if p.name.endswith(".lua") and not p.name.startswith("_")
    }
    loaded = {s.name for s in vars(scripts).values() if isinstance(s, Script)}
    assert files == loaded
    here = Path(__file__).read_text("utf-8")
    assert {f for f in files if f"scripts.{f.upper()}" not in here} == set()


# -- per-recipient quotas (rcpt_admit / rcpt_refund / rcpt_settle, enqueue.lua's home check) ----
RCPT = b"\x07" * 32
RF = K.recipient_field(RCPT)


def home_keys() -> tuple[str, ...]:
    d = K.queue_keys_for_id(SLOT, K.queue_id(RCPT, b""))
    return (d.state, K.slot_recipients(SLOT), d.meta, d.msgs, d.rate)


def admit(
    r: redis.Redis,
    channel: bytes,
    size: int = 10,
    now: int = NOW,
    caps: tuple[int, int, int, int] = (2, 5, 100, 4),
) -> list[Any]:
    args = (RF, K.b64(channel), size, now, *caps, 60_000)
    return list(run(r, scripts.RCPT_ADMIT, home_keys(), args))


def test_recipient_admit_caps_channels_held_and_rate_across_channels(r: redis.Redis) -> None:
    # channel cap 2, 5 messages, 100 bytes, 4 per window
    assert admit(r, b"a") == [b"ok", 1]
    assert admit(r, b"b") == [b"ok", 2]
    assert admit(r, b"c") == [b"full", b"channels"]  # a third channel
    assert admit(r, b"a", size=81) == [b"full", b"recipient bytes"]  # 20 held + 81
    assert admit(r, b"b") == [b"ok", 3]
    assert admit(r, b"b") == [b"ok", 4]
    refused = admit(r, b"a", now=NOW + 1000)  # the 5th within the window: the ring says when
    assert refused[0] == b"rrate"
    assert 0 < refused[1] <= 66_000
    # refunds: the last admit was refused by its channel's shard (its rate entry goes), and
    # two messages were acked
    assert run(r, scripts.RCPT_REFUND, home_keys()[:2], (RF, 1, 10, NOW, NOW, 60_000)) == [b"ok"]
    assert run(r, scripts.RCPT_REFUND, home_keys()[:2], (RF, 2, 20, 0, NOW, 60_000)) == [b"ok"]
    rec = r.hgetall(K.slot_recipients(SLOT))
    assert rec[(RF + "n").encode()] == b"1"
    assert rec[(RF + "b").encode()] == b"10"
    assert admit(r, b"a", now=NOW + 1000)[0] == b"ok"  # the ring has room again
    # the default queue's own messages count towards the held cap: 2 admitted + 3 stored
    k = K.queue_keys_for_id(SLOT, K.queue_id(RCPT, b""))
    for i in range(3):
        assert enqueue(r, b"x", token=f"d{i}", k=k, now=NOW + 2000 + i)[0] == b"ok"
    assert admit(r, b"a", now=NOW + 3000, caps=(2, 5, 100, 0)) == [b"full", b"recipient messages"]
    # a refund never goes below 0 and a recipient without a record gets none
    assert run(r, scripts.RCPT_REFUND, home_keys()[:2], (RF, 99, 999, 0, NOW, 60_000)) == [b"ok"]
    assert r.hget(K.slot_recipients(SLOT), RF + "n") == b"0"
    other = K.recipient_field(b"\x08" * 32)
    assert run(r, scripts.RCPT_REFUND, home_keys()[:2], (other, 1, 1, 0, NOW, 60_000)) == [b"ok"]
    assert not r.hexists(K.slot_recipients(SLOT), other + "n")
    # fenced: the admit waits for the migration like every write
    fence(r, "migrating")
    assert admit(r, b"a") == [b"migrating"]


def test_default_channel_enqueue_checks_the_recipient_record(r: redis.Redis) -> None:
    k = K.queue_keys_for_id(SLOT, K.queue_id(RCPT, b""))
    assert admit(r, b"a", size=50) == [b"ok", 1]
    # held across channels: 1 admitted elsewhere + 1 here = the cap of 2
    assert enqueue(r, b"x", token="a1", k=k, recipient=(2, 0, 0))[0] == b"ok"
    assert enqueue(r, b"x", token="a2", k=k, recipient=(2, 0, 0)) == [b"full", b"recipient messages"]
    assert enqueue(r, b"x" * 10, token="a3", k=k, recipient=(0, 60, 0)) == [b"full", b"recipient bytes"]
    # rate across channels: the ring's admit + this queue's one stored message = 2
    refused = enqueue(r, b"x", token="a4", k=k, recipient=(0, 0, 2), now=NOW + 10)
    assert refused[0] == b"rrate"
    assert 0 < refused[1] <= 66_000
    assert enqueue(r, b"x", token="a5", k=k, recipient=(0, 0, 3), now=NOW + 10)[0] == b"ok"
    # a non-default channel's item is not checked here (its home admitted it)
    c = K.queue_keys_for_id(SLOT, K.queue_id(RCPT, b"a"))
    assert enqueue(r, b"x", token="a6", k=c, recipient=(1, 1, 1))[0] == b"ok"
    # the shard reserve: a message taking its queue past the reserve bytes is refused
    assert enqueue(r, b"x" * 8, token="a7", k=c, reserve=8) == [b"full", b"reserve"]
    assert enqueue(r, b"x" * 6, token="a8", k=c, reserve=8)[0] == b"ok"


def test_recipient_settle_replaces_counters_only_when_quiet(r: redis.Redis) -> None:
    keys = home_keys()[:2]
    assert run(r, scripts.RCPT_SETTLE, keys, (RF, "peek")) == [b"ok", b"", 0, 0]
    assert not r.exists(K.slot_recipients(SLOT))  # a peek creates nothing
    admit(r, b"a")
    admit(r, b"b")
    assert run(r, scripts.RCPT_SETTLE, keys, (RF, "peek")) == [
        b"ok",
        K.b64(b"a").encode() + b" " + K.b64(b"b").encode(),
        2,
        NOW,
    ]
    held = (K.b64(b"a"), 3, 30, K.b64(b"b"), 0, 0)
    # an admit since the peek, or one within the quiet period: not applied
    assert run(r, scripts.RCPT_SETTLE, keys, (RF, "set", 1, NOW + 10_000, 5000, 60_000, *held)) == [b"busy"]
    assert run(r, scripts.RCPT_SETTLE, keys, (RF, "set", 2, NOW + 1000, 5000, 60_000, *held)) == [b"busy"]
    assert run(r, scripts.RCPT_SETTLE, keys, (RF, "set", 2, NOW + 10_000, 5000, 60_000, *held)) == [b"ok"]
    rec = r.hgetall(K.slot_recipients(SLOT))
    assert rec[(RF + "c").encode()] == K.b64(b"a").encode()  # the empty channel is unregistered
    assert rec[(RF + "n").encode()] == b"3"
    assert rec[(RF + "b").encode()] == b"30"
    # nothing held and the rate window passed: the record goes
    empty = (K.b64(b"a"), 0, 0)
    assert run(r, scripts.RCPT_SETTLE, keys, (RF, "set", 2, NOW + 200_000, 5000, 60_000, *empty)) == [b"ok"]
    assert not r.exists(K.slot_recipients(SLOT))


def test_presence_leases_take_drop_renew_and_expire(r: redis.Redis) -> None:
    k = q()
    keys = (k.state, K.slot_presence(SLOT))
    sub = r.pubsub()  # type: ignore[no-untyped-call]
    sub.subscribe(k.wake)
    sub.get_message(timeout=1)

    def get(now: int) -> list[Any]:
        return list(run(r, scripts.PRESENCE, keys, ("get", now, QID)))

    assert get(NOW) == [b"ok", 0, 0]
    assert not r.exists(K.slot_presence(SLOT))  # a read writes nothing
    # the first take finds no holder; its notice goes out on the queue's channel
    assert run(r, scripts.PRESENCE, keys, ("take", NOW, 8000, QID, "aa", k.wake)) == [b"ok", 0, b""]
    assert sub.get_message(timeout=1)["data"] == b"n:taa"
    assert get(NOW + 1) == [b"ok", 1, 1]
    assert 7000 < r.pttl(K.slot_presence(SLOT)) <= 8000  # the key lives as long as its newest lease
    # a newer socket takes over: told how long the older lease had left, and whose it was
    assert run(r, scripts.PRESENCE, keys, ("take", NOW + 1000, 8000, QID, "bb", k.wake)) == [
        b"ok",
        7000,
        b"aa",
    ]
    # the older one's renewal finds it taken (nothing written), its drop deletes nothing but
    # still publishes its release
    assert run(r, scripts.PRESENCE, keys, ("renew", NOW + 1500, 8000, "0", 1, 0, QID, "aa")) == [
        [b"ok", b"q1"]
    ]
    sub.get_message(timeout=1)
    assert run(r, scripts.PRESENCE, keys, ("drop", NOW + 1600, QID, "aa", k.wake)) == [b"ok", 0]
    assert sub.get_message(timeout=1)["data"] == b"n:raa"
    assert get(NOW + 1700) == [b"ok", 1, 1]
    # the holder's own drop deletes: false at once, and the key is gone with its last field
    assert run(r, scripts.PRESENCE, keys, ("drop", NOW + 1800, QID, "bb", k.wake)) == [b"ok", 1]
    assert get(NOW + 1900) == [b"ok", 0, 0]
    assert not r.exists(K.slot_presence(SLOT))
    # a waiting poll counts as online, not live; a lease read after its expiry is absent
    assert run(r, scripts.PRESENCE, keys, ("renew", NOW, 8000, "0", 0, 1, QID)) == [[b"ok"]]
    assert get(NOW + 7999) == [b"ok", 0, 1]
    assert get(NOW + 8000) == [b"ok", 0, 0]
    # a sweep removes expired fields (a killed relay's) and keeps the others
    run(r, scripts.PRESENCE, keys, ("renew", NOW + 9000, 8000, "1", 1, 0, "q2", "cc"))
    assert r.hkeys(K.slot_presence(SLOT)) == [b"l|q2"]
    # fenced: nothing written, the fence answered
    fence(r, "migrating")
    assert run(r, scripts.PRESENCE, keys, ("take", NOW, 8000, "q3", "dd", k.wake)) == [b"migrating"]
    assert not r.hexists(K.slot_presence(SLOT), "l|q3")


def test_presence_renewal_of_many_slots_in_one_call(r: redis.Redis) -> None:
    """One renew call carries every slot of a shard (relay/presence.py): each slot's leases are
    written in its own hash, a fenced slot gets its fence reply and nothing written, and the
    replies come per slot in order."""
    slots = (SLOT, SLOT + 1, SLOT + 2)
    keys = [k for s in slots for k in (K.slot_state(s), K.slot_presence(s))]
    run(r, scripts.PRESENCE, keys[4:], ("take", NOW, 8000, "t3", "zz", "chan"))  # held by another
    r.set(K.slot_state(SLOT + 1), "migrating")
    args = ("renew", NOW + 10, 8000, "0", 1, 1, "t1", "aa", "p1", 0, 2, "p2", "p3", 1, 0, "t3", "yy")
    assert run(r, scripts.PRESENCE, keys, args) == [[b"ok"], [b"migrating"], [b"ok", b"t3"]]
    assert r.hgetall(K.slot_presence(SLOT)) == {
        b"l|t1": b"%d aa" % (NOW + 8010),
        b"p|p1": b"%d" % (NOW + 8010),
    }
    assert not r.exists(K.slot_presence(SLOT + 1))
    assert r.hgetall(K.slot_presence(SLOT + 2)) == {b"l|t3": b"%d zz" % (NOW + 8000)}
    assert 7000 < r.pttl(K.slot_presence(SLOT)) <= 8000
