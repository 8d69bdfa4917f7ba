"""One definition of the router's flags (router/options.py) for ``kvgate router`` and for
``kvgate gateway`` with its router embedded: same flags, same defaults, same RouterConfig."""

from __future__ import annotations

import argparse
import random

import pytest

from gateway import cli as gateway_cli
from gateway.routing import RoutingOptions, open_routing
from kvgate.cli import build_parser
from router import cli as router_cli
from router.core import Router
from router.options import add_router_options, router_config

ARGV = [
    "--policy",
    "e2",
    "--policy-option",
    "work_weight=2",
    "--policy-option",
    "rebalance=true",
    "--window-s",
    "60",
    "--tree-budget-mb",
    "64",
    "--speculative-ttl-s",
    "3",
    "--seed",
    "7",
    "--no-fit-speed",
    "--fit-gateway-ttft",
]


def flags(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Option string -> default, of every flag the parser takes."""
    return {s: a.default for a in parser._actions for s in a.option_strings}


def sub(command: str) -> argparse.ArgumentParser:
    parser = build_parser([command])
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def test_both_commands_take_every_router_flag_with_the_same_default() -> None:
    reference = argparse.ArgumentParser()
    add_router_options(reference)
    want = {s: d for s, d in flags(reference).items() if s not in ("-h", "--help")}
    assert {"--policy", "--policy-option", "--seed", "--window-s"} <= set(want)
    for command in ("router", "gateway"):
        have = flags(sub(command))
        assert {s: have.get(s, "missing") for s in want} == want, command


def test_the_same_flags_give_the_same_router_config() -> None:
    r = router_config(sub("router").parse_args(ARGV))
    g = router_config(sub("gateway").parse_args(ARGV))
    assert r == g
    assert r.policy_options == {"work_weight": 2, "rebalance": True}
    assert r.cluster.window_s == 60.0 and r.cluster.tree_budget_bytes == 64 << 20
    assert r.cluster.speculative_ttl_s == 3.0 and r.cluster.fit_speed is False
    assert r.cluster.fit_gateway_ttft is True
    assert router_config(sub("router").parse_args([])).cluster.fit_gateway_ttft is False
    assert router_config(sub("router").parse_args([])).cluster.fit_relative_ttft is True
    off = sub("gateway").parse_args(["--no-fit-relative-ttft"])
    assert router_config(off).cluster.fit_relative_ttft is False


async def test_the_embedded_router_runs_with_the_flags() -> None:
    args = sub("gateway").parse_args(ARGV)
    options = RoutingOptions(policy=args.policy, seed=args.seed, router=router_config(args))
    async with open_routing(options) as handle:
        config = handle.router.config
        assert config.policy_options == {"work_weight": 2, "rebalance": True}
        assert config.cluster.window_s == 60.0
        assert handle.router.policy.config.work_weight == 2
        assert handle.router.policy.config.rebalance is True


@pytest.mark.parametrize("command", ["router", "gateway"])
@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (["--policy-option", "no_such_option=1"], "no_such_option"),
        (["--policy-option", "work_weight"], "NAME=VALUE"),
        (["--policy-option", "shed_factor=0.5"], "shed_factor"),
    ],
)
def test_a_bad_policy_option_stops_either_command_with_a_clear_error(
    command: str, bad: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = router_cli if command == "router" else gateway_cli
    args = sub(command).parse_args(["--log-level", "error", *bad])
    assert module.run(args) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("command", ["router", "gateway"])
@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("rebalance=maybe", "option rebalance wants a boolean (true/false, 1/0), got 'maybe'"),
        ("rebalance=2", "option rebalance wants a boolean"),
        ("rebalance_ratio=abc", "option rebalance_ratio wants a number, got 'abc'"),
        ("rebalance_ratio=true", "option rebalance_ratio wants a number, got True"),
    ],
)
def test_a_policy_option_of_the_wrong_type_stops_either_command(
    command: str,
    bad: str,
    words: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = router_cli if command == "router" else gateway_cli

    def started(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("started serving with a bad option")

    monkeypatch.setattr(module, "serve" if command == "router" else "run_worker", started)
    args = sub(command).parse_args(["--log-level", "error", "--policy-option", bad])
    assert module.run(args) == 2
    err = capsys.readouterr().err
    assert f"kvgate {command}: error: e2: {words}" in err


@pytest.mark.parametrize(
    ("given", "value"),
    [("False", False), ("FALSE", False), ("false", False), ("0", False), ("True", True),
     ("1", True), ("true", True)],
)  # fmt: skip
def test_a_boolean_option_takes_true_false_in_any_case_and_1_0(given: str, value: bool) -> None:
    """``rebalance=False`` (not JSON) was the string "False": a truthy flag."""
    config = router_config(sub("router").parse_args(["--policy-option", f"rebalance={given}"]))
    assert config.policy_options == {"rebalance": value}
    assert Router(config, random.Random(0)).policy.config.rebalance is value


def test_policy_options_are_converted_to_their_fields_types() -> None:
    from router.policies.registry import check_options

    assert check_options("e2", {"rebalance_ratio": 2, "work_weight": "0.5"}) == {
        "rebalance_ratio": 2.0,
        "work_weight": 0.5,
    }
    assert check_options("e2", {"rebalance_ratio": "2"})["rebalance_ratio"] == 2.0
