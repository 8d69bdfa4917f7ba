"""SGLang router's cache_aware rule, on in-flight request counts:

* if ``max - min > balance_abs`` (64) and ``max > balance_rel x min`` (1.5): the least-loaded
  engine (``least_load``);
* else if the best match covers more than ``match_threshold`` (0.3) of the key: the engine with
  the longest match, fewest in flight among equals (``cache_match``);
* else the least-loaded engine (``least_load``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from router.api import Decision
from router.policies.base import (
    ClusterView,
    PolicyBase,
    RequestContext,
    by_inflight,
    decide,
    pick_min,
)
from router.policies.feasibility import candidates_or_shed


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    balance_abs: int = 64
    balance_rel: float = 1.5
    match_threshold: float = 0.3
    slo_filter: bool = False


class CacheAware(PolicyBase):
    name: ClassVar[str] = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        cfg = self.config
        engines = candidates_or_shed(self.name, ctx, view, now, cfg.slo_filter)
        if isinstance(engines, Decision):
            return engines
        rng = view.rng
        loads = [ev.inflight for ev in engines]
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs and hi > cfg.balance_rel * lo:
            return decide(self.name, "least_load", pick_min(engines, by_inflight, rng), view)
        matched = view.matched
        best = max(matched.get(ev.engine_id, 0) for ev in engines)
        if ctx.key_len and best / ctx.key_len > cfg.match_threshold:
            holders = [ev for ev in engines if matched.get(ev.engine_id, 0) == best]
            return decide(self.name, "cache_match", pick_min(holders, by_inflight, rng), view)
        return decide(self.name, "least_load", pick_min(engines, by_inflight, rng), view)
