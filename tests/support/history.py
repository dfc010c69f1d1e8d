"""History checker: record what clients saw of a relay fleet, then verify its delivery guarantees.

A test (or a chaos run) records every enqueue response and every delivery and ack,
with client timestamps from one clock, then asks :func:`check` whether the history is
one the contract allows:

- ``lost``           an enqueue answered 201/200 was never delivered
- ``after_removal``  a delivery that started after an ack (or a drain) of that message ended
- ``duplicate``      a message delivered by more than one response (exactly-once mode);
                     two drains returning one message are always a violation
- ``fifo``           per queue, an enqueue that finished before another began got the larger seq;
                     or one response's messages out of seq order
- ``skipped``        a response left out an older message that was stored before it started,
                     and that nothing removed meanwhile (what a stale or partial copy would do)
- ``phantom``        a delivered message nobody enqueued to that queue, or with another seq
                     than its enqueue was answered, or two messages on one seq
- ``idempotency``    retries of one Idempotency-Key answered with different seqs, or stored twice
- ``restored``       a message stored again in a new epoch, one copy per epoch: the epoch that held
                     its first copy was lost (docs/reliability.md: an Idempotency-Key whose record
                     was in a lost tail is stored again on retry); its copies' deliveries are not
                     also counted as ``duplicate`` or a ``phantom`` stored twice
- ``epoch``          a queue's epoch changed (its history was lost or reset); empty
                     reads begun before an enqueue to the queue was answered do not count
- ``status``         a 5xx other than 503 with Retry-After, a response that never came,
                     or a status the operation never answers
- ``displaced``      live delivery (deliveries that name their connection, ``conn``, numbered
                     in the order the queue's live connections opened; ``t1`` the frame's
                     arrival): a frame on a connection arriving after the first frame on a
                     newer connection (a displaced socket still served after its successor began)

Event records (also the JSON-lines file format; ``t0``/``t1`` are seconds, one clock):

    {"op": "enqueue", "queue": Q, "id": ID, "key": KEY|null, "t0", "t1", "status", "seq": N|null,
     "retry_after": bool}
    {"op": "deliver", "mode": "read"|"drain", "queue": Q, "t0", "t1", "status", "from": S|null,
     "items": [[seq, ID], ...], "epoch": E|null, "retry_after": bool, "conn": N (optional)}
    {"op": "ack", "queue": Q, "t0", "t1", "status", "upto": N|null, "seqs": [N, ...]|null,
     "retry_after": bool}

``status`` 0 means no response arrived. An ``id`` names one logical message: retries of
it must reuse one Idempotency-Key (``key``). Before checking, every queue must have
been read or drained to the end, or unread messages count as lost.

Command line (from the repository root):
``python -m tests.support.history HISTORY.jsonl [--at-least-once] [--allow-unanswered] [--show N]``
prints the verdict; exit 0 when the history is valid, 1 on violations, 2 on bad input.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["History", "Verdict", "Violation", "check", "load", "main"]

_ALLOWED = {
    "enqueue": {200, 201, 429},
    "deliver": {200},
    "ack": {200},
}


class History:
    """An append-only list of events; cheap enough to record from a hot client loop."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def enqueue(
        self,
        queue: str,
        msg_id: str,
        t0: float,
        t1: float,
        status: int,
        seq: int | None = None,
        key: str | None = None,
        retry_after: bool = False,
    ) -> None:
        self.events.append(
            {
                "op": "enqueue",
                "queue": queue,
                "id": msg_id,
                "key": key,
                "t0": t0,
                "t1": t1,
                "status": status,
                "seq": seq,
                "retry_after": retry_after,
            }
        )

    def deliver(
        self,
        queue: str,
        mode: str,
        t0: float,
        t1: float,
        status: int,
        items: Sequence[tuple[int, str]] = (),
        from_seq: int | None = None,
        epoch: str | None = None,
        retry_after: bool = False,
        conn: int | None = None,
    ) -> None:
        extra = {} if conn is None else {"conn": conn}
        self.events.append(
            {
                **extra,
                "op": "deliver",
                "mode": mode,
                "queue": queue,
                "t0": t0,
                "t1": t1,
                "status": status,
                "from": from_seq,
                "items": [[s, i] for s, i in items],
                "epoch": epoch,
                "retry_after": retry_after,
            }
        )

    def ack(
        self,
        queue: str,
        t0: float,
        t1: float,
        status: int,
        upto: int | None = None,
        seqs: Sequence[int] | None = None,
        retry_after: bool = False,
    ) -> None:
        self.events.append(
            {
                "op": "ack",
                "queue": queue,
                "t0": t0,
                "t1": t1,
                "status": status,
                "upto": upto,
                "seqs": list(seqs) if seqs is not None else None,
                "retry_after": retry_after,
            }
        )

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for e in self.events:
                f.write(json.dumps(e, separators=(",", ":")) + "\n")

    def check(self, exactly_once: bool = True, allow_unanswered: bool = False) -> Verdict:
        return check(self.events, exactly_once, allow_unanswered)


