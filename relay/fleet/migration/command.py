"""`relayfleet migrate (--shard-map FILE | --shard-map-configmap NS/NAME) --slots A-B --to SHARD`:
the command line around `migrate_slots` on the map where the relays read it, with a progress bar
on stderr and exit codes 0/1/2."""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from relay.fleet.migration.errors import MigrationError
from relay.fleet.migration.map_file import file_publisher, file_reader
from relay.fleet.migration.protocol import migrate_slots, validate_request
from relay.fleet.migration.publishing import MapPlace
from relay.fleet.migration.report import Progress
from relay.fleet.sharding import ShardMap, ShardMapError, parse_slot_spec
from relay.progress import ProgressReporter

__all__ = ["ProgressBar", "file_place", "migrate_main"]


class ProgressBar:
    """Slots, keys and bytes on stderr: redrawn in place on a terminal, a line now and then otherwise."""

    def __init__(self, target: str, stream: TextIO | None = None, width: int = 28) -> None:
        self.target = target
        self.width = width
        self.out = ProgressReporter("migrate", stream=stream, redraw=True, every_pct=None)

    def __call__(self, p: Progress) -> None:
        final = p.phase == "done"
        if not self.out.due("", final=final):
            return
        frac = p.slots_done / p.slots_total if p.slots_total else 1.0
        filled = round(frac * self.width)
        rate = p.bytes / 1e6 / p.elapsed_s if p.elapsed_s > 0 else 0.0
        self.out.show(
            f"migrate -> {self.target} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{p.slots_done}/{p.slots_total} slots  {p.keys} keys  {p.bytes / 1e6:.1f} MB  "
            f"{rate:.1f} MB/s  {p.phase}",
            final,
        )


def file_place(path: str) -> MapPlace:
    """The shard map file the relays reload (`--shard-map FILE`)."""
    return MapPlace(f"shard map {path}", file_reader(path), file_publisher(path))


async def _read(place: MapPlace) -> ShardMap:
    return await place.read()


def migrate_main(place: MapPlace, slots: str, to: str) -> int:
    """`relayfleet migrate`: 0 done, 2 bad arguments (or an unreadable map), 1 failed."""
    try:
        wanted = parse_slot_spec(slots)
        shard_map = asyncio.run(_read(place))
        validate_request(shard_map, wanted, to)
    except OSError as exc:
        print(f"relayfleet migrate: cannot read {place.where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ShardMapError, MigrationError) as exc:
        print(f"relayfleet migrate: {exc}", file=sys.stderr)
        return 2
    bar = ProgressBar(to)
    try:
        report = asyncio.run(migrate_slots(shard_map, wanted, to, place.publish, bar, current_map=place.read))
    except (MigrationError, ShardMapError) as exc:
        print(f"\nrelayfleet migrate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"\nrelayfleet migrate: cannot write {place.where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0
