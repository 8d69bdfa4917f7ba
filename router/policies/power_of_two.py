"""Power of two choices: sample two distinct engines with the injected rng, take the one with
fewer requests in flight (Mitzenmacher); one candidate: that one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from router.api import Decision
from router.policies.base import ClusterView, PolicyBase, RequestContext, by_inflight, decide
from router.policies.feasibility import candidates_or_shed


@dataclass(frozen=True, slots=True)
class PowerOfTwoConfig:
    slo_filter: bool = False


class PowerOfTwo(PolicyBase):
    name: ClassVar[str] = "power_of_two"

    def __init__(self, config: PowerOfTwoConfig | None = None) -> None:
        self.config = config or PowerOfTwoConfig()

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        engines = candidates_or_shed(self.name, ctx, view, now, self.config.slo_filter)
        if isinstance(engines, Decision):
            return engines
        n = len(engines)
        if n == 1:
            return decide(self.name, "power_of_two", engines[0], view)
        i = view.rng.randrange(n)
        j = view.rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = engines[i], engines[j]
        chosen = b if by_inflight(b) < by_inflight(a) else a
        return decide(self.name, "power_of_two", chosen, view)