class HistoryError(ValueError):
    """The history file or records are malformed; the message says where."""


def load(path: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except ValueError:
                raise HistoryError(f"line {n}: not JSON") from None
            _validate(e, f"line {n}")
            events.append(e)
    return events


_REQUIRED = {
    "enqueue": ("queue", "id", "t0", "t1", "status"),
    "deliver": ("mode", "queue", "t0", "t1", "status", "items"),
    "ack": ("queue", "t0", "t1", "status"),
}


def _validate(e: Any, where: str) -> None:
    if not isinstance(e, dict) or e.get("op") not in _REQUIRED:
        raise HistoryError(f"{where}: expected an object with op enqueue, deliver or ack")
    missing = [k for k in _REQUIRED[e["op"]] if k not in e]
    if missing:
        raise HistoryError(f"{where}: {e['op']} record lacks {', '.join(missing)}")
    if e["op"] == "deliver" and not isinstance(e["items"], list):
        raise HistoryError(f"{where}: items must be a list of [seq, id]")


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    queue: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:<13} queue {self.queue}: {self.detail}"


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for v in self.violations:
            out[v.kind] += 1
        return dict(out)

    def render(self, show: int = 20) -> str:
        c = self.counts
        lines = [
            "history: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in c.items()),
        ]
        if self.ok:
            lines.append("verdict: OK — every guarantee held")
        else:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.by_kind().items()))
            lines.append(f"verdict: {len(self.violations)} VIOLATION(S) ({kinds}); first {show}:")
            lines.extend(f"  {v}" for v in self.violations[:show])
        return "\n".join(lines)


@dataclass
class _Msg:
    """One logical message (an id) as the enqueue side saw it."""

    queue: str
    first_t0: float
    seq: int | None = None  # from the first 2xx answer
    acked_t1: float | None = None  # end of the first 2xx answer
    created: int = 0  # 201 answers with a key
    seqs_seen: set[int] = field(default_factory=set)
    keys: set[str | None] = field(default_factory=set)
    attempts: int = 0


def _status_ok(e: dict[str, Any], out: list[Violation], allow_unanswered: bool = False) -> bool:
    status = int(e["status"])
    op = e["op"]
    if status in _ALLOWED[op]:
        return True
    what = f"{op} [{e['t0']:.3f}..{e['t1']:.3f}]"
    if status == 0 and allow_unanswered:
        pass  # the relay process died mid-request: the client retries (counted as unanswered)
    elif status == 0:
        out.append(Violation("status", e["queue"], f"{what} got no response"))
    elif status == 503 and e.get("retry_after"):
        pass  # retryable by contract
    elif status >= 500:
        extra = "" if status != 503 else " without Retry-After"
        out.append(Violation("status", e["queue"], f"{what} answered {status}{extra}"))
    else:
        out.append(Violation("status", e["queue"], f"{what} answered {status}"))
    return False


