"""The cost profile an engine announces in its heartbeats is wire input: only a finite profile
the router can name without touching its filesystem is used; anything else is counted in
``unknown_profiles`` and the default profile stands in."""

from __future__ import annotations

import random

import orjson
import pytest

from broker.events import Envelope, LoadHeartbeat
from kvgate.cost_model import DEFAULT_PROFILE, ProfileError, announced_profile, load_profile
from router.api import RouteRequest
from router.cluster_state import ClusterConfig
from router.core import Router, RouterConfig


def hb(profile: str, url: str) -> LoadHeartbeat:
    return LoadHeartbeat(0, 0, 0, 0, 1000, 0.0, profile, url, ("m",))


def inline(mutate) -> str:
    d = load_profile(DEFAULT_PROFILE).to_dict()
    d.pop("description")
    d["name"] = "evil"
    mutate(d)
    return orjson.dumps(d).decode()


def fleet(bad_profile: str) -> Router:
    r = Router(RouterConfig("e2"), random.Random(1))
    for e in ("good1", "good2"):
        r.apply(Envelope(e, "ep", 0, 100.0, hb(DEFAULT_PROFILE, f"http://{e}")), 100.0)
    r.apply(Envelope("bad", "ep", 0, 100.0, hb(bad_profile, "http://bad")), 100.0)
    return r


def set_coef(d: dict, value: str) -> None:
    for seg in d["prefill"]["segments"]:
        seg["coef"] = [value] * len(seg["coef"])


NON_FINITE = {
    "efficiency inf": inline(lambda d: d["prefill"].__setitem__("efficiency", "inf")),
    "coef -inf": inline(lambda d: set_coef(d, "-inf")),
    "coef nan": inline(lambda d: set_coef(d, "nan")),
    "coef hugely negative": inline(lambda d: set_coef(d, -1e308)),
    "attn nan": inline(lambda d: d["prefill"]["attn"].__setitem__("nc", "nan")),
    "speed 1e-300": f"{DEFAULT_PROFILE}@x1e-300",
    "speed 1e300": f"{DEFAULT_PROFILE}@x1e300",
}


@pytest.mark.parametrize("profile", NON_FINITE.values(), ids=NON_FINITE.keys())
def test_a_profile_that_is_not_finite_is_unknown_and_takes_no_extra_traffic(profile) -> None:
    """An inline profile with efficiency "inf" (or a coefficient -inf or nan, or NAME@x1e-300)
    was accepted, priced that engine's every prefill at nothing, and it took all the traffic
    while unknown_profiles stayed 0."""
    r = fleet(profile)
    assert r.cluster.unknown_profiles == 1
    assert r.cluster.engines["bad"].profile == load_profile(DEFAULT_PROFILE)
    picks: dict[str, int] = {}
    for i in range(30):
        key = (b"prefix%d-" % (i % 5)) * 300 + bytes([i])
        d = r.route(RouteRequest(f"r{i}", "m", key, 600, 100), 101.0 + i * 0.05)
        picks[d.engine_id] = picks.get(d.engine_id, 0) + 1
    assert picks.get("bad", 0) < 20, picks


def test_profiles_are_built_only_from_finite_numbers() -> None:
    base = load_profile(DEFAULT_PROFILE)
    d = base.to_dict()
    for field, value in (("efficiency", "inf"), ("efficiency", True), ("efficiency", "0.9")):
        bad = orjson.loads(orjson.dumps(d))
        bad["prefill"][field] = value
        with pytest.raises(ProfileError):
            type(base).from_dict(bad)
    with pytest.raises(ProfileError, match="finite"):
        type(base)("x", base.segments, efficiency=float("inf"))
    with pytest.raises(ProfileError, match="finite"):
        type(base)("x", base.segments, attn_n=float("nan"))
    for factor in (1e-300, 0.001, 1000.0, float("inf"), float("nan")):
        with pytest.raises(ProfileError):
            base.slowed(factor)
    assert base.slowed(0.1).name == f"{DEFAULT_PROFILE}@x0.1"


