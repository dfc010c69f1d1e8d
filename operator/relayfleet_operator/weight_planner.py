"""Slot moves the operator proposes by itself: balance by weight, or drain shards.

The Spark rebalance job plans by measured load; these plans use only slot counts and
RelayShard weights, which is what the operator knows without scanning Redis. Both produce
the same Move shape, so the executor does not care who planned. Pure functions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from relay.fleet.contract import Move, PlanError
from relay.fleet.sharding import SLOT_COUNT, ShardMap


def validate_moves(shard_map: ShardMap, moves: Sequence[Move]) -> None:
    """Every move's slots must be owned by its source now, targets must exist, and no slot
    may be moved twice in one plan (moves would race otherwise)."""
    seen: set[int] = set()
    for move in moves:
        if move.target not in shard_map.shards:
            raise PlanError(f"move {move.slots}: target shard {move.target!r} is not in the shard map")
        if move.source not in shard_map.shards:
            raise PlanError(f"move {move.slots}: source shard {move.source!r} is not in the shard map")
        for slot in move.slot_list():
            if slot in seen:
                raise PlanError(f"slot {slot} is moved more than once in this proposal")
            seen.add(slot)
            owner = shard_map.shard_for_slot(slot)
            if owner != move.source:
                raise PlanError(f"move {move.slots}: slot {slot} is owned by {owner!r}, not {move.source!r}")


def target_counts(weights: Mapping[str, int]) -> dict[str, int]:
    """Slots per shard proportional to weight (largest remainder), summing to 16384."""
    total = sum(w for w in weights.values() if w > 0)
    if total <= 0:
        raise PlanError("no shard with a positive weight is left to hold the slots")
    names = sorted(weights)
    exact = {n: SLOT_COUNT * max(weights[n], 0) / total for n in names}
    counts = {n: int(exact[n]) for n in names}
    left = SLOT_COUNT - sum(counts.values())
    for n in sorted(names, key=lambda n: (-(exact[n] - counts[n]), n))[:left]:
        counts[n] += 1
    return counts


def _owned_ranges(shard_map: ShardMap, shard: str) -> list[tuple[int, int]]:
    return [(r.start, r.end) for r in shard_map.ranges if r.shard == shard]


def _carve(shard_map: ShardMap, donors: Mapping[str, int], receivers: Mapping[str, int]) -> list[Move]:
    """Take `donors[s]` slots from the top of each donor's ranges and hand them out to the
    receivers in order, as contiguous pieces (fewer, larger moves keep migrations cheap)."""
    need = [(name, count) for name, count in sorted(receivers.items()) if count > 0]
    moves: list[Move] = []
    ri = 0
    for donor in sorted(donors):
        give = donors[donor]
        for start, end in reversed(_owned_ranges(shard_map, donor)):
            hi = end
            while give > 0 and hi >= start and ri < len(need):
                target, want = need[ri]
                take = min(give, want, hi - start + 1)
                moves.append(Move(hi - take + 1, hi, donor, target))
                hi -= take
                give -= take
                want -= take
                need[ri] = (target, want)
                if want == 0:
                    ri += 1
            if give == 0:
                break
    return _merge(moves)


def _merge(moves: Iterable[Move]) -> list[Move]:
    out: list[Move] = []
    for m in sorted(moves, key=lambda m: (m.source, m.target, m.start)):
        last = out[-1] if out else None
        if last and (last.source, last.target) == (m.source, m.target) and last.end + 1 == m.start:
            out[-1] = replace(last, end=m.end)
        else:
            out.append(m)
    return sorted(out, key=lambda m: m.start)


def plan_by_weight(shard_map: ShardMap, weights: Mapping[str, int]) -> list[Move]:
    """Moves that bring every shard's slot count to its weight's share.

    Shards in the map without a weight get weight 0 (they are drained)."""
    all_weights = {name: weights.get(name, 0) for name in shard_map.shards}
    targets = target_counts(all_weights)
    counts = shard_map.slot_counts()
    donors = {n: counts[n] - targets[n] for n in counts if counts[n] > targets[n]}
    receivers = {n: targets[n] - counts[n] for n in counts if counts[n] < targets[n]}
    return _carve(shard_map, donors, receivers)


def plan_drain(shard_map: ShardMap, draining: Collection[str], weights: Mapping[str, int]) -> list[Move]:
    """Moves that empty the `draining` shards, sending their slots to the others so that the
    result is as close to balanced by weight as moving only those slots allows."""
    for name in draining:
        if name not in shard_map.shards:
            raise PlanError(f"shard {name!r} is not in the shard map")
    counts = shard_map.slot_counts()
    remaining = {n: weights.get(n, 0) for n in shard_map.shards if n not in draining}
    if not any(w > 0 for w in remaining.values()):
        raise PlanError("no shard would be left to take the slots")
    targets = target_counts(remaining)
    donors = {n: counts[n] for n in draining if counts[n] > 0}
    to_move = sum(donors.values())
    if to_move == 0:
        return []
    deficits = {n: max(0, targets[n] - counts[n]) for n in remaining}
    total_deficit = sum(deficits.values())
    # Scale the deficits to exactly the slots we have to place (largest remainder again).
    if total_deficit == 0:
        shares = {n: w for n, w in remaining.items() if w > 0}
    else:
        shares = {n: d for n, d in deficits.items() if d > 0}
    total = sum(shares.values())
    exact = {n: to_move * s / total for n, s in shares.items()}
    alloc = {n: int(x) for n, x in exact.items()}
    left = to_move - sum(alloc.values())
    for n in sorted(exact, key=lambda n: (-(exact[n] - alloc[n]), n))[:left]:
        alloc[n] += 1
    return _carve(shard_map, donors, alloc)


def apply_moves(shard_map: ShardMap, moves: Iterable[Move]) -> ShardMap:
    """The map after all `moves` (epoch + 1 per move, as the executor publishes them)."""
    for move in moves:
        shard_map = shard_map.with_slots(move.slot_list(), move.target)
    return shard_map