def check(
    events: Iterable[dict[str, Any]], exactly_once: bool = True, allow_unanswered: bool = False
) -> Verdict:
    """Verify a history (see the module docstring for what each violation means).

    ``allow_unanswered``: a request that got no response (status 0: its relay process was
    killed) is not itself a violation; what it did must still be consistent, e.g. a drain
    whose answer was lost does lose its messages, so such runs use read+ack queues."""
    v: list[Violation] = []
    msgs: dict[str, _Msg] = {}
    deliveries: dict[str, list[dict[str, Any]]] = defaultdict(list)
    acks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for n, e in enumerate(events):
        _validate(e, f"event {n}")
        ok = _status_ok(e, v, allow_unanswered)
        if int(e["status"]) == 0:
            counts["unanswered"] += 1
        if e["op"] != "enqueue" and int(e["status"]) == 503:
            counts["retryable_503"] += 1
        if e["op"] == "enqueue":
            counts["enqueue_attempts"] += 1
            m = msgs.get(e["id"])
            if m is None:
                m = msgs[e["id"]] = _Msg(e["queue"], float(e["t0"]))
            elif m.queue != e["queue"]:
                v.append(Violation("phantom", e["queue"], f"id {e['id']} enqueued to two queues"))
            m.attempts += 1
            m.first_t0 = min(m.first_t0, float(e["t0"]))
            m.keys.add(e.get("key"))
            status = int(e["status"])
            if status == 503:
                counts["retryable_503"] += 1
            if ok and status in (200, 201):
                seq = int(e["seq"])
                m.seqs_seen.add(seq)
                if m.acked_t1 is None or float(e["t1"]) < m.acked_t1:
                    m.acked_t1 = float(e["t1"])
                    m.seq = seq if m.seq is None else m.seq
                if status == 201:
                    m.created += 1
                else:
                    counts["idempotent_duplicates"] += 1
        elif e["op"] == "deliver":
            if ok:
                deliveries[e["queue"]].append(e)
        elif ok:
            acks[e["queue"]].append(e)

    acked = {i: m for i, m in msgs.items() if m.seq is not None}
    counts["messages_acknowledged"] = len(acked)
    for i, m in msgs.items():
        if m.attempts > 1 and None in m.keys:
            v.append(Violation("idempotency", m.queue, f"id {i} retried without an Idempotency-Key"))
        if len(m.keys - {None}) > 1:
            v.append(Violation("idempotency", m.queue, f"id {i} sent with different Idempotency-Keys"))
        if len(m.seqs_seen) > 1:
            v.append(Violation("idempotency", m.queue, f"id {i} answered with seqs {sorted(m.seqs_seen)}"))
        if m.created > 1 and None not in m.keys:
            v.append(Violation("idempotency", m.queue, f"id {i} was stored {m.created} times (201 each)"))

    queues = sorted(set(deliveries) | set(acks) | {m.queue for m in msgs.values()})
    for q in queues:
        _check_queue(q, msgs, acked, deliveries.get(q, []), acks.get(q, []), exactly_once, v, counts)
    return Verdict(v, dict(counts))


