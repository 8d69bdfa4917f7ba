"""The engines as the gateway sees them: health, circuit breakers, in-flight counts, drains.

Pure (no I/O, no clock: every call takes ``now``). The router decides where requests go; this
pool decides which engines it may not pick (ejected, draining, failed on this request) and, when
the router is unavailable, picks by least load itself from the last known engine list.

Circuit breaker per engine::

    closed --(N consecutive failures)--> open --(cooldown elapsed)--> half_open
    half_open --(trial ok)--> closed;  half_open --(trial failed)--> open (cooldown x2, capped)
    open --(health probe ok)--> half_open (the cooldown cut short: the engine answers again)

Failures are passive (a proxied request could not connect or got a 5xx before its first byte) or
active (``GET /health`` failed). A half-open engine takes one trial at a time: the next health
probe or one real request, whichever comes first.

An engine is *ejected* when its circuit first opens and *readmitted* when a success closes it:
the pool reports those two transitions once each (``Transition``), however many failed trials
re-open the circuit in between, so the gateway logs an outage once on the way down and once on
the way back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from gateway.config import BreakerConfig, StaticEngine
from router.api import EngineInfo

CircuitState = Literal["closed", "open", "half_open"]
CIRCUIT_CODES: dict[CircuitState, int] = {"closed": 0, "open": 1, "half_open": 2}
Transition = Literal["ejected", "readmitted"]


@dataclass(slots=True)
class Breaker:
    """One engine's circuit breaker (see the module docstring)."""

    config: BreakerConfig
    state: CircuitState = "closed"
    consecutive_failures: int = 0
    opened_at: float = 0.0
    cooldown_s: float = 0.0
    trial_in_flight: bool = False

    def usable(self, now: float) -> bool:
        """May a request be sent now? An open breaker becomes half-open once cooled down."""
        if self.state == "open" and now >= self.opened_at + self.cooldown_s:
            self.state = "half_open"
            self.trial_in_flight = False
        if self.state == "half_open":
            return not self.trial_in_flight
        return self.state == "closed"

    def begin(self, now: float) -> None:
        """A request (or probe) is being sent; in half-open it is the one trial."""
        if self.usable(now) and self.state == "half_open":
            self.trial_in_flight = True

    def probe_passed(self) -> None:
        """An open circuit's engine passed a health probe: half-open now, one trial allowed
        (its cooldown kept: a failed trial doubles it as usual)."""
        if self.state == "open":
            self.state = "half_open"
            self.trial_in_flight = False

    def success(self) -> bool:
        """Close the circuit; True when this readmitted an ejected engine."""
        was_out = self.state != "closed"
        self.state = "closed"
        self.consecutive_failures = 0
        self.cooldown_s = 0.0
        self.trial_in_flight = False
        return was_out

    def failure(self, now: float) -> bool:
        """Count a failure; True when this one ejected a working engine (closed -> open). A
        failed half-open trial re-opens the circuit quietly: the engine was never back."""
        self.consecutive_failures += 1
        was_closed = self.state == "closed"
        if self.state == "half_open":
            self.cooldown_s = min(self.cooldown_s * 2, self.config.max_cooldown_s)
        elif self.state == "closed" and self.consecutive_failures >= self.config.failures:
            self.cooldown_s = self.config.cooldown_s
        else:
            return False
        self.state = "open"
        self.opened_at = now
        self.trial_in_flight = False
        return was_closed


@dataclass(slots=True)
class PoolEngine:
    """What the gateway knows of one engine."""

    engine_id: str
    url: str
    models: tuple[str, ...]
    breaker: Breaker
    static: bool = False
    from_router: bool = False
    router_alive: bool = True  # as the router last said (from its engine list)
    draining: bool = False
    inflight: int = 0
    last_health_ok: float | None = None
    last_error: str = ""
    served: int = 0
    failures: int = 0

    def describe(self, now: float) -> dict:
        """The admin view of this engine."""
        return {
            "id": self.engine_id,
            "url": self.url,
            "models": list(self.models),
            "source": "static" if self.static else "router",
            "router_alive": self.router_alive,
            "circuit": self.breaker.state,
            "usable": self.breaker.usable(now) and not self.draining,
            "draining": self.draining,
            "inflight": self.inflight,
            "served": self.served,
            "failures": self.failures,
            "last_health_ok_age_s": None
            if self.last_health_ok is None
            else round(now - self.last_health_ok, 3),
            "last_error": self.last_error,
        }


