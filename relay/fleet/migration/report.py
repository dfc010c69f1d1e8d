"""What a migration tells its caller: `Progress` while it runs, `MigrationReport` at the end."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from relay.fleet.sharding import ShardMap

__all__ = ["MigrationReport", "Progress", "ProgressFn"]


@dataclass(frozen=True, slots=True)
class Progress:
    slots_done: int
    slots_total: int
    keys: int
    bytes: int  # payload bytes copied
    elapsed_s: float
    phase: str  # 'locate', 'copy', 'flip', 'done'


ProgressFn = Callable[[Progress], None]


@dataclass
class MigrationReport:
    target: str
    slots_requested: int
    slots_moved: int = 0  # flipped to the target by this run (from any step)
    slots_already: int = 0  # on the target before this run began its work on them
    slots_resumed: int = 0  # found mid-way (fenced, copied or flipped) by an earlier run
    keys: int = 0
    bytes: int = 0  # payload bytes copied (the per-queue byte counters)
    batches: int = 0
    elapsed_s: float = 0.0
    pauses_s: list[float] = field(default_factory=list)  # per slot: fence -> map published
    map_epoch: int = 0
    final_map: ShardMap | None = None
    resumes: int = 0  # times a shard's failover interrupted the run and it resumed

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def pause(self, q: float) -> float:
        """Quantile `q` (0..1) of the per-slot write pause, seconds (nearest rank)."""
        if not self.pauses_s:
            return 0.0
        ordered = sorted(self.pauses_s)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def summary(self) -> str:
        lines = [
            f"migrated {self.slots_moved} slot(s) to {self.target} in {self.elapsed_s:.2f} s "
            f"({self.batches} batch(es), shard map epoch {self.map_epoch})",
            f"already there: {self.slots_already}, resumed from an earlier run: {self.slots_resumed}",
            f"copied {self.keys} key(s), {self.bytes / 1e6:.2f} MB of payload, {self.mb_per_s:.1f} MB/s",
        ]
        if self.pauses_s:
            lines.append(
                "write pause per slot: "
                f"p50 {self.pause(0.5) * 1000:.0f} ms, p99 {self.pause(0.99) * 1000:.0f} ms, "
                f"max {max(self.pauses_s) * 1000:.0f} ms"
            )
        return "\n".join(lines)
