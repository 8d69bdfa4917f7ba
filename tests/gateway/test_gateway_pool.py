"""The pure engine pool: circuit breaker transitions, blocked set, least-load fallback, config."""

from __future__ import annotations

import pytest

from gateway.config import BreakerConfig, StaticEngine, parse_engine_spec, parse_template_spec
from gateway.pool import EnginePool
from router.api import EngineInfo


def pool(n: int = 2, **breaker: float) -> EnginePool:
    p = EnginePool(BreakerConfig(**breaker))
    p.merge_router_list([EngineInfo(f"e{i}", f"http://h{i}", ("m",), True) for i in range(n)])
    return p


def test_breaker_opens_after_consecutive_failures_then_half_open_then_closes() -> None:
    p = pool(failures=3, cooldown_s=2.0)
    assert p.finished("e0", False, 0.0) is None and p.finished("e0", False, 0.1) is None
    assert p.blocked(0.1) == frozenset()
    assert p.finished("e0", False, 0.2) == "ejected"  # the third one opens it
    assert p.blocked(0.2) == {"e0"}
    assert p.blocked(2.1) == {"e0"}  # still cooling down
    assert p.blocked(2.3) == frozenset()  # half-open: one trial allowed
    p.started("e0", 2.3)
    assert p.engines["e0"].breaker.state == "half_open"
    assert p.blocked(2.31) == {"e0"}  # the trial is in flight: nobody else
    assert p.finished("e0", True, 2.4) == "readmitted"
    assert p.engines["e0"].breaker.state == "closed" and p.blocked(2.4) == frozenset()
    assert p.finished("e0", True, 2.5) is None


def test_failed_trial_doubles_the_cooldown_up_to_the_cap() -> None:
    p = pool(failures=1, cooldown_s=1.0, max_cooldown_s=3.0)
    p.finished("e0", False, 0.0)
    b = p.engines["e0"].breaker
    assert b.cooldown_s == 1.0
    for now, want in ((1.0, 2.0), (3.0, 3.0), (6.0, 3.0)):
        assert p.blocked(now + 0.01) == frozenset()
        p.started("e0", now + 0.01)
        assert p.finished("e0", False, now + 0.01) is None  # still out: not a new ejection
        assert b.state == "open" and b.cooldown_s == want


def test_success_resets_the_failure_count() -> None:
    p = pool(failures=2)
    p.finished("e0", False, 0.0)
    p.finished("e0", True, 0.1)
    p.finished("e0", False, 0.2)
    assert p.engines["e0"].breaker.state == "closed"


def test_health_probes_eject_and_readmit() -> None:
    p = pool(failures=2, cooldown_s=1.0)
    assert p.health_result("e1", False, 0.0) is None
    assert p.health_result("e1", False, 0.5) == "ejected"
    assert "e1" in p.blocked(0.5)
    assert p.health_result("e1", True, 1.6) == "readmitted"  # after the cooldown
    assert p.engines["e1"].breaker.state == "closed"


def test_a_passed_probe_cuts_an_open_circuits_cooldown_short() -> None:
    """An engine back from a long outage (its cooldown doubled by each failed trial) is tried
    again at its first passed probe, not when the cooldown ends: half-open, one trial, which
    closes the circuit; a failed trial re-opens it with the cooldown doubled as before."""
    p = pool(failures=1, cooldown_s=1.0, max_cooldown_s=30.0)
    p.health_result("e1", False, 0.0)
    for now in (1.0, 3.0, 7.0, 15.0):  # every trial fails: 2, 4, 8, 16 s
        p.health_result("e1", False, now)
    b = p.engines["e1"].breaker
    assert b.state == "open" and b.cooldown_s == 16.0
    assert p.health_result("e1", True, 16.0) is None  # passed: half-open, cooldown or not
    assert b.state == "half_open" and "e1" not in p.blocked(16.0)
    p.started("e1", 16.0)
    assert "e1" in p.blocked(16.01)  # the trial is in flight
    assert p.finished("e1", False, 16.1) is None  # it failed: open, cooldown doubled
    assert b.state == "open" and b.cooldown_s == 30.0
    p.health_result("e1", True, 18.0)
    p.started("e1", 18.0)
    assert p.finished("e1", True, 18.1) == "readmitted"


def test_an_outage_is_one_ejection_and_one_readmission() -> None:
    """Failed probes after every cooldown keep the engine out without a new transition, and
    requests racing the probes neither; only the way down and the way back are reported."""
    p = pool(failures=1, cooldown_s=0.5, max_cooldown_s=1.0)
    seen = [p.health_result("e0", False, 0.0)]
    for i in range(1, 40):
        now = i * 0.3
        seen.append(p.health_result("e0", False, now))
        if p.engines["e0"].breaker.usable(now):  # half-open: a real request is the trial
            p.started("e0", now)
            seen.append(p.finished("e0", False, now, "refused"))
    seen.append(p.health_result("e0", True, 20.0))
    seen.append(p.health_result("e0", True, 20.5))
    assert [t for t in seen if t is not None] == ["ejected", "readmitted"]


def test_least_loaded_uses_inflight_and_skips_blocked_drained_and_excluded() -> None:
    p = pool(3)
    p.started("e0", 0.0)
    p.started("e0", 0.0)
    p.started("e1", 0.0)
    assert p.least_loaded("m", frozenset(), 0.0).engine_id == "e2"
    p.set_draining("e2", True)
    assert p.least_loaded("m", frozenset(), 0.0).engine_id == "e1"
    assert p.least_loaded("m", frozenset({"e1"}), 0.0).engine_id == "e0"
    assert p.least_loaded("other-model", frozenset(), 0.0) is None
    p.released("e0")
    p.released("e0")
    picks = {p.least_loaded("m", frozenset(), 0.0).engine_id for _ in range(4)}
    assert picks == {"e0"}


def test_router_list_merge_keeps_last_known_engines_and_static_ones() -> None:
    p = pool(2)
    p.add_static([StaticEngine("s0", "http://s0", ())])
    assert p.models() == ["m"]
    p.merge_router_list([EngineInfo("e0", "http://h0", ("m", "n"), True)])
    assert set(p.engines) == {"e0", "e1", "s0"}
    assert not p.engines["e1"].router_alive and p.engines["e0"].router_alive
    assert p.serves("n") and p.router_alive_for("m") == 1
    p.set_models("s0", ["z"])
    assert p.models() == ["m", "n", "z"]


def test_engine_and_template_specs() -> None:
    assert parse_engine_spec("a=http://x:1/,m1,m2") == StaticEngine("a", "http://x:1", ("m1", "m2"))
    assert parse_engine_spec("b=https://y") == StaticEngine("b", "https://y", ())
    for bad in ("nourl", "=http://x", "a=ftp://x", "a="):
        with pytest.raises(ValueError):
            parse_engine_spec(bad)
    assert parse_template_spec("/p/t.jinja") == (None, "/p/t.jinja")
    assert parse_template_spec("llama=/m") == ("llama", "/m")
