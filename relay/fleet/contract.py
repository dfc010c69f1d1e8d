"""What the relay, the operator and the Spark jobs exchange about a fleet, written once.

- `Move`: a contiguous slot range changing owner, and its JSON form
  ({"slots": "A-B", "from", "to", "bytes", "messages"}) as the Spark rebalance job writes it
  into a RelayRebalance proposal and the operator reads it back;
- slot ranges ("A-B" or "A"), parsed in one place (`relay.fleet.sharding.parse_slot_range`);
- the shard-map ConfigMap: its name, its `data` both ways (docs/api.md, "Shard map"), and the
  optimistic-concurrency update loop both writers (the operator, `relay.fleet.configmap`) run
  over their own clients;
- `Obj`, the alias for a JSON object / Kubernetes object.

Pure, like `relay.fleet.sharding` below it: importing it pulls in no Redis client, no
Kubernetes client and no server code (the standard library, and the retry policies of the
leaf `relay.retrying`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from relay.fleet.sharding import ShardMap, ShardMapError, loads_shard_map, parse_slot_range
from relay.retrying import MAP_WRITE, retrying

Obj = dict[str, Any]
"""A JSON object: a Kubernetes object, a status block, a plan document."""

SHARDMAP_KEY = "shardmap.json"


def shardmap_configmap_name(fleet: str) -> str:
    """The ConfigMap a fleet's shard map lives in (docs/api.md, "Shard map")."""
    return f"relayfleet-{fleet}-shardmap"


def shard_map_configmap_data(shard_map: ShardMap) -> dict[str, str]:
    """The ConfigMap `data` that carries `shard_map`."""
    return {SHARDMAP_KEY: shard_map.dumps()}


def shard_map_from_configmap_data(data: Mapping[str, str] | None, where: str) -> ShardMap:
    """The shard map a ConfigMap's `data` carries; ShardMapError naming the ConfigMap (`where`,
    "namespace/name") when the key is missing or the map breaks the contract."""
    text = (data or {}).get(SHARDMAP_KEY)
    if not text:
        raise ShardMapError(f"ConfigMap {where} has no key {SHARDMAP_KEY}")
    try:
        return loads_shard_map(text)
    except ShardMapError as exc:
        raise ShardMapError(f"ConfigMap {where}: {exc}") from None


class PlanError(ValueError):
    """A move or proposal that cannot be executed against the current shard map."""


@dataclass(frozen=True, slots=True)
class Move:
    start: int
    end: int  # inclusive
    source: str
    target: str
    bytes: int = 0
    messages: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start + 1

    @property
    def slots(self) -> str:
        return str(self.start) if self.start == self.end else f"{self.start}-{self.end}"

    def slot_list(self) -> list[int]:
        return list(range(self.start, self.end + 1))

    def to_json(self) -> dict[str, object]:
        """The move as a RelayRebalance proposal / status entry carries it."""
        return {
            "slots": self.slots,
            "from": self.source,
            "to": self.target,
            "bytes": self.bytes,
            "messages": self.messages,
        }


def parse_slots(text: str) -> tuple[int, int]:
    """An "A-B" or "A" slot range; PlanError with the contract's text otherwise."""
    try:
        return parse_slot_range(text)
    except ShardMapError as exc:
        raise PlanError(str(exc)) from None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def move_from_json(doc: Mapping[str, object]) -> Move:
    """A Move from its JSON form (`Move.to_json`); PlanError for anything else."""
    slots, source, target = doc.get("slots"), doc.get("from"), doc.get("to")
    if not isinstance(slots, str) or not isinstance(source, str) or not isinstance(target, str):
        raise PlanError("each move needs string fields slots, from and to")
    if source == target:
        raise PlanError(f"move of slots {slots} has the same from and to ({source})")
    start, end = parse_slots(slots)
    return Move(start, end, source, target, _count(doc.get("bytes", 0)), _count(doc.get("messages", 0)))


# -- the shard-map ConfigMap's optimistic-concurrency update ---------------------------------

V = TypeVar("V")  # the writer's resource version (or whole object) for a conditional write


class MapWriteConflict(Exception):
    """A conditional write lost a race (HTTP 409): read again and recompute."""


@dataclass(frozen=True)
class MapStore(Generic[V]):
    """One writer's access to the ConfigMap. `read` returns (the map or None, a version or None
    when the ConfigMap is missing); `write(map, version)` creates (version None) or replaces
    conditionally, raising MapWriteConflict when the version is stale; `delete` removes it."""

    read: Callable[[], Awaitable[tuple[ShardMap | None, V | None]]]
    write: Callable[[ShardMap, V | None], Awaitable[None]]
    delete: Callable[[], Awaitable[None]] | None = None


MapChange = Callable[[ShardMap | None], ShardMap | None]


async def update_shard_map(
    store: MapStore[V], change: MapChange, attempts: int
) -> tuple[ShardMap | None, bool]:
    """Apply `change` to the current map; (the map now, whether it was written).

    `change` returns the current map (or an equal one) for "nothing to do", None to
    delete, or the new map. A lost race re-reads and recomputes (after a short backoff,
    relay/retrying.py MAP_WRITE), so two writers never lose each other's update; after
    `attempts` lost races MapWriteConflict is raised.
    """

    async def attempt() -> tuple[ShardMap | None, bool]:
        current, version = await store.read()
        wanted = change(current)
        if wanted is current or (wanted is not None and current is not None and wanted == current):
            return current, False
        if wanted is None:
            if store.delete is None:
                raise PlanError("this writer cannot delete the shard map")
            await store.delete()
        else:
            await store.write(wanted, version)
        return wanted, True

    try:
        result: tuple[ShardMap | None, bool] = await retrying(MAP_WRITE, MapWriteConflict, attempts=attempts)(
            attempt
        )
    except MapWriteConflict:
        raise MapWriteConflict(f"the shard map kept changing under us ({attempts} attempts)") from None
    return result