@dataclass(slots=True)
class EnginePool:
    """Every engine the gateway has heard of, from the router's list and from static config."""

    breaker_config: BreakerConfig
    engines: dict[str, PoolEngine] = field(default_factory=dict)
    _rotation: int = 0
    # Per-request lookups must not walk a thousand engines: the model set and the blocked set
    # are cached, and every state change bumps ``_version`` to invalidate them.
    _version: int = 0
    _models_version: int = -1
    _models: frozenset[str] = frozenset()
    _blocked_version: int = -1
    _blocked_at: float = -1.0
    _blocked: frozenset[str] = frozenset()

    def changed(self) -> None:
        self._version += 1

    def add_static(self, engines: Iterable[StaticEngine]) -> None:
        for s in engines:
            e = self._ensure(s.engine_id, s.url)
            e.static = True
            if s.models:
                e.models = s.models
        self.changed()

    def _ensure(self, engine_id: str, url: str) -> PoolEngine:
        e = self.engines.get(engine_id)
        if e is None:
            e = PoolEngine(engine_id, url.rstrip("/"), (), Breaker(self.breaker_config))
            self.engines[engine_id] = e
        elif url:
            e.url = url.rstrip("/")
        return e

    def merge_router_list(self, infos: Iterable[EngineInfo]) -> None:
        """Fold in the router's engine list. Engines it no longer lists are kept (last known
        state: they may serve again and health checks decide), but marked not alive."""
        seen = set()
        for info in infos:
            seen.add(info.engine_id)
            e = self._ensure(info.engine_id, info.url)
            e.from_router = True
            e.router_alive = info.alive
            if info.models:
                e.models = tuple(info.models)
        for e in self.engines.values():
            if e.from_router and e.engine_id not in seen:
                e.router_alive = False
        self.changed()

    def set_models(self, engine_id: str, models: Iterable[str]) -> None:
        e = self.engines.get(engine_id)
        if e is not None:
            e.models = tuple(models)
            self.changed()

    def _model_set(self) -> frozenset[str]:
        if self._models_version != self._version:
            self._models = frozenset(m for e in self.engines.values() for m in e.models)
            self._models_version = self._version
        return self._models

    def models(self) -> list[str]:
        """The union of models the known engines serve, sorted."""
        return sorted(self._model_set())

    def serves(self, model: str) -> bool:
        return model in self._model_set()

    def blocked(self, now: float) -> frozenset[str]:
        """Engines the router must not pick now: ejected (circuit open) or draining. Cached
        until the pool changes or 50 ms pass (an open circuit turns half-open with time)."""
        if self._blocked_version != self._version or now - self._blocked_at > 0.05:
            self._blocked = frozenset(
                e.engine_id
                for e in self.engines.values()
                if e.draining or not e.breaker.usable(now)
            )
            self._blocked_version = self._version
            self._blocked_at = now
        return self._blocked

    def usable(self, model: str | None, now: float) -> list[PoolEngine]:
        return [
            e
            for e in self.engines.values()
            if not e.draining and e.breaker.usable(now) and (model is None or model in e.models)
        ]

    def least_loaded(self, model: str, exclude: frozenset[str], now: float) -> PoolEngine | None:
        """Fallback choice: fewest gateway-side in-flight requests, ties rotated."""
        cands = [e for e in self.usable(model, now) if e.engine_id not in exclude]
        if not cands:
            return None
        self._rotation += 1
        low = min(e.inflight for e in cands)
        ties = [e for e in cands if e.inflight == low]
        return ties[self._rotation % len(ties)]

    def router_alive_for(self, model: str) -> int:
        """How many engines serving ``model`` the router last reported alive."""
        return sum(1 for e in self.engines.values() if model in e.models and e.router_alive)

    def started(self, engine_id: str, now: float) -> None:
        e = self.engines.get(engine_id)
        if e is not None:
            e.inflight += 1
            if e.breaker.state != "closed":
                e.breaker.begin(now)
                self.changed()

    def finished(self, engine_id: str, ok: bool, now: float, error: str = "") -> Transition | None:
        """A proxied request ended; says when it ejected or readmitted the engine."""
        e = self.engines.get(engine_id)
        if e is None:
            return None
        e.inflight = max(0, e.inflight - 1)
        if ok:
            e.served += 1
            if e.breaker.state != "closed" or e.breaker.consecutive_failures:
                self.changed()
                return "readmitted" if e.breaker.success() else None
            return None
        e.failures += 1
        e.last_error = error
        self.changed()
        return "ejected" if e.breaker.failure(now) else None

    def released(self, engine_id: str) -> None:
        """A request ended without telling anything about the engine's health (the client
        went away): free its slot, and a half-open trial may be tried again."""
        e = self.engines.get(engine_id)
        if e is not None:
            e.inflight = max(0, e.inflight - 1)
            if e.breaker.trial_in_flight:
                e.breaker.trial_in_flight = False
                self.changed()

    def health_result(
        self, engine_id: str, ok: bool, now: float, error: str = ""
    ) -> Transition | None:
        """An active probe's result; says when it ejected or readmitted the engine (an
        ejected engine is probed again after each cooldown; only the probe that brings it
        back is a transition)."""
        e = self.engines.get(engine_id)
        if e is None:
            return None
        e.breaker.usable(now)  # (an open circuit past its cooldown turns half-open here)
        self.changed()
        if ok:
            e.last_health_ok = now
            if e.breaker.state == "open":
                # the engine answers again: its cooldown is cut short and the next request (or
                # probe) is the trial. Waiting it out kept an engine restarted after a long
                # outage out for up to max_cooldown_s (doubled by every probe it failed)
                e.breaker.probe_passed()
                return None
            if e.breaker.success():
                return "readmitted"
            return None
        e.last_error = error
        return "ejected" if e.breaker.failure(now) else None

    def set_draining(self, engine_id: str, draining: bool) -> bool:
        e = self.engines.get(engine_id)
        if e is None:
            return False
        e.draining = draining
        self.changed()
        return True
