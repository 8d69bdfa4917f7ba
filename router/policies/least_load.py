"""Least load: the engine with the fewest requests in flight (then least windowed work; exact
ties by the injected rng). Ignores cache contents."""

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
class LeastLoadConfig:
    slo_filter: bool = False


class LeastLoad(PolicyBase):
    name: ClassVar[str] = "least_load"

    def __init__(self, config: LeastLoadConfig | None = None) -> None:
        self.config = config or LeastLoadConfig()

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        engines = candidates_or_shed(self.name, ctx, view, now, self.config.slo_filter)
        if isinstance(engines, Decision):
            return engines
        return decide(self.name, "least_load", pick_min(engines, by_inflight, view.rng), view)
