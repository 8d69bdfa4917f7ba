"""Scheduling policies of kvgate's engine: one file per policy, this registry the only list.

Add a policy: one module with a class whose ``name`` is its file name (the :class:`Policy`
protocol in :mod:`engine.scheduler.base`), one line in :data:`POLICIES`, one test file.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.scheduler.base import Policy, Refusal, SchedView
from engine.scheduler.fcfs import FcfsPolicy
from engine.scheduler.preble import PreblePolicy
from engine.scheduler.slo import SloPolicy
from engine.scheduler.state import (
    PrefillUnit,
    ReqState,
    SchedulerConfig,
    StepPlan,
)

POLICIES: dict[str, Callable[[], Policy]] = {
    "slo": SloPolicy,
    "fcfs": FcfsPolicy,
    "preble": PreblePolicy,
}


def make_policy(name: str) -> Policy:
    """A fresh policy by registry key; ValueError naming the known ones otherwise (it says
    scheduler: the router's policies are another registry, and users name both)."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown scheduler {name!r} (known: {known})") from None


__all__ = [
    "POLICIES",
    "Policy",
    "PrefillUnit",
    "Refusal",
    "ReqState",
    "SchedView",
    "SchedulerConfig",
    "StepPlan",
    "make_policy",
]
