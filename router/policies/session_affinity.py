"""Session affinity by consistent hashing: a request with ``session`` goes to the first engine
clockwise from ``xxh3(session)`` on a ring of ``virtual_nodes`` points per engine
(``xxh3("engine#i")``), so adding or removing an engine moves only about 1/N of the sessions.
Without a session: the least-loaded engine (fewest in flight)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import ClassVar

from engine_reporter.hashing import block_hash
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
class SessionAffinityConfig:
    virtual_nodes: int = 64
    slo_filter: bool = False


def _point(text: str) -> int:
    return block_hash(None, text.encode())


class SessionAffinity(PolicyBase):
    name: ClassVar[str] = "session_affinity"

    def __init__(self, config: SessionAffinityConfig | None = None) -> None:
        self.config = config or SessionAffinityConfig()
        self._ring_for: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, engine_ids: frozenset[str]) -> None:
        if engine_ids == self._ring_for:
            return
        ring = sorted(
            (_point(f"{e}#{i}"), e) for e in engine_ids for i in range(self.config.virtual_nodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [e for _, e in ring]
        self._ring_for = engine_ids

    def choose(self, ctx: RequestContext, view: ClusterView, now: float) -> Decision:
        engines = candidates_or_shed(self.name, ctx, view, now, self.config.slo_filter)
        if isinstance(engines, Decision):
            return engines
        session = ctx.request.session
        if not session:
            return decide(self.name, "least_load", pick_min(engines, by_inflight, view.rng), view)
        by_id = {ev.engine_id: ev for ev in engines}
        self._ring(frozenset(by_id))
        i = bisect_left(self._points, _point(session)) % len(self._points)
        return decide(self.name, "affinity", by_id[self._owners[i]], view)
