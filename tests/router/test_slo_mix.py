"""The fleet's recent prefill work by TTFT SLO (router.slo_mix), against a direct computation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.slo_mix import SloMix

TAU = 10.0


def test_share_sooner_weighs_work_by_slo() -> None:
    mix = SloMix(TAU)
    assert mix.share_sooner(1000.0) == 0.0  # nothing routed yet
    mix.add(100.0, 300.0, 0.0)  # 300 ms of prefill due within 100 ms
    mix.add(5000.0, 100.0, 0.0)
    assert mix.share_sooner(1000.0) == pytest.approx(0.75)
    assert mix.share_sooner(50.0) == 0.0
    assert mix.share_sooner(60_000.0) == pytest.approx(1.0)
    assert mix.share_sooner(100.0) == pytest.approx(0.375)  # its own bucket counts half
    mix.add(1000.0, 0.0, 0.0)  # no work: nothing changes
    mix.add(float("nan"), 100.0, 0.0)  # (a bad SLO lands in the first bucket, never raises)
    assert 0.0 <= mix.share_sooner(1000.0) <= 1.0


def test_old_work_fades() -> None:
    mix = SloMix(TAU)
    mix.add(100.0, 1000.0, 0.0)
    mix.add(5000.0, 1000.0, 10 * TAU)  # the short-SLO work is 10 time constants old
    assert mix.share_sooner(1000.0) == pytest.approx(math.exp(-10) / (1 + math.exp(-10)))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.5, 1e6),  # SLO ms
            # work ms: none, or at least a microsecond (a subnormal float's half rounds to 0)
            st.one_of(st.just(0.0), st.floats(1e-3, 1e4)),
            st.floats(0.0, 300.0),  # time step, s (up to 30 time constants: rebases)
        ),
        min_size=1,
        max_size=40,
    ),
    st.floats(0.5, 1e6),
)
def test_matches_an_exponentially_weighted_sum(adds: list, query: float) -> None:
    mix = SloMix(TAU)
    t = 0.0
    log: list[tuple[int, float, float]] = []
    for slo, work, dt in adds:
        t += dt
        mix.add(slo, work, t)
        if work > 0:
            log.append((SloMix.bucket(slo), work, t))
    qb = SloMix.bucket(query)
    weight = [w * math.exp(-(t - at) / TAU) for _, w, at in log]
    total = sum(weight)
    sooner = sum(
        w * (1.0 if b < qb else 0.5 if b == qb else 0.0)
        for (b, _, _), w in zip(log, weight, strict=True)
    )
    want = sooner / total if total > 0 else 0.0
    assert mix.share_sooner(query) == pytest.approx(want, rel=1e-6, abs=1e-9)
