"""Rebalance planning at scale: 16,384 slots over N shards, slot loads drawn from a Zipf law.

The figure is the planner's (spark_jobs.load_planner.plan, what the Spark job and `relayfleet
plan` run) time and the quality of its plan: max/mean shard load after. The anchors, from the
same loads: the lower bound max(mean, heaviest slot) / mean no plan can beat, and greedy LPT
(longest processing time first: each slot, heaviest first, onto the least loaded shard), which
ignores what the planner must respect (contiguous ranges, bytes moved).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable

from relayfleet_testing.bench.scale.report import Figure, Growth, PhaseReport

from relay.fleet.sharding import SLOT_COUNT, even_split
from spark_jobs.load_planner import SlotLoad, plan

Say = Callable[[str], None]


def zipf_loads(shards: int, skew: float, seed: int) -> list[SlotLoad]:
    """Every slot's load: the k-th heaviest ~ 1 / k^skew, ranks shuffled over the slots, on an
    even split of `shards` shards (bytes and enqueue rate alike, so every metric agrees)."""
    rng = random.Random(seed)
    ranks = list(range(1, SLOT_COUNT + 1))
    rng.shuffle(ranks)
    owners = _even_owners(shards)
    out = []
    for slot, rank in enumerate(ranks):
        weight = 1.0 / rank**skew
        out.append(
            SlotLoad(
                slot, owners[slot], msgs=int(1e6 * weight) + 1, bytes=int(1e9 * weight) + 1, rate=1e4 * weight
            )
        )
    return out


def _names(shards: int) -> list[str]:
    return [f"s{i:03d}" for i in range(shards)]


def _even_owners(shards: int) -> list[str]:
    m = even_split("bench", {n: f"redis://127.0.0.1:1/{i}" for i, n in enumerate(_names(shards))})
    owner = [""] * SLOT_COUNT
    for r in m.ranges:
        for s in range(r.start, r.end + 1):
            owner[s] = r.shard
    return owner


def lpt_max_over_mean(loads: list[float], shards: int) -> float:
    """Greedy LPT's max shard load / mean shard load."""
    heap = [(0.0, i) for i in range(shards)]
    for load in sorted(loads, reverse=True):
        total, i = heapq.heappop(heap)
        heapq.heappush(heap, (total + load, i))
    mean = sum(loads) / shards
    return max(t for t, _ in heap) / mean


def plan_once(shards: int, skew: float, seed: int) -> tuple[float, float, float, float, float, int]:
    """(plan seconds, max/mean before, after, LPT's max/mean, the lower bound, slots moved)."""
    stats = zipf_loads(shards, skew, seed)
    shard_map = even_split("bench", {n: f"redis://127.0.0.1:1/{i}" for i, n in enumerate(_names(shards))})
    # CPU time, not wall time: the planner is one thread of pure Python, and on a shared machine
    # wall time mostly says how long it waited for a core
    t0 = time.process_time()
    result = plan(shard_map, stats, metric="bytes")
    seconds = time.process_time() - t0
    loads = [float(s.bytes) for s in stats]
    mean = sum(loads) / shards
    bound = max(mean, max(loads)) / mean
    return (
        seconds,
        result.max_ratio(result.before),
        result.max_ratio(result.after),
        lpt_max_over_mean(loads, shards),
        bound,
        result.slots_moved,
    )


def run(shards: int, skew: float, seed: int, say: Say) -> PhaseReport:
    report = PhaseReport("rebalance", {"slots": SLOT_COUNT, "shards": shards, "Zipf skew": skew})
    sizes = sorted({max(2, shards // 4), max(2, shards // 2), shards})
    times: list[float] = []
    main: tuple[float, float, float, float, float, int] | None = None
    for n in sizes:
        say(f"rebalance: planning {SLOT_COUNT} slots over {n} shards (Zipf {skew})")
        got = plan_once(n, skew, seed)
        times.append(got[0])
        say(f"rebalance: {n} shards planned in {got[0]:.2f} s, max/mean {got[1]:.2f} -> {got[2]:.3f}")
        if n == shards:
            main = got
    assert main is not None
    seconds, before, after, lpt, bound, moved = main
    loads = [float(s.bytes) for s in zipf_loads(shards, skew, seed)]
    t0 = time.process_time()
    lpt_max_over_mean(loads, shards)
    lpt_s = time.process_time() - t0
    report.figures += [
        Figure("plan CPU time", seconds, "s", "greedy LPT over the same loads", lpt_s),
        Figure("max/mean load after the plan", after, "", "lower bound max(mean, heaviest slot)/mean", bound),
        Figure(
            "max/mean load after the plan (vs LPT)", after, "", "greedy LPT's max/mean (no contiguity)", lpt
        ),
        Figure("max/mean load before", before, "", "lower bound", bound),
        Figure("slots moved", float(moved), "", "slots in the fleet", float(SLOT_COUNT)),
    ]
    report.growth.append(Growth("plan CPU time", "s", tuple(sizes), tuple(times)))
    return report
