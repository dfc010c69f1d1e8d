"""Rebalance planning as pure functions over plain data, plus `relayfleet plan`.

Input: the shard map, per-slot load statistics (messages, bytes, enqueue rate)
and shard weights. Output: slot moves that bring the most loaded shard's
load/weight within `tolerance` of the fleet mean, moving as few bytes as
possible, in contiguous ranges, never touching a slot that is not plainly owned
(migrating, importing, moved).

How a plan is built (greedy, one move per round):
  1. every shard's utilisation u = load / weight; T = total load / total weight;
     the allowed ceiling is T * (1 + tolerance);
  2. the hottest shard gives one contiguous window of its movable slots to one
     colder shard (of the few with the most room, the least utilised, or owning a
     slot next to the hot shard's: a round costs O(slots / shards)). Windows are
     scored, best first:
       a. hot ends under the ceiling and the receiver stays under it: fewest
          bytes (within 5%), then fewest new map fragments, then fewest slots;
       b. receiver stays under the ceiling: the most load moved (within 10%),
          then fewest bytes, then fewest fragments — progress, and the next
          round fills the next receiver;
       c. otherwise any window that lowers the pair's maximum, the lowest
          resulting maximum first;
  3. repeat until balanced or no window improves things.
A slot that moves twice (a -> b -> c) is reported once (a -> c); the moves
are the final ownership differences grouped into contiguous ranges.

The load of a slot depends on the metric: `bytes`, `messages`, `rate`
(enqueues per minute), or `blend` (default): half its share of the fleet's
bytes plus half its share of the fleet's enqueue rate. Bytes are what a
move costs, so a blend makes write-hot but small slots the cheap ones to move.

pyspark is never imported here: `relayfleet plan` runs this without Spark.
"""

from __future__ import annotations

import bisect
import heapq
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from relay.fleet.contract import Move
from relay.fleet.sharding import SLOT_COUNT, ShardMap
from relay.storage.maintenance import MaintenanceError

METRICS = ("blend", "bytes", "messages", "rate")
DEFAULT_TOLERANCE = 0.10
# Below both, a fleet is idle: nothing worth moving, whatever the ratios (2 enqueues a minute
# on one shard is "200% of the mean" and still no reason to move a slot). The CLI's defaults;
# plan() itself applies no floor unless asked.
MIN_BYTES = 64 * 1024 * 1024
MIN_RATE = 60.0  # enqueues per minute, the whole fleet
_MAX_ROUNDS = 512
# Receivers offered each round by room and by utilisation (each), besides the hot shard's
# neighbours: see _receivers.
_RECEIVERS = 4


class PlanningError(ValueError):
    """Inputs the planner cannot use (unknown shard in weights, bad tolerance)."""


@dataclass(frozen=True, slots=True)
class SlotLoad:
    slot: int
    shard: str  # the owner the shard map names (statistics were read there)
    msgs: int = 0
    bytes: int = 0
    rate: float = 0.0  # enqueues per minute
    state: str | None = None  # None = owned; anything else: never moved

    @property
    def movable(self) -> bool:
        return self.state is None

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> SlotLoad:
        return SlotLoad(
            slot=int(row["slot"]),
            shard=str(row["shard"]),
            msgs=int(row.get("msgs") or 0),
            bytes=int(row.get("bytes") or 0),
            rate=float(row.get("rate") or 0.0),
            state=row.get("state"),
        )


@dataclass(frozen=True, slots=True)
class ShardBalance:
    shard: str
    weight: float
    slots: int
    msgs: int
    bytes: int
    rate: float
    load: float
    ratio: float  # (load / weight) / (total load / total weight); 1.0 = exactly its share

    def to_json(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "messages": self.msgs,
            "bytes": self.bytes,
            "rate": round(self.rate, 3),
            "load": round(self.load, 6),
            "ratio": round(self.ratio, 4),
        }