def _check_queue(
    q: str,
    msgs: dict[str, _Msg],
    acked: dict[str, _Msg],
    dels: list[dict[str, Any]],
    acks: list[dict[str, Any]],
    exactly_once: bool,
    v: list[Violation],
    counts: dict[str, int],
) -> None:
    mine = sorted((m.seq, i) for i, m in acked.items() if m.queue == q and m.seq is not None)
    by_seq: dict[int, str] = {}
    for seq, i in mine:
        if seq in by_seq:
            v.append(Violation("phantom", q, f"ids {by_seq[seq]} and {i} both answered seq {seq}"))
        by_seq[seq] = i

    # FIFO of enqueues: finished-before-started must mean smaller seq (sweep by seq, descending).
    min_end, min_id = float("inf"), ""
    for _seq, i in reversed(mine):
        m = acked[i]
        if min_end < m.first_t0:
            v.append(Violation("fifo", q, f"id {min_id} finished before id {i} began, yet got a larger seq"))
        assert m.acked_t1 is not None
        if m.acked_t1 < min_end:
            min_end, min_id = m.acked_t1, i

    # Removals: when each seq was (possibly) removed, by an ack or a drain.
    rm_start: dict[int, float] = {}
    rm_end: dict[int, float] = {}

    def removed(seq: int, t0: float, t1: float) -> None:
        rm_start[seq] = min(rm_start.get(seq, t0), t0)
        rm_end[seq] = min(rm_end.get(seq, t1), t1)

    delivered_seqs = sorted({int(s) for d in dels for s, _ in d["items"]} | set(by_seq))
    for a in acks:
        if a.get("upto") is not None:
            hi = bisect.bisect_right(delivered_seqs, int(a["upto"]))
            for seq in delivered_seqs[:hi]:
                removed(seq, float(a["t0"]), float(a["t1"]))
        for seq in a.get("seqs") or ():
            removed(int(seq), float(a["t0"]), float(a["t1"]))
    for d in dels:
        if d["mode"] == "drain":
            for s, _ in d["items"]:
                removed(int(s), float(d["t0"]), float(d["t1"]))
    counts["acks"] += len(acks)

    # Until its first message is stored, a queue has no keys and no history: reads answer a
    # placeholder epoch derived from the shard they reach (docs/api.md: unknown-queue reads
    # write nothing), which a failover or a migration may change with nothing lost. A read
    # is the queue's own once it returned messages or began after an enqueue to the queue
    # was answered; a read overlapping the first enqueue may still see a placeholder.
    stored = min(
        (m.acked_t1 for m in msgs.values() if m.queue == q and m.acked_t1 is not None), default=float("inf")
    )
    epochs = {d["epoch"] for d in dels if d.get("epoch") and (d["items"] or float(d["t0"]) >= stored)}
    if len(epochs) > 1:
        v.append(Violation("epoch", q, f"{len(epochs)} different epochs seen"))

    _check_displaced(q, dels, v)
    delivered: dict[str, list[int]] = defaultdict(list)  # id -> delivery indexes
    seq_id: dict[int, str] = {}
    for n, d in enumerate(dels):
        counts["deliveries"] += 1
        items = [(int(s), str(i)) for s, i in d["items"]]
        t0, t1 = float(d["t0"]), float(d["t1"])
        seqs = [s for s, _ in items]
        if any(b <= a for a, b in itertools.pairwise(seqs)):
            v.append(Violation("fifo", q, f"one {d['mode']} returned seqs out of order: {seqs[:10]}"))
        if d["mode"] == "read" and d.get("from") is not None and seqs and seqs[0] < int(d["from"]):
            v.append(Violation("fifo", q, f"read fromSeq={d['from']} returned seq {seqs[0]}"))
        for s, i in items:
            counts["messages_delivered"] += 1
            delivered[i].append(n)
            sent = msgs.get(i)
            if sent is None or sent.queue != q:
                v.append(Violation("phantom", q, f"seq {s} carries id {i}, never enqueued to this queue"))
            elif sent.seq is not None and sent.seq != s:
                v.append(
                    Violation("phantom", q, f"id {i} delivered as seq {s}, enqueue answered seq {sent.seq}")
                )
            if seq_id.setdefault(s, i) != i:
                v.append(Violation("phantom", q, f"seq {s} delivered as id {seq_id[s]} and as id {i}"))
            if s in rm_end and rm_end[s] < t0:
                # something removed it (an ack, or another drain) before this response began
                v.append(Violation("after_removal", q, f"seq {s} (id {i}) delivered after its ack/drain"))
        # Nothing older that was stored before this response began, and still held, may be missing.
        if items:
            lo = int(d["from"]) if d["mode"] == "read" and d.get("from") is not None else 0
            hi = seqs[-1]
            got = set(seqs)
            start = bisect.bisect_left(mine, (lo, ""))
            for seq, i in mine[start:]:
                if seq >= hi:
                    break
                m = acked[i]
                assert m.acked_t1 is not None
                if seq in got or m.acked_t1 >= t0:
                    continue
                if seq in rm_start and rm_start[seq] < t1:
                    continue
                v.append(
                    Violation(
                        "skipped", q, f"a {d['mode']} returned seq {hi} but not older seq {seq} (id {i})"
                    )
                )

    for i, ns in delivered.items():
        copies = Counter((int(s), dels[n].get("epoch")) for n in ns for s, j in dels[n]["items"] if j == i)
        as_seqs = {s for s, _ in copies}
        restored = len(as_seqs) > 1 and _one_copy_per_epoch(copies)
        if restored:
            v.append(
                Violation("restored", q, f"id {i} stored again in a new epoch, as seqs {sorted(as_seqs)}")
            )
        elif len(as_seqs) > 1:
            v.append(Violation("phantom", q, f"id {i} delivered as seqs {sorted(as_seqs)}: stored twice"))
        if len(ns) > 1:
            drains = [n for n in ns if dels[n]["mode"] == "drain"]
            if len(drains) > 1:
                v.append(Violation("duplicate", q, f"id {i} returned by {len(drains)} drains"))
            elif exactly_once and (not restored or max(copies.values()) > 1):
                v.append(Violation("duplicate", q, f"id {i} delivered {len(ns)} times"))
    for seq, i in mine:
        if i not in delivered:
            v.append(Violation("lost", q, f"id {i} (seq {seq}) was acknowledged but never delivered"))
    counts["queues"] += 1


