"""The recent traffic's TTFT SLOs, weighted by the prefill work each request brought.

An engine's S-EDF scheduler serves prefill by deadline, so a request waiting there is overtaken
by every later arrival due before it. The work queued ahead of a request is therefore not its
whole wait: its wait is a busy period started by that work and fed by the overtakers (a
preemptive-priority queue: ``W = V / (1 - rho_sooner)``, ``rho_sooner`` the utilization that
higher-priority arrivals bring). Routing on ``V`` alone predicted too short a wait for a request
with a long SLO on a busy engine, and most of all for the one a router picks as the least
loaded: on kvgate's matrix (multi-turn chat, 4 engines, twice the knee) the requests e2 sent
away from their prefix's holder took twice the TTFT it had predicted, and met their SLO 52% of
the time against the 84% it expected.

:class:`SloMix` keeps, for the whole fleet, how much of the recently routed prefill work had a
TTFT SLO shorter than a given one (exponentially weighted, ``tau_s``): the share of an engine's
prefill utilization that would overtake a request with that SLO (the caller asks with the SLO less
half the request's wait: an arrival overtakes only with an SLO shorter by the time since). It is
fleet-wide, not per engine: routers mix the classes over the engines.
"""

from __future__ import annotations

import math

BUCKETS_PER_DOUBLING = 4
BUCKETS = 128  # SLOs from 1 ms to 2^32 ms
REBASE_AFTER = 50.0  # rescale the stored weights when they have grown by e^50


class SloMix:
    """Exponentially weighted prefill work by TTFT SLO, in log-spaced buckets."""

    __slots__ = ("_last", "_t_ref", "_total", "_weights", "tau_s")

    def __init__(self, tau_s: float) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        # weights grow by e^((t - t_ref) / tau) instead of all decaying at every add: only
        # their ratios are read, which the common factor leaves alone
        self._weights = [0.0] * BUCKETS
        self._total = 0.0
        self._t_ref = 0.0
        # the last query's bucket and answer: a decision asks once per engine it scores, with
        # no add in between
        self._last: tuple[int, float] | None = None

    @staticmethod
    def bucket(slo_ms: float) -> int:
        if not slo_ms > 1.0:  # (also NaN)
            return 0
        b = int(math.log2(slo_ms) * BUCKETS_PER_DOUBLING)
        return b if b < BUCKETS else BUCKETS - 1

    def add(self, slo_ms: float, work_ms: float, now: float) -> None:
        """A request with this TTFT SLO was routed, bringing ``work_ms`` of prefill."""
        if not work_ms > 0.0:
            return
        age = (now - self._t_ref) / self.tau_s
        if age > REBASE_AFTER or age < -REBASE_AFTER:
            scale = math.exp(-age)
            self._weights = [w * scale for w in self._weights]
            self._total *= scale
            self._t_ref = now
            age = 0.0
        w = work_ms * math.exp(age)
        self._weights[self.bucket(slo_ms)] += w
        self._total += w
        self._last = None

    def share_sooner(self, slo_ms: float) -> float:
        """The share of recent prefill work whose SLO was shorter than ``slo_ms`` (its own
        bucket counted half: the SLOs in it are as likely shorter as longer)."""
        if self._total <= 0.0:
            return 0.0
        b = self.bucket(slo_ms)
        last = self._last
        if last is not None and last[0] == b:
            return last[1]
        weights = self._weights
        sooner = 0.5 * weights[b]
        for i in range(b):
            sooner += weights[i]
        share = sooner / self._total
        share = share if share < 1.0 else 1.0
        self._last = (b, share)
        return share