@dataclass(frozen=True)
class Plan:
    fleet: str
    epoch: int
    metric: str
    tolerance: float
    moves: tuple[Move, ...]
    before: tuple[ShardBalance, ...]
    after: tuple[ShardBalance, ...]
    notes: tuple[str, ...] = field(default=())
    idle: bool = False  # below the minimum load: balanced by definition, no moves

    @property
    def bytes_moved(self) -> int:
        return sum(m.bytes for m in self.moves)

    @property
    def messages_moved(self) -> int:
        return sum(m.messages for m in self.moves)

    @property
    def slots_moved(self) -> int:
        return sum(m.end - m.start + 1 for m in self.moves)

    @staticmethod
    def max_ratio(balance: Iterable[ShardBalance]) -> float:
        return max((b.ratio for b in balance), default=0.0)

    @property
    def balanced(self) -> bool:
        return self.idle or self.max_ratio(self.after) <= 1.0 + self.tolerance + 1e-9

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "shardMapEpoch": self.epoch,
            "metric": self.metric,
            "tolerance": self.tolerance,
            "balanced": self.balanced,
            "idle": self.idle,
            "maxOverMean": {
                "before": round(self.max_ratio(self.before), 4),
                "after": round(self.max_ratio(self.after), 4),
            },
            "bytesMoved": self.bytes_moved,
            "messagesMoved": self.messages_moved,
            "slotsMoved": self.slots_moved,
            "moves": [m.to_json() for m in self.moves],  # a RelayRebalance's proposal.moves
            "shards": {
                b.shard: {"weight": b.weight, "before": b.to_json(), "after": a.to_json()}
                for b, a in zip(self.before, self.after, strict=True)
            },
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """Before/after balance, one line per shard, for people."""
        head = f"{'shard':<16} {'weight':>6} {'slots':>13} {'messages':>21} {'bytes':>25} {'load/mean':>15}"
        lines = [head, "-" * len(head)]
        for b, a in zip(self.before, self.after, strict=True):
            lines.append(
                f"{b.shard:<16} {b.weight:>6g} {b.slots:>6}->{a.slots:<6} {b.msgs:>10}->{a.msgs:<10} "
                f"{_size(b.bytes):>12}->{_size(a.bytes):<12} {b.ratio:>7.3f}->{a.ratio:<7.3f}"
            )
        lines.append(
            f"max load/mean {self.max_ratio(self.before):.3f} -> {self.max_ratio(self.after):.3f} "
            f"(tolerance {self.tolerance:g}); {len(self.moves)} moves, {self.slots_moved} slots, "
            f"{_size(self.bytes_moved)} moved"
        )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(line.rstrip() for line in lines)

    def proposal(self) -> dict[str, Any]:
        """The RelayRebalance `spec.proposal` carrying this plan (crds/relayrebalances.yaml)."""
        doc = self.to_json()
        return {
            "shardMapEpoch": self.epoch,
            "moves": doc["moves"],
            "summary": {
                k: doc[k]
                for k in ("metric", "tolerance", "maxOverMean", "bytesMoved", "slotsMoved", "balanced")
            },
        }

    def rebalance_manifest(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """A RelayRebalance object for `kubectl apply -f` (not approved: the operator waits)."""
        from spark_jobs.shard_io import GROUP, VERSION

        meta: dict[str, Any] = {"name": name}
        if namespace:
            meta["namespace"] = namespace
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RelayRebalance",
            "metadata": meta,
            "spec": {"fleet": self.fleet, "proposal": self.proposal()},
        }


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def slot_loads(stats: Sequence[SlotLoad], metric: str) -> list[float]:
    """Load of every slot (index = slot) under the metric; absent slots are 0."""
    if metric not in METRICS:
        raise PlanningError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    load = [0.0] * SLOT_COUNT
    total_bytes = sum(s.bytes for s in stats)
    total_rate = sum(s.rate for s in stats)
    for s in stats:
        if metric == "bytes":
            value = float(s.bytes)
        elif metric == "messages":
            value = float(s.msgs)
        elif metric == "rate":
            value = s.rate
        else:
            parts = []
            if total_bytes:
                parts.append(s.bytes / total_bytes)
            if total_rate:
                parts.append(s.rate / total_rate)
            value = sum(parts) / len(parts) if parts else 0.0
        load[s.slot] += value
    return load


def _owners(shard_map: ShardMap) -> list[str]:
    owner = [""] * SLOT_COUNT
    for r in shard_map.ranges:
        for s in range(r.start, r.end + 1):
            owner[s] = r.shard
    return owner


