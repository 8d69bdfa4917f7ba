"""The only list of routing policies: registry key -> (policy class, its frozen config class).

The key, the module name and the policy's ``name`` are the same string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from router.policies.base import Policy
from router.policies.cache_aware import CacheAware, CacheAwareConfig
from router.policies.e2 import E2, E2Config
from router.policies.least_load import LeastLoad, LeastLoadConfig
from router.policies.power_of_two import PowerOfTwo, PowerOfTwoConfig
from router.policies.round_robin import RoundRobin, RoundRobinConfig
from router.policies.session_affinity import SessionAffinity, SessionAffinityConfig

POLICIES: dict[str, tuple[type, type]] = {
    "e2": (E2, E2Config),
    "round_robin": (RoundRobin, RoundRobinConfig),
    "least_load": (LeastLoad, LeastLoadConfig),
    "power_of_two": (PowerOfTwo, PowerOfTwoConfig),
    "cache_aware": (CacheAware, CacheAwareConfig),
    "session_affinity": (SessionAffinity, SessionAffinityConfig),
}


class PolicyError(ValueError):
    """Unknown policy or option."""


def make_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    """A fresh policy from its registry key and config options (e.g. ``{"rebalance": False}``)."""
    try:
        cls, config_cls = POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(options or {}) - fields
    if unknown:
        raise PolicyError(
            f"{name}: unknown option(s) {', '.join(sorted(unknown))}; known: "
            f"{', '.join(sorted(fields))}"
        )
    return cls(config_cls(**(options or {})))