def _apply_hb(r: Router, profile: str) -> None:
    r.apply(Envelope("bad", "ep", 0, 100.0, hb(profile, "http://bad")), 100.0)


@pytest.mark.parametrize("name", ["/usr/lib/python3.11", "a\x00b"])
def test_a_heartbeat_never_names_a_file_on_the_router_host(name) -> None:
    """A directory raised IsADirectoryError and a NUL ValueError out of the profile lookup
    (the heartbeat dropped as a sink error); now such a name is an unknown profile."""
    r = Router(RouterConfig("e2"), random.Random(1))
    _apply_hb(r, name)
    assert r.cluster.unknown_profiles == 1
    assert r.cluster.engines["bad"].heartbeat is not None  # (the heartbeat itself applied)
    assert r.cluster.engines["bad"].profile == load_profile(DEFAULT_PROFILE)


def test_a_fifo_named_by_a_heartbeat_is_never_opened(tmp_path) -> None:
    """A FIFO path blocked Router.apply for good (the file read synchronously)."""
    import os
    import threading

    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    r = Router(RouterConfig("e2"), random.Random(1))
    done = threading.Thread(target=_apply_hb, args=(r, str(fifo)), daemon=True)
    done.start()
    done.join(5)
    if done.is_alive():  # release the blocked reader before failing
        with open(fifo, "wb"):
            pass
        done.join(5)
        pytest.fail("Router.apply blocked on a FIFO a heartbeat named")
    assert r.cluster.unknown_profiles == 1


def test_a_profile_file_is_known_only_when_the_operator_gives_it(tmp_path) -> None:
    """A file on the router's host: a heartbeat naming its path is unknown, but one given at
    startup (ClusterConfig.profiles, ``--engine-profile``) is named by its name, by the path
    it was given as, or NAME@xK of it; built-in names and their variants keep working."""
    d = load_profile(DEFAULT_PROFILE).to_dict()
    d["name"] = "my-gpu"
    d["prefill"]["efficiency"] = 0.5
    path = tmp_path / "my-gpu.json"
    path.write_bytes(orjson.dumps(d))
    plain = Router(RouterConfig("e2"), random.Random(1))
    _apply_hb(plain, str(path))
    assert plain.cluster.unknown_profiles == 1
    cfg = RouterConfig("e2", cluster=ClusterConfig(profiles=(str(path),)))
    for name, want in (
        ("my-gpu", "my-gpu"),
        (str(path), "my-gpu"),
        ("my-gpu@x2", "my-gpu@x2"),
        ("vllm-cpu-tiny@x3", "vllm-cpu-tiny@x3"),
        (DEFAULT_PROFILE, DEFAULT_PROFILE),
    ):
        r = Router(cfg, random.Random(1))
        _apply_hb(r, name)
        assert (r.cluster.unknown_profiles, r.cluster.engines["bad"].profile.name) == (0, want)
    with pytest.raises(ProfileError):  # the operator's own mistake fails at startup
        Router(
            RouterConfig("e2", cluster=ClusterConfig(profiles=("/nonexistent.json",))),
            random.Random(1),
        )


def test_wire_names_resolve_without_the_filesystem() -> None:
    from kvgate.cost_model import resolve_announced

    with pytest.raises(ProfileError, match="speed factors"):
        resolve_announced(DEFAULT_PROFILE + "@x1" * 5)
    with pytest.raises(ProfileError):
        resolve_announced("@x@x2")
    assert resolve_announced(DEFAULT_PROFILE + "@x2@x2").name == DEFAULT_PROFILE + "@x2@x2"
    assert announced_profile(load_profile(DEFAULT_PROFILE)) == DEFAULT_PROFILE


def test_engine_profile_flag_gives_the_router_a_profile(tmp_path) -> None:
    import argparse

    from router.options import add_router_options, router_config

    parser = argparse.ArgumentParser()
    add_router_options(parser)
    args = parser.parse_args(["--engine-profile", "/p/a.json", "--engine-profile", "b"])
    assert router_config(args).cluster.profiles == ("/p/a.json", "b")