def _balance(
    shards: Sequence[str],
    weights: Mapping[str, float],
    owner: Sequence[str],
    load: Sequence[float],
    msgs: Sequence[int],
    nbytes: Sequence[int],
    rate: Sequence[float],
) -> tuple[ShardBalance, ...]:
    agg: dict[str, list[float]] = {s: [0, 0, 0, 0.0, 0.0] for s in shards}
    for slot in range(SLOT_COUNT):
        a = agg[owner[slot]]
        a[0] += 1
        a[1] += msgs[slot]
        a[2] += nbytes[slot]
        a[3] += rate[slot]
        a[4] += load[slot]
    total = sum(load)
    mean = total / sum(weights[s] for s in shards)
    return tuple(
        ShardBalance(
            shard=s,
            weight=weights[s],
            slots=int(agg[s][0]),
            msgs=int(agg[s][1]),
            bytes=int(agg[s][2]),
            rate=agg[s][3],
            load=agg[s][4],
            ratio=(agg[s][4] / weights[s]) / mean if mean > 0 else 1.0,
        )
        for s in shards
    )


@dataclass(frozen=True, slots=True)
class _Window:
    first: int  # slot
    last: int  # slot, inclusive
    load: float
    bytes: int
    frag: int  # change in the number of ranges of the map if moved


def plan(
    shard_map: ShardMap,
    stats: Sequence[SlotLoad],
    weights: Mapping[str, float] | None = None,
    metric: str = "blend",
    tolerance: float = DEFAULT_TOLERANCE,
    min_bytes: int = 0,
    min_rate: float = 0.0,
) -> Plan:
    """The moves that balance the fleet; see the module docstring for the method. A fleet
    holding fewer than `min_bytes` and taking fewer than `min_rate` enqueues a minute is idle:
    balanced, no moves."""
    if not 0 <= tolerance < 10:
        raise PlanningError(f"tolerance must be within 0..10, got {tolerance}")
    shards = list(shard_map.shards)
    w = {s: 1.0 for s in shards}
    for name, value in (weights or {}).items():
        if name not in w:
            raise PlanningError(f"weight given for unknown shard {name!r}")
        if not value > 0:
            raise PlanningError(f"weight of {name!r} must be > 0, got {value}")
        w[name] = float(value)

    owner0 = _owners(shard_map)
    load = slot_loads(stats, metric)
    msgs = [0] * SLOT_COUNT
    nbytes = [0] * SLOT_COUNT
    rate = [0.0] * SLOT_COUNT
    movable = [True] * SLOT_COUNT
    notes: list[str] = []
    stale = 0
    for s in stats:
        msgs[s.slot] += s.msgs
        nbytes[s.slot] += s.bytes
        rate[s.slot] += s.rate
        if not s.movable:
            movable[s.slot] = False
        if s.shard != owner0[s.slot]:
            stale += 1
            movable[s.slot] = False
    if stale:
        notes.append(f"{stale} slots reported by a shard the map does not name as owner; kept in place")
    pinned = sum(1 for m in movable if not m)
    if pinned:
        notes.append(f"{pinned} slots not movable (migrating, importing or moved) stay where they are")

    owner = list(owner0)
    total_bytes, total_rate = sum(nbytes), sum(rate)
    idle = total_bytes < min_bytes and total_rate < min_rate
    if idle:
        notes.append(
            f"fleet below the minimum load ({_size(total_bytes)} < {_size(min_bytes)} held, "
            f"{total_rate:.1f} < {min_rate:g} enqueues/min): nothing worth moving"
        )
    else:
        _greedy(shards, w, owner, load, nbytes, movable, tolerance, notes)
    moves = _diff(owner0, owner, nbytes, msgs)
    before = _balance(shards, w, owner0, load, msgs, nbytes, rate)
    after = _balance(shards, w, owner, load, msgs, nbytes, rate)
    return Plan(
        shard_map.fleet, shard_map.epoch, metric, tolerance, tuple(moves), before, after, tuple(notes), idle
    )


def _greedy(
    shards: Sequence[str],
    w: Mapping[str, float],
    owner: list[str],
    load: Sequence[float],
    nbytes: Sequence[int],
    movable: Sequence[bool],
    tolerance: float,
    notes: list[str],
) -> None:
    total = sum(load)
    if total <= 0 or len(shards) < 2:
        return
    target = total / sum(w.values())
    ceiling = target * (1 + tolerance)
    eps = total * 1e-12
    per_shard = {s: 0.0 for s in shards}
    for slot in range(SLOT_COUNT):
        per_shard[owner[slot]] += load[slot]

    for _ in range(_MAX_ROUNDS):
        util = {s: per_shard[s] / w[s] for s in shards}
        hot = max(shards, key=lambda s: (util[s], s))
        if util[hot] <= ceiling + eps:
            return
        segments = _segments(hot, owner, movable, load, nbytes)
        pool: list[_Candidate] = []
        for cold in _receivers(hot, shards, util, per_shard, w, ceiling, segments, owner):
            pool.extend(_candidates(segments, hot, cold, per_shard, w, ceiling, owner, load, eps))
        best = _choose(pool, util[hot])
        if best is None:
            notes.append(
                f"shard {hot!r} stays at {util[hot] / target:.3f}x the mean: no movable slot range lowers it"
            )
            return
        cold, win = best.cold, best.win
        for slot in range(win.first, win.last + 1):
            owner[slot] = cold
        per_shard[hot] -= win.load
        per_shard[cold] += win.load
    notes.append(f"stopped after {_MAX_ROUNDS} rounds")


