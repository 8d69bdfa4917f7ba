"""Router policy specs for sweeps: ``name`` or ``name[option=value,...]``, plus ablation aliases.

The options are the fields of the policy's own frozen config in ``router/policies/`` (the
registry there is the only list of policies; unknown names or options fail with its message).
E2's ablations are flags on its config; the aliases name the ones docs/router.md measures.
"""

from __future__ import annotations

from typing import Any

from router.cluster_state import ClusterConfig
from router.core import Router, RouterConfig
from router.policies.base import Rng

# E2's ablations (flags of router.policies.e2.E2Config), as the matrix and docs name them.
ALIASES: dict[str, str] = {
    "e2-no-m": "e2[eviction_term=false]",
    "e2-no-slo": "e2[slo_filter=false]",
    "e2-no-band": "e2[tie_rel=0,tie_ms=0]",
    "e2-by-load": "e2[spread_by_traffic=false]",
    "e2-no-work": "e2[work_weight=0]",
    "e2-idle-free": "e2[idle_free=true]",
    "e2-feasible-first": "e2[prefer_feasible=true]",
    "e2-no-miss": "e2[miss_penalty=0]",
    "e2-doomed-by-cost": "e2[doomed_to_holder=false]",
    "e2-no-lanes": "e2[decode_delay=false]",
    "e2-pd": "e2[pd_balance=true]",
    "e2-rebalance": "e2[rebalance=true]",
    "e2-no-rebalance": "e2[rebalance=false]",
    "e2-band-moves-only": "e2[follow_spare=false]",
    "e2-no-spare-replica": "e2[replicate_to_spare=false]",
    "e2-room-by-frequency": "e2[room_beside_all_reused=false]",
    "e2-admission": "e2[shed_expected=true]",
    "e2-preble-trigger": "e2[balance_trigger=0]",
    "e2-wait-for-room": "e2[make_way=false]",
    "e2-heaviest-first": "e2[moves_by_fit=false]",
}


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """``e2[rebalance=false,pd_balance=false]`` -> ``("e2", {"rebalance": False, ...})``."""
    spec = ALIASES.get(spec.strip(), spec.strip())
    name, sep, rest = spec.partition("[")
    options: dict[str, Any] = {}
    if sep:
        if not rest.endswith("]"):
            raise ValueError(f"policy spec {spec!r}: missing ']'")
        for item in rest[:-1].split(","):
            if not item.strip():
                continue
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"policy spec {spec!r}: options are key=value")
            options[key.strip()] = _value(value)
    if not name.strip():
        raise ValueError("empty policy name")
    return name.strip(), options


def check_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """``spec`` parsed and its policy built once, so that an unknown name, alias or option, or
    an option value of the wrong type, is an error before any work (ValueError; PolicyError is
    one); the name and the options converted to their fields' types."""
    from router.policies.registry import check_options, make_policy

    name, options = parse_policy(spec)
    options = check_options(name, options)
    make_policy(name, options)
    return name, options


def make_router(spec: str, rng: Rng, cluster: ClusterConfig | None = None) -> Router:
    """The real router running the policy ``spec`` (see :func:`parse_policy`)."""
    name, options = parse_policy(spec)
    config = RouterConfig(policy=name, policy_options=options)
    if cluster is not None:
        config = RouterConfig(policy=name, policy_options=options, cluster=cluster)
    return Router(config, rng)
