"""What a benchmark run measured: rows, skips, percentiles, and the JSON form of both."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list (p in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(round(p / 100 * len(sorted_values), 9)))  # 99.9% of 1000 is 999, not 999.0…01
    return sorted_values[min(rank, len(sorted_values)) - 1]


def counts(text: str) -> list[int]:
    """A command-line list of positive whole numbers, comma-separated ("256,4096")."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"not a comma-separated list of counts: {text!r}")
    return values


def size_label(size: int) -> str:
    if size >= 1024 and size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size} B"


@dataclass
class Row:
    """One measurement: a scenario run against one target with fixed parameters."""

    scenario: str  # calibration | head_to_head | wake | read_ack | fanout
    target: str
    params: dict[str, int | str]
    values: dict[str, float]
    note: str = ""


@dataclass
class Skip:
    scenario: str
    target: str
    reason: str


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)

    def select(self, scenario: str, target: str | None = None) -> list[Row]:
        return [r for r in self.rows if r.scenario == scenario and target in (None, r.target)]

    def to_json(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "skips": [asdict(s) for s in self.skips]}