@dataclass(frozen=True, slots=True)
class _Segment:
    """A maximal run of consecutive slots the hot shard owns and may move, with the prefix
    sums of their load and bytes (computed once a round, shared by every receiver)."""

    slots: list[int]
    prefix: list[float]
    bprefix: list[int]


def _segments(
    hot: str, owner: Sequence[str], movable: Sequence[bool], load: Sequence[float], nbytes: Sequence[int]
) -> list[_Segment]:
    runs: list[list[int]] = []
    cur: list[int] = []
    for slot in range(SLOT_COUNT):
        if owner[slot] == hot and movable[slot]:
            cur.append(slot)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    out = []
    for run in runs:
        prefix = [0.0]
        bprefix = [0]
        for slot in run:
            prefix.append(prefix[-1] + load[slot])
            bprefix.append(bprefix[-1] + nbytes[slot])
        out.append(_Segment(run, prefix, bprefix))
    return out


def _receivers(
    hot: str,
    shards: Sequence[str],
    util: Mapping[str, float],
    per_shard: Mapping[str, float],
    w: Mapping[str, float],
    ceiling: float,
    segments: Sequence[_Segment],
    owner: Sequence[str],
) -> list[str]:
    """The shards worth offering the hot shard's slots this round: the ones with the most room
    under the ceiling and the least utilised (they take the most load and lower the pair's
    maximum most), and the owners of the slots next to the hot shard's runs (the only ones a
    window can join without a new map range). Offering every shard made a round cost O(slots)
    whatever the fleet's size, and the rounds grow with the shards: the plan's time grew as
    shards^1.5 (docs/design-decisions.md, "Rebalance planning in near-linear time")."""
    others = [s for s in shards if s != hot]
    chosen = set(heapq.nsmallest(_RECEIVERS, others, key=lambda s: (per_shard[s] - ceiling * w[s], s)))
    chosen.update(heapq.nsmallest(_RECEIVERS, others, key=lambda s: (util[s], s)))
    for seg in segments:
        for nb in (seg.slots[0] - 1, seg.slots[-1] + 1):
            if 0 <= nb < SLOT_COUNT and owner[nb] != hot:
                chosen.add(owner[nb])
    return sorted(chosen)


def _frag(first: int, last: int, hot: str, cold: str, owner: Sequence[str]) -> int:
    """How many ranges the map gains (or loses, negative) if first..last goes to cold."""
    delta = 0
    for nb in (first - 1, last + 1):
        if 0 <= nb < SLOT_COUNT:
            delta += (owner[nb] != cold) - (owner[nb] != hot)
    return delta


@dataclass(frozen=True, slots=True)
class _Candidate:
    level: int  # 0: hot fixed, receiver fine; 1: receiver fine; 2: only the pair's maximum drops
    cold: str
    win: _Window
    pair_max: float  # max utilisation of the two shards after the move


