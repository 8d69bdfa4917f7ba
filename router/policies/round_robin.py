"""Round robin: engine ``n mod N`` for the n-th request, over the candidates sorted by id.

The baseline every paper compares against; it ignores load and cache contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from router.api import Decision
from router.policies.base import ClusterView, PolicyBase, RequestContext, decide
from router.policies.feasibility import candidates_or_shed


@dataclass(frozen=True, slots=True)
class RoundRobinConfig:
    slo_filter: bool = False


class RoundRobin(PolicyBase):
    name: ClassVar[str] = "round_robin"

    def __init__(self, config: RoundRobinConfig | None = None) -> None:
        self.config = config or RoundRobinConfig()
        self._next = 0

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        engines = candidates_or_shed(self.name, ctx, view, now, self.config.slo_filter)
        if isinstance(engines, Decision):
            return engines
        engines.sort(key=lambda ev: ev.engine_id)
        chosen = engines[self._next % len(engines)]
        self._next += 1
        return decide(self.name, "round_robin", chosen, view)
