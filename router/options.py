"""The router's command-line options, defined once for every process that runs a router:
``kvgate router`` and ``kvgate gateway`` with its router embedded take the same flags and build
the same :class:`router.core.RouterConfig` from them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from router.cluster_state import ClusterConfig
from router.core import RouterConfig
from router.policies.registry import POLICIES, PolicyError, check_options, make_policy


def add_router_options(group: Any) -> None:
    """Add the routing-policy and cluster-state flags to a parser or argument group."""
    group.add_argument(
        "--policy", default="e2", choices=sorted(POLICIES), help="routing policy (default e2)"
    )
    group.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a field of the policy's config, e.g. work_weight=2 or rebalance=false "
        "(repeatable; checked against the field's type)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the policy's rng")
    group.add_argument("--tree-budget-mb", type=float, default=1024.0, help="radix tree budget")
    group.add_argument("--window-s", type=float, default=180.0, help="load/prefix window")
    group.add_argument("--heartbeat-ttl-s", type=float, default=15.0, help="engine liveness TTL")
    group.add_argument(
        "--inflight-timeout-s", type=float, default=600.0, help="forget unreported requests after"
    )
    group.add_argument(
        "--speculative-ttl-s", type=float, default=10.0, help="routed key assumed cached for"
    )
    group.add_argument(
        "--speculative-grace-s",
        type=float,
        default=1.0,
        help="... and, on an engine reporting KV events, this long after its request ended",
    )
    group.add_argument(
        "--approximate",
        action="store_true",
        help="build the cache map from routing decisions only (engines without reporters)",
    )
    group.add_argument(
        "--engine-profile",
        dest="engine_profiles",
        action="append",
        default=[],
        metavar="NAME_OR_PATH",
        help="a cost profile (a file on this host, or a name) that engines may announce by its "
        "name, beside the built-in ones (repeatable; a heartbeat never names a file itself)",
    )
    group.add_argument(
        "--no-fit-speed",
        dest="fit_speed",
        action="store_false",
        help="trust the engines' announced cost profiles (no online speed fit)",
    )
    group.add_argument(
        "--fit-gateway-ttft",
        action="store_true",
        help="also fit the prefill speed of engines that send no request events (a plain vLLM "
        "behind the bridge) from the TTFTs the gateway sees of streamed answers (off: they hold "
        "the host's and the HTTP path's delays too)",
    )
    group.add_argument(
        "--no-fit-relative-ttft",
        dest="fit_relative_ttft",
        action="store_false",
        help="do not read an engine that sends no request events as slower than the fleet's "
        "fastest such engine from the gateway's TTFTs against the router's predictions (on by "
        "default: a delay every answer holds cancels in the comparison)",
    )


def json_values(pairs: list[str], usage: str) -> dict[str, Any]:
    """A repeatable flag's ``NAME=VALUE`` pairs; a value is JSON when it parses as JSON
    (numbers, true/false), else the string. A pair without ``=`` or a name raises ValueError
    with ``usage`` (what the flag wants)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{usage}, got {pair!r}")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def policy_options(pairs: list[str]) -> dict[str, Any]:
    """``--policy-option NAME=VALUE`` pairs (:func:`json_values`)."""
    try:
        return json_values(pairs, "--policy-option wants NAME=VALUE")
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig the flags describe; raises PolicyError/ValueError/TypeError on bad
    ones (the policy is built once here to validate its options before anything starts)."""
    options = check_options(args.policy, policy_options(args.policy_option))
    make_policy(args.policy, options)
    cluster = ClusterConfig(
        window_s=args.window_s,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        inflight_timeout_s=args.inflight_timeout_s,
        tree_budget_bytes=int(args.tree_budget_mb * (1 << 20)),
        speculative_ttl_s=args.speculative_ttl_s,
        speculative_grace_s=args.speculative_grace_s,
        approximate=args.approximate,
        fit_speed=args.fit_speed,
        fit_gateway_ttft=args.fit_gateway_ttft,
        fit_relative_ttft=args.fit_relative_ttft,
        profiles=tuple(args.engine_profiles),
    )
    return RouterConfig(args.policy, options, cluster)
