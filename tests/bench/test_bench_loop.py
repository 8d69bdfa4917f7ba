"""The simulator's event heap: time order, the documented tie-break, bounds, errors."""

from __future__ import annotations

import pytest

from bench.sim.loop import EventLoop, Kind, SimulationError


def _recording_loop() -> tuple[EventLoop, list[tuple[float, str, object]]]:
    loop = EventLoop()
    seen: list[tuple[float, str, object]] = []
    for kind in Kind:
        loop.on(kind, lambda payload, now, k=kind: seen.append((now, k.name, payload)))
    return loop, seen


def test_events_run_in_time_order() -> None:
    loop, seen = _recording_loop()
    for t in (3.0, 1.0, 2.0):
        loop.schedule(t, Kind.TICK, t)
    assert loop.run() == 3
    assert [p for _, _, p in seen] == [1.0, 2.0, 3.0]
    assert loop.now == 3.0 and loop.processed == 3


def test_same_time_ties_break_by_kind_priority_then_schedule_order() -> None:
    loop, seen = _recording_loop()
    loop.schedule(1.0, Kind.SUBMIT, "submit")
    loop.schedule(1.0, Kind.ARRIVAL, "arrival-a")
    loop.schedule(1.0, Kind.DELIVER, "deliver")
    loop.schedule(1.0, Kind.ARRIVAL, "arrival-b")
    loop.schedule(1.0, Kind.ENGINE_WAKE, "wake")
    loop.schedule(0.5, Kind.TICK, "earlier tick")
    loop.run()
    assert [p for _, _, p in seen] == [
        "earlier tick",
        "wake",
        "deliver",
        "arrival-a",
        "arrival-b",
        "submit",
    ]


def test_payloads_are_never_compared() -> None:
    """Equal (time, kind) with incomparable payloads must not fall through to the payload."""
    loop, seen = _recording_loop()
    a, b = object(), {"x": 1}
    loop.schedule(1.0, Kind.ARRIVAL, a)
    loop.schedule(1.0, Kind.ARRIVAL, b)
    loop.run()
    assert [p for _, _, p in seen] == [a, b]


def test_handlers_may_schedule_at_now_and_later() -> None:
    loop = EventLoop()
    order: list[str] = []

    def arrival(payload: str, now: float) -> None:
        order.append(payload)
        loop.schedule(now, Kind.SUBMIT, payload + "-submit")  # same instant, runs after
        loop.schedule(now + 1, Kind.TICK, payload + "-later")

    loop.on(Kind.ARRIVAL, arrival)
    loop.on(Kind.SUBMIT, lambda p, now: order.append(p))
    loop.on(Kind.TICK, lambda p, now: order.append(p))
    loop.schedule(0.0, Kind.ARRIVAL, "a")
    loop.schedule(0.0, Kind.ARRIVAL, "b")
    loop.run()
    assert order == ["a", "b", "a-submit", "b-submit", "a-later", "b-later"]


def test_run_until_and_max_events_bound_the_run() -> None:
    loop, _seen = _recording_loop()
    for t in range(10):
        loop.schedule(float(t), Kind.TICK, t)
    assert loop.run(until=4.5) == 5
    assert loop.now == 4.5 and len(loop) == 5 and loop.peek_time() == 5.0
    assert loop.run(max_events=2) == 2
    assert loop.run() == 3 and not len(loop)


def test_scheduling_in_the_past_and_missing_handlers_raise() -> None:
    loop = EventLoop(start=5.0)
    with pytest.raises(SimulationError):
        loop.schedule(4.0, Kind.TICK)
    loop.schedule(6.0, Kind.TICK)
    with pytest.raises(SimulationError):
        loop.run()


def test_two_loops_do_not_share_sequence_numbers() -> None:
    a, seen_a = _recording_loop()
    b, _ = _recording_loop()
    for i in range(3):
        b.schedule(0.0, Kind.TICK, i)
    a.schedule(0.0, Kind.TICK, "x")
    a.schedule(0.0, Kind.TICK, "y")
    a.run()
    assert [p for _, _, p in seen_a] == ["x", "y"]
