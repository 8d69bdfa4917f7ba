"""The only list of routing policies: registry key -> (policy class, its frozen config class).

The key, the module name and the policy's ``name`` are the same string.
"""

from __future__ import annotations

import dataclasses
import typing
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


_TRUE, _FALSE = ("true", "1"), ("false", "0")
_KINDS = {bool: "a boolean (true/false, 1/0)", int: "an integer", float: "a number", str: "text"}


def _as_type(value: Any, kind: type) -> Any:
    """``value`` as a field of type ``kind`` (bool, int, float, str), or ValueError. Options
    come typed from JSON or as text from the command line: both forms are accepted."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int | str) and str(value).strip().lower() in _TRUE + _FALSE:
            return str(value).strip().lower() in _TRUE
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value.strip())
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
    elif kind is str and isinstance(value, str):
        return value
    raise ValueError(value)


def check_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Policy ``name``'s options, each converted to its config field's type; PolicyError
    naming an unknown policy or option, or an option whose value is not of its field's type
    (a string "False" would otherwise be a truthy flag, "abc" a crash in the middle of a run)."""
    try:
        config_cls = POLICIES[name][1]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    types = typing.get_type_hints(config_cls)
    fields = {f.name: types[f.name] for f in dataclasses.fields(config_cls)}
    unknown = set(options or {}) - set(fields)
    if unknown:
        raise PolicyError(
            f"{name}: unknown option(s) {', '.join(sorted(unknown))}; known: "
            f"{', '.join(sorted(fields))}"
        )
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        kind = fields[key]
        try:
            out[key] = _as_type(value, kind) if kind in _KINDS else value
        except ValueError:
            raise PolicyError(f"{name}: option {key} wants {_KINDS[kind]}, got {value!r}") from None
    return out


def make_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    """A fresh policy from its registry key and config options (e.g. ``{"rebalance": False}``),
    checked by :func:`check_options`."""
    options = check_options(name, options)
    return POLICIES[name][0](POLICIES[name][1](**options))
