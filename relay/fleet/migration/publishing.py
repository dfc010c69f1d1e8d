"""The hand-off between the protocol and whoever keeps the shard map: after each flipped batch
the protocol offers the next map to a `PublishMap`, and rebuilds on `CurrentMap` when the
keeper answers `MapConflict`. Implemented for a file (`map_file`) and for the ConfigMap
(`relay.fleet.configmap`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from relay.fleet.migration.errors import MigrationError
from relay.fleet.sharding import ShardMap

__all__ = ["CurrentMap", "MapConflict", "MapPlace", "PublishMap"]

PublishMap = Callable[[ShardMap], Awaitable[ShardMap | None]]
CurrentMap = Callable[[], Awaitable[ShardMap]]


class MapConflict(MigrationError):
    """A publisher found a map newer than the one it was given (someone else published)."""


@dataclass(frozen=True, slots=True)
class MapPlace:
    """Where a fleet's shard map is kept (a file, a ConfigMap): its name for messages, how to
    read it now and how to publish a newer one. OSError or ShardMapError from `read` mean the
    place is wrong (a configuration error)."""

    where: str
    read: CurrentMap
    publish: PublishMap
