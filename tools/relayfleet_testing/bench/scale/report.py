"""What a scale phase reports: figures against their floor or anchor from the same run, how a
cost grows with the work (the exponent), and the markdown table docs/benchmarks.md holds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured figure beside what bounds it, both taken in the same run."""

    name: str
    value: float
    unit: str
    anchor: str  # what the floor or anchor is, in words
    anchor_value: float | None  # None: the figure has no anchor (context only)

    @property
    def ratio(self) -> float | None:
        if self.anchor_value is None or self.anchor_value == 0 or math.isnan(self.value):
            return None  # no anchor, or no figure (a step that did not finish)
        return self.value / self.anchor_value


@dataclass(frozen=True, slots=True)
class Growth:
    """A cost at two or more sizes of the work, and the exponent k of cost ~ size^k (least
    squares over the logs): 1 is linear, above ~1.15 grows faster than the work."""

    cost: str
    unit: str
    sizes: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def exponent(self) -> float | None:
        return growth_exponent(self.sizes, self.values)


def growth_exponent(sizes: Sequence[float], values: Sequence[float]) -> float | None:
    """Slope of log(value) over log(size); None with fewer than two usable points."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(sizes, values, strict=True) if s > 0 and v > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den


@dataclass
class PhaseReport:
    phase: str
    params: dict[str, Any]
    figures: list[Figure] = field(default_factory=list)
    growth: list[Growth] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def figure(self, name: str) -> Figure:
        for f in self.figures:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "params": self.params,
            "figures": [{**asdict(f), "ratio": f.ratio} for f in self.figures],
            "growth": [{**asdict(g), "exponent": g.exponent} for g in self.growth],
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }


def _num(v: float, unit: str = "") -> str:
    if math.isnan(v):
        return "n/a"
    if abs(v) >= 100 or v == int(v):
        text = f"{v:,.0f}"
    elif abs(v) >= 1:
        text = f"{v:,.2f}"
    else:
        text = f"{v:.3g}"
    return f"{text} {unit}".rstrip()


def render(report: PhaseReport) -> str:
    """The phase's markdown: its parameters, a table of figure / floor or anchor / ratio, the
    growth table, the notes."""
    params = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in report.params.items())
    lines = [f"**{report.phase}** ({params}; {report.seconds:.0f} s)", ""]
    lines += [
        "| figure | value | floor / anchor (same run) | anchor value | ratio |",
        "|---|---|---|---|---|",
    ]
    for f in report.figures:
        anchor = _num(f.anchor_value, f.unit) if f.anchor_value is not None else "—"
        ratio = f"{f.ratio:.3g}" if f.ratio is not None else "—"
        lines.append(f"| {f.name} | {_num(f.value, f.unit)} | {f.anchor} | {anchor} | {ratio} |")
    if report.growth:
        lines += ["", "| cost | at sizes | values | exponent |", "|---|---|---|---|"]
        for g in report.growth:
            k = g.exponent
            lines.append(
                f"| {g.cost} | {' / '.join(f'{s:,}' for s in g.sizes)} | "
                f"{' / '.join(_num(v, g.unit) for v in g.values)} | {'n/a' if k is None else f'{k:.2f}'} |"
            )
    if report.notes:
        lines.append("")
        lines += [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"