def _one_copy_per_epoch(copies: Counter[tuple[int, Any]]) -> bool:
    """Each (seq, epoch) copy of one message in an epoch of its own, every epoch named."""
    epochs = [e for _, e in copies]
    return None not in epochs and len(set(epochs)) == len(copies)


def _check_displaced(q: str, dels: list[dict[str, Any]], v: list[Violation]) -> None:
    """No frame on a live connection arrives after a newer connection's first frame."""
    first: dict[int, float] = {}
    for d in dels:
        if d.get("conn") is not None and d["items"]:
            c, t1 = int(d["conn"]), float(d["t1"])
            first[c] = min(first.get(c, t1), t1)
    if len(first) < 2:
        return
    for d in dels:
        if d.get("conn") is None or not d["items"]:
            continue
        c, t1 = int(d["conn"]), float(d["t1"])
        newer = [(t, n) for n, t in first.items() if n > c and t < t1]
        if newer:
            t, n = min(newer)
            seqs = [int(s) for s, _ in d["items"]]
            v.append(
                Violation(
                    "displaced",
                    q,
                    f"connection {c} got seqs {seqs[:5]} {t1 - t:.4f}s after connection {n}'s first frame",
                )
            )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.support.history", description="Verify a recorded relay history"
    )
    p.add_argument("history", help="JSON-lines history file")
    p.add_argument("--at-least-once", action="store_true", help="allow re-deliveries before the ack")
    p.add_argument(
        "--allow-unanswered",
        action="store_true",
        help="requests with no response (killed relay) are no violation",
    )
    p.add_argument("--show", type=int, default=20, help="violations to print (default 20)")
    args = p.parse_args(argv)
    try:
        events = load(args.history)
    except OSError as exc:
        print(f"tests.support.history: cannot read {args.history}: {exc.strerror}", file=sys.stderr)
        return 2
    except HistoryError as exc:
        print(f"tests.support.history: {args.history}: {exc}", file=sys.stderr)
        return 2
    try:
        verdict = check(events, exactly_once=not args.at_least_once, allow_unanswered=args.allow_unanswered)
    except (TypeError, ValueError, KeyError) as exc:
        print(
            f"tests.support.history: {args.history}: malformed record ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 2
    print(verdict.render(args.show))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