def _candidates(
    segments: Sequence[_Segment],
    hot: str,
    cold: str,
    per_shard: Mapping[str, float],
    w: Mapping[str, float],
    ceiling: float,
    owner: Sequence[str],
    load: Sequence[float],
    eps: float,
) -> list[_Candidate]:
    """Windows of the hot shard's movable slots worth giving to `cold`.

    Only windows whose load lands near an interesting amount are generated
    (what the hot shard must shed, what the receiver can take, what levels the
    two), each with its zero-load extensions: O(slots) windows, not O(slots^2).
    """
    lh, lc, wh, wc = per_shard[hot], per_shard[cold], w[hot], w[cold]
    need = lh - ceiling * wh  # load the hot shard must shed to reach the ceiling
    room = ceiling * wc - lc  # load the receiver can take and stay under it
    limit = lh / wh * wc - lc  # this much or more makes the receiver the new maximum
    if limit <= eps:
        return []
    equal = (lh * wc - lc * wh) / (wh + wc)  # the amount that levels the two
    targets = sorted({t for t in (min(need, room), room, equal, need) if t > eps})
    windows: dict[tuple[int, int, int], _Window] = {}
    for k, seg in enumerate(segments):
        prefix = seg.prefix
        n = len(seg.slots)
        for i in range(n):
            if load[seg.slots[i]] <= 0:
                continue  # windows start on a loaded slot; zero slots join through the variants
            for t in targets:
                j = bisect.bisect_left(prefix, prefix[i] + t - eps, i + 1)
                for end in (j - 1, j):
                    if i < end <= n:
                        _add_variants(windows, k, seg, i, end, hot, cold, owner)
    out = []
    for win in windows.values():
        if win.load <= eps or win.load >= limit - eps:
            continue
        hot_ok = lh - win.load <= ceiling * wh + eps
        cold_ok = win.load <= room + eps
        level = 0 if hot_ok and cold_ok else 1 if cold_ok else 2
        out.append(_Candidate(level, cold, win, max((lh - win.load) / wh, (lc + win.load) / wc)))
    return out


def _choose(pool: Sequence[_Candidate], u_hot: float) -> _Candidate | None:
    """The best candidate of the best level (see the module docstring)."""
    if not pool:
        return None
    level = min(c.level for c in pool)
    best = [c for c in pool if c.level == level]
    if level == 1:
        most = max(c.win.load for c in best)
        best = [c for c in best if c.win.load >= 0.9 * most]
    elif level == 2:
        lowest = min(c.pair_max for c in best)
        if lowest > u_hot * 0.995:
            return None  # too little progress to be worth a migration
        best = [c for c in best if c.pair_max <= lowest * 1.01]
    cheapest = min(c.win.bytes for c in best)
    best = [c for c in best if c.win.bytes <= cheapest * 1.05 + 1]
    return min(best, key=lambda c: (c.win.frag, c.win.bytes, c.win.last - c.win.first, c.win.first, c.cold))


def _add_variants(
    windows: dict[tuple[int, int, int], _Window],
    k: int,
    seg: _Segment,
    i: int,
    j: int,
    hot: str,
    cold: str,
    owner: Sequence[str],
) -> None:
    """Window seg[i:j], and the same load widened over adjacent zero-load slots
    (costs nothing and may join the receiver's neighbouring range)."""
    prefix, bprefix = seg.prefix, seg.bprefix
    lo = bisect.bisect_left(prefix, prefix[i], 0, i + 1)
    hi = bisect.bisect_right(prefix, prefix[j], j) - 1
    for a in {i, lo}:
        for b in {j, hi}:
            if (k, a, b) in windows:
                continue
            first, last = seg.slots[a], seg.slots[b - 1]
            frag = _frag(first, last, hot, cold, owner)
            windows[(k, a, b)] = _Window(first, last, prefix[b] - prefix[a], bprefix[b] - bprefix[a], frag)


def _diff(
    before: Sequence[str], after: Sequence[str], nbytes: Sequence[int], msgs: Sequence[int]
) -> list[Move]:
    moves: list[Move] = []
    slot = 0
    while slot < SLOT_COUNT:
        if before[slot] == after[slot]:
            slot += 1
            continue
        start = slot
        while slot + 1 < SLOT_COUNT and before[slot + 1] == before[start] and after[slot + 1] == after[start]:
            slot += 1
        moves.append(
            Move(
                start,
                slot,
                before[start],
                after[start],
                sum(nbytes[start : slot + 1]),
                sum(msgs[start : slot + 1]),
            )
        )
        slot += 1
    return moves


# --- reading statistics without Spark (relayfleet plan) --------------------


def read_stats_direct(shard_map: ShardMap, at_ms: int, task_slots: int = 2048) -> list[SlotLoad]:
    """Every shard's per-slot statistics, one thread per task (I/O bound)."""
    from spark_jobs.shard_io import read_slot_stats, split_tasks

    tasks = split_tasks(shard_map, task_slots)
    with ThreadPoolExecutor(max_workers=min(8, len(tasks))) as pool:
        rows = [row for chunk in pool.map(lambda t: read_slot_stats(t, at_ms), tasks) for row in chunk]
    return [SlotLoad.from_row(r) for r in rows]


