"""`relayfleet migrate --shard-map FILE --slots A-B --to SHARD`: the command line around
`migrate_slots` on a map file, with a progress bar on stderr and exit codes 0/1/2."""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from relay.fleet.migration.errors import MigrationError
from relay.fleet.migration.map_file import file_publisher, file_reader, read_map_file
from relay.fleet.migration.protocol import migrate_slots, validate_request
from relay.fleet.migration.report import Progress
from relay.fleet.sharding import ShardMapError, parse_slot_spec
from relay.progress import ProgressReporter

__all__ = ["ProgressBar", "migrate_main"]


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


def migrate_main(shard_map_path: str, slots: str, to: str) -> int:
    """`relayfleet migrate --shard-map FILE --slots A-B --to SHARD`: 0 done, 2 bad arguments, 1 failed."""
    try:
        wanted = parse_slot_spec(slots)
        shard_map = read_map_file(shard_map_path)
        validate_request(shard_map, wanted, to)
    except OSError as exc:
        print(f"relayfleet: cannot read shard map {shard_map_path}: {exc.strerror}", file=sys.stderr)
        return 2
    except (ShardMapError, MigrationError) as exc:
        print(f"relayfleet: {exc}", file=sys.stderr)
        return 2
    bar = ProgressBar(to)
    try:
        report = asyncio.run(
            migrate_slots(
                shard_map,
                wanted,
                to,
                file_publisher(shard_map_path),
                bar,
                current_map=file_reader(shard_map_path),
            )
        )
    except MigrationError as exc:
        print(f"\nrelayfleet migrate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"\nrelayfleet migrate: cannot write shard map {shard_map_path}: {exc.strerror}", file=sys.stderr
        )
        return 1
    print(report.summary())
    return 0
