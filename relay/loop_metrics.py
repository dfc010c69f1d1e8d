"""Metric families whose values the relay owns as plain numbers: the hot-path series.

prometheus_client's Counter/Histogram take a lock per update and check their arguments;
both showed in enqueue profiles. These families keep each series as a few plain floats
that only the event loop thread updates (the scrape handler runs on it too), and expose
them through the registry as a custom collector, with the names, help, labels, buckets,
values and `_created` samples a prometheus_client metric of the same kind would have.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

# how prometheus_client writes a bucket's `le` (0.0005, 1.0, +Inf); the function is untyped
_le_text: Callable[[float], str] = floatToGoString


class CounterSeries:
    """One labelled series of a LoopCounter; `value` is what /metrics reads."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class HistogramSeries:
    """One labelled series of a LoopHistogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds  # upper bounds, ending with +Inf
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Histogram.observe: the first bucket whose bound is >= `amount`, found by bisection."""
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1


S = TypeVar("S", CounterSeries, HistogramSeries)


class _Labelled(Generic[S]):
    """A family's series by label values, each made on first use (as a metric's labels())."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], new: Callable[[], S]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}
        self._new: Callable[[], S] = new

    def labels(self, *values: str) -> S:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            series = self._series[values] = self._new()
        return series


class LoopCounter(_Labelled[CounterSeries]):
    """A counter family (Counter's constructor arguments, its labels(...).inc)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], *, registry: CollectorRegistry
    ) -> None:
        super().__init__(name, documentation, labelnames, CounterSeries)
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            family.add_metric(values, series.value, created=series.created)
        yield family


class LoopGauge:
    """An unlabelled gauge (Gauge's inc, dec and set)."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0.0
        registry.register(self)

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


class LoopHistogram(_Labelled[HistogramSeries]):
    """A histogram family (Histogram's constructor arguments, its labels(...).observe, and
    observe for an unlabelled one)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.bounds = [float(b) for b in buckets]
        if self.bounds != sorted(self.bounds) or math.inf in self.bounds:
            raise ValueError("buckets are finite and sorted (+Inf is added)")
        upper = [*self.bounds, math.inf]
        super().__init__(name, documentation, labelnames, lambda: HistogramSeries(upper))
        self._les = [_le_text(b) for b in upper]
        if not self.labelnames:
            self.labels()  # an unlabelled histogram exports zeros from the start, as Histogram does
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._series[()].observe(amount)

    def _families(self) -> tuple[HistogramMetricFamily, GaugeMetricFamily]:
        # HistogramMetricFamily takes no created time; the text format exposes a histogram's
        # `_created` as a gauge family of its own, after the histogram, with the same help
        return (
            HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames),
            GaugeMetricFamily(f"{self.name}_created", self.documentation, labels=self.labelnames),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        family, created = self._families()
        for values, series in self._series.items():
            total = 0.0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(self._les, series.counts, strict=True):
                total += count
                buckets.append((le, total))
            family.add_metric(values, buckets, series.sum)
            created.add_metric(values, series.created)
        yield family
        if created.samples:  # as the text format leaves out an empty `_created` block
            yield created