def add_plan_args(p: Any) -> None:
    """Options shared by `relayfleet plan` and the Spark rebalance job."""
    from spark_jobs.settings import add_source_args

    add_source_args(p)
    p.add_argument("--metric", choices=METRICS, default="blend", help="what load means (default: blend)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="allowed max load/mean above 1 (default: 0.1 = 10%% above the mean)",
    )
    p.add_argument(
        "--min-bytes",
        type=int,
        default=MIN_BYTES,
        metavar="N",
        help="with --min-rate: a fleet below both is idle, no moves (default: %(default)s)",
    )
    p.add_argument(
        "--min-rate",
        type=float,
        default=MIN_RATE,
        metavar="PER_MIN",
        help="fleet enqueues per minute below which (with --min-bytes) it is idle (default: %(default)s)",
    )
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="SHARD=W",
        help="shard weight (repeatable; default 1, or RelayShard spec.weight with a ConfigMap)",
    )
    p.add_argument("--table", action="store_true", help="print the before/after table on stderr")


def map_from_args(args: Any) -> ShardMap:
    """The shard map the flags name, else the one RELAY_SHARD_MAP / RELAY_SHARD_MAP_CONFIGMAP
    name (as `relayfleet relay` reads them; spark_jobs/settings.py: a flag wins over both)."""
    from spark_jobs.shard_io import load_shard_map

    return load_shard_map(args.shard_map, args.shard_map_configmap)


def resolve_weights(args: Any, shard_map: ShardMap) -> dict[str, float]:
    """Weights from --weight, else from the fleet's RelayShards when reading a ConfigMap."""
    from spark_jobs.shard_io import fleet_shard_specs, parse_weights, split_ns_name

    weights = parse_weights(args.weight)
    if not weights and args.shard_map_configmap:
        namespace, _ = split_ns_name(args.shard_map_configmap, "--shard-map-configmap")
        specs = fleet_shard_specs(namespace, shard_map.fleet)
        weights = {n: float(s.get("weight", 100)) for n, s in specs.items() if n in shard_map.shards}
    unknown = sorted(set(weights) - set(shard_map.shards))
    if unknown:
        from spark_jobs.shard_io import UsageError

        raise UsageError(f"--weight names shards not in the map: {', '.join(unknown)}")
    return weights


def plan_main(argv: list[str]) -> int:
    """`relayfleet plan`: read every shard's slot statistics, print the JSON plan."""
    from spark_jobs.settings import PLAN_SETTINGS, environment_help
    from spark_jobs.shard_io import ArgParser, JobError, UsageError, now_ms, parse_job_args, with_credentials

    p = ArgParser(
        prog="relayfleet plan",
        description="Rebalance plan without Spark; JSON on stdout.",
        epilog=environment_help(PLAN_SETTINGS),
    )
    add_plan_args(p)
    p.add_argument(
        "--rebalance-yaml",
        metavar="FILE",
        help="also write the plan as a RelayRebalance to FILE, for kubectl apply -f",
    )
    p.add_argument("--name", default="manual-rebalance", help="with --rebalance-yaml: its metadata.name")
    try:
        args = parse_job_args(p, argv)
        shard_map = map_from_args(args)
        weights = resolve_weights(args, shard_map)
        shard_map = with_credentials(shard_map, args.credentials_dir)
        stats = read_stats_direct(shard_map, now_ms())
        result = plan(shard_map, stats, weights, args.metric, args.tolerance, args.min_bytes, args.min_rate)
        if args.rebalance_yaml:
            write_rebalance_yaml(result, args.rebalance_yaml, args.name, args.shard_map_configmap)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, PlanningError) as exc:
        print(f"relayfleet plan: {exc}", file=sys.stderr)
        return 2
    except (JobError, MaintenanceError) as exc:
        print(f"relayfleet plan: {exc}", file=sys.stderr)
        return 1
    if args.table:
        print(result.table(), file=sys.stderr)
    print(json.dumps(result.to_json(), indent=2))
    return 0


def write_rebalance_yaml(result: Plan, path: str, name: str, configmap: str | None) -> None:
    """The plan as a RelayRebalance YAML file (in the ConfigMap's namespace when read from one)."""
    from spark_jobs.shard_io import JobError, UsageError

    try:
        import yaml
    except ImportError:
        raise UsageError("--rebalance-yaml needs pyyaml: pip install 'relayfleet[operator]'") from None
    namespace = configmap.partition("/")[0] if configmap else None
    try:
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(result.rebalance_manifest(name, namespace), f, sort_keys=False)
    except OSError as exc:
        raise JobError(f"cannot write {path}: {exc.strerror or exc}") from None
