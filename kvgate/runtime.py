"""Process settings shared by kvgate's long-running, latency-sensitive processes.

:func:`tune_gc` is called once at startup by ``kvgate router``, every ``kvgate gateway`` worker
and the router benchmark (so the benchmark measures what the services run).

Why: with CPython's default thresholds (700, 10, 10) the cyclic collector ran in about 0.7% of
routing decisions, and each young collection took ~0.17 ms and each middle one ~1.1 ms on the
shared 2-core VM (100 MB tree, 64 engines, 32 KiB keys): two thirds of the decisions above the
p99 were a collection, not routing. A decision leaves a few objects alive for a while (window
entries, speculative-entry records), and the collector counts every one. A young generation of
5,000 objects makes collections seven times rarer, each ~1.2-1.7 ms: the p99 decision went from
171 to 118 us and the p99.9 from 441 to 517 us in one comparison (``docs/router.md``).
``gc.freeze()`` moves everything alive at startup (modules, classes, configuration) out of the
collector's sight for good; it would be reclaimed only at exit anyway. Reference counting still
frees almost everything at once; only cycles wait for the collector.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (5_000, 10, 10)  # young, middle, old (CPython's default: 700, 10, 10)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> dict[str, object]:
    """Collect once, freeze what is alive, and raise the young generation's threshold;
    returns the settings applied (benchmarks record them)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    return {"thresholds": list(gc.get_threshold()), "frozen_objects": gc.get_freeze_count()}
