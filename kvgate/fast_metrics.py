"""Lock-free Prometheus counters and histograms for hot paths (one event-loop thread).

prometheus_client's metric children take a lock and walk a few layers per ``inc``/``observe``:
a visible share of a proxied gateway request, and of an engine step that writes a hundred
streams. These keep a plain number (or bucket counts) per label set and are folded into the
exposition on scrape by :class:`FastCollector`, registered in an ordinary
``CollectorRegistry``. Only for code that runs on one thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class FastCounter:
    """A labelled counter for the per-request path: a plain float per label set, folded into
    the exposition on scrape. prometheus_client's children take a lock and walk a few layers
    per ``inc`` (a visible share of a proxied request); the event loop is one thread, so a
    plain add is exact here."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _CounterChild] = {}

    def labels(self, *labels: str) -> _CounterChild:
        c = self._children.get(labels)
        if c is None:
            if len(labels) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            c = self._children[labels] = _CounterChild()
        return c

    def inc(self, amount: float = 1.0) -> None:
        self.labels().value += amount

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, child in self._children.items():
            fam.add_metric(list(labels), child.value)
        yield fam


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class FastHistogram:
    """A labelled histogram for the per-request path (see :class:`FastCounter`): one bisect and
    two adds per observation; cumulative buckets are computed on scrape."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}

    def labels(self, *labels: str) -> _HistogramChild:
        c = self._children.get(labels)
        if c is None:
            if len(labels) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            c = self._children[labels] = _HistogramChild(self.bounds)
        return c

    def observe(self, amount: float) -> None:
        self.labels().observe(amount)

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for labels, child in self._children.items():
            running = 0.0
            cumulative = []
            for le, n in zip(les, child.counts, strict=True):
                running += n
                cumulative.append((le, running))
            fam.add_metric(list(labels), cumulative, child.sum)
        yield fam


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # le: amount <= bound
        self.sum += amount

    def observe_many(self, amounts: Iterable[float]) -> None:
        counts, bounds = self.counts, self.bounds
        total = 0.0
        for amount in amounts:
            counts[bisect_left(bounds, amount)] += 1
            total += amount
        self.sum += total


class FastCollector(Collector):
    """Exposes fast metrics through a prometheus_client registry."""

    def __init__(self, metrics: Sequence[FastCounter | FastHistogram]) -> None:
        self.metrics = tuple(metrics)

    def collect(self) -> Iterator[Metric]:
        for m in self.metrics:
            yield from m.collect()
