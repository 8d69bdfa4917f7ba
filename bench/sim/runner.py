"""Simulation runs and sweeps: policies x local schedulers x rates over one workload.

Builds the real ``router.core.Router`` (policy from a spec string, see
:func:`bench.sim.policies.router_config`) and real ``engine.core.EngineCore`` s, runs
:class:`bench.sim.world.World`, and summarises with :func:`bench.metrics.summarize`. A sweep
writes one JSON (``kind: kvgate-sim``) that ``kvgate bench report`` reads.
"""

from __future__ import annotations

import cProfile
import logging
import math
import os
import pstats
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.metrics import RequestRecord, summarize, write_records
from bench.sim.policies import make_router
from bench.sim.world import LinkConfig, Outage, World
from bench.workloads import (
    Request,
    WorkloadOptions,
    build_workload,
    describe,
    limit,
    scale_rate,
)
from broker.events import ROLES
from engine.core import EngineCore, EngineRequest, SchedulerConfig
from kvgate.cost_model import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_KV_LINK_GBPS,
    DEFAULT_PROFILE,
    CostProfile,
    load_profile,
)
from router.api import Decision, RouteRequest
from router.cluster_state import ClusterConfig
from router.core import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated cluster (the workload is separate)."""

    engines: int = 16
    profile: str = DEFAULT_PROFILE
    link: LinkConfig = field(default_factory=LinkConfig)
    seed: int = 0
    static_engines: bool = True  # also register engines by hand (no wait for a heartbeat)
    drain_s: float | None = 4 * 3600.0  # virtual time allowed after the last arrival
    # heterogeneous fleet: every second engine (e01, e03, ...) is this many times slower
    slow_factor: float = 1.0
    # or each engine's own time factor (0.5: twice as fast), overriding slow_factor
    speeds: tuple[float, ...] | None = None
    # each engine's own cost profile (a name, path or ``NAME@xK``; None: ``profile`` for all):
    # a fleet of two GPU generations, whose KV memory and block size differ as well as their
    # speed; each engine announces its own (its operator configured it), the speed factors above
    # applying on top of it as ``slow_announce`` says
    profiles: tuple[str, ...] | None = None
    # what engines off their profile announce: "same" (the configured profile's name: the
    # router is not told, as with a mis-profiled engine) or "true" (their ``NAME@xK`` profile)
    slow_announce: str = "same"
    # the router's cluster state (windows, TTLs, fit_speed); None: its defaults
    cluster: ClusterConfig | None = None
    # prefill/decode disaggregation: each engine's role (broker.events.ROLES; None: all
    # "both"), and the KV link between engines (the router is told the same figures)
    roles: tuple[str, ...] | None = None
    kv_link_gbps: float = DEFAULT_KV_LINK_GBPS
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    # a fleet scaled out while traffic runs: each engine's join time, virtual s from the run's
    # start (None: every engine from the start); a late engine is known to the router only
    # from its first heartbeat
    joins: tuple[float, ...] | None = None
    # engines that go down and come back cold while traffic runs (bench.sim.world.Outage)
    outages: tuple[Outage, ...] = ()

    def __post_init__(self) -> None:
        if self.roles is not None and (
            len(self.roles) != self.engines or not set(self.roles) <= set(ROLES)
        ):
            raise ValueError(f"roles: one of {', '.join(ROLES)} per engine")
        if not (self.kv_link_gbps > 0 and self.kv_bytes_per_token > 0):
            raise ValueError("kv_link_gbps and kv_bytes_per_token must be positive")
        if self.engines < 1:
            raise ValueError("engines must be >= 1")
        if not self.slow_factor > 0:
            raise ValueError("slow_factor must be positive")
        if self.speeds is not None and (
            len(self.speeds) != self.engines or not all(f > 0 for f in self.speeds)
        ):
            raise ValueError("speeds: one positive factor per engine")
        if self.joins is not None and (
            len(self.joins) != self.engines
            or not all(t >= 0 and math.isfinite(t) for t in self.joins)
            or min(self.joins) > 0
        ):
            raise ValueError("joins: one finite time >= 0 per engine, some engine at 0")
        if any(o.engine >= self.engines for o in self.outages):
            raise ValueError(f"outages: engine indexes run from 0 to {self.engines - 1}")
        if self.slow_announce not in ("same", "true"):
            raise ValueError("slow_announce must be 'same' or 'true'")
        if self.profiles is not None:
            if len(self.profiles) != self.engines:
                raise ValueError("profiles: one profile per engine")
            # (the workload's keys are written at one tokenizer's bytes a token: one model)
            widths = {p.bytes_per_token for p in self.base_profiles()}
            widths.add(load_profile(self.profile).bytes_per_token)
            if len(widths) > 1:
                raise ValueError(
                    "profiles: every engine's profile must have the workload profile's "
                    f"bytes_per_token (one model, one tokenizer), not {sorted(widths)}"
                )

    def base_profiles(self) -> list[CostProfile]:
        """Each engine's configured profile (what it announces unless ``slow_announce`` is
        "true"), in engine order."""
        specs = self.profiles or (self.profile,) * self.engines
        return [load_profile(spec) for spec in specs]

    def engine_profiles(self) -> list[CostProfile]:
        """Each engine's true cost profile, in engine order (its configured one, slowed by its
        speed factor: :func:`build_world`)."""
        factors = self.speeds or [self.slow_factor if i % 2 else 1.0 for i in range(self.engines)]
        return [base.slowed(f) for base, f in zip(self.base_profiles(), factors, strict=True)]

    def to_dict(self) -> dict:
        return asdict(self)


def engine_ids(n: int) -> list[str]:
    width = max(2, len(str(n - 1)))
    return [f"e{i:0{width}d}" for i in range(n)]


def _engine_request(req: Request, key: bytes, arrival: float) -> EngineRequest:
    return EngineRequest(
        request_id=req.request_id,
        key=key,
        input_tokens=req.input_tokens,
        output_tokens=req.output_tokens,
        slo=req.slo,
        arrival=arrival,
        answer_key=req.answer_key(),
        max_tokens=req.max_tokens,
    )


class _TimedRouter:
    """Delegates to the real router and adds up the wall time of ``route`` calls (the
    router's decision rate is one of the reported figures)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.route_s = 0.0
        self.apply = router.apply
        self.report = router.report
        self.first_token = router.first_token
        self.add_static_engine = router.add_static_engine

    def route(self, req: RouteRequest, now: float) -> Decision:
        t0 = time.perf_counter()
        try:
            return self.router.route(req, now)
        finally:
            self.route_s += time.perf_counter() - t0


def build_world(policy: str, scheduler: str, cfg: SimConfig, *, predictions: bool = False) -> World:
    """One router (``policy`` spec), ``cfg.engines`` engine cores (``scheduler``), wired;
    ``predictions``: records carry the router's predicted TTFT (:class:`World`)."""
    profile: CostProfile = load_profile(cfg.profile)
    ids = engine_ids(cfg.engines)
    # Only first tokens, finishes and rejections: the simulator needs no per-token outputs.
    sched_cfg = SchedulerConfig(stream_outputs=False)
    roles = cfg.roles or ("both",) * cfg.engines
    # an engine runs its true profile and names its configured one (slow_announce "same"):
    # routers must find out how fast it really is
    profiles = cfg.engine_profiles()
    configured = cfg.base_profiles()

    def make_engine(index: int) -> EngineCore:
        """Engine ``index``'s process (a new one, cold, when it restarts after an outage)."""
        prof = profiles[index]
        return EngineCore(
            ids[index],
            prof,
            policy=scheduler,
            config=sched_cfg,
            role=roles[index],
            announced=configured[index] if cfg.slow_announce == "same" else prof,
        )

    engines = [make_engine(i) for i in range(cfg.engines)]
    cluster = cfg.cluster
    if cfg.roles is not None:
        cluster = replace(
            cluster or ClusterConfig(),
            kv_link_gbps=cfg.kv_link_gbps,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
        )
    router = _TimedRouter(make_router(policy, random.Random(f"router:{cfg.seed}"), cluster=cluster))
    world = World(
        router,
        engines,
        profile=profile,
        make_engine_request=_engine_request,
        rng=random.Random(f"link:{cfg.link.seed}"),
        link=cfg.link,
        predictions=predictions,
        kv_ms_per_token=cfg.kv_bytes_per_token * 8.0 / (cfg.kv_link_gbps * 1e6),
        join_at=cfg.joins,
        outages=cfg.outages,
        restart=make_engine,
    )
    if cfg.static_engines:
        for slot, eng in zip(world.slots, engines, strict=True):
            if slot.join_at > 0.0:
                continue  # (a late engine announces itself)
            router.add_static_engine(
                slot.core.engine_id,
                slot.url,
                world.models,
                profile=eng.announced_spec,
                role=eng.role,
            )
    return world


def run_one(
    requests: Sequence[Request],
    policy: str,
    scheduler: str,
    cfg: SimConfig,
    *,
    rate_scale: float = 1.0,
    profile_path: Path | None = None,
    records: list[RequestRecord] | None = None,
    predictions: bool = False,
) -> dict:
    """Simulate ``requests`` with one policy and one local scheduler; the run's result dict.

    ``records``, when given, receives every request's record (with the router's predicted
    TTFT when ``predictions``).
    """
    world = build_world(policy, scheduler, cfg, predictions=predictions)
    profiler = cProfile.Profile() if profile_path is not None else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    world.run(requests, drain_s=cfg.drain_s)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - t0
    if profiler is not None and profile_path is not None:
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(profile_path))
    ids = [s.core.engine_id for s in world.slots]
    route_s = world.router.route_s if isinstance(world.router, _TimedRouter) else 0.0
    summary = summarize(world.records, engines=ids)
    summary["busy_s"] = {slot.core.engine_id: round(slot.busy_s, 3) for slot in world.slots}
    if records is not None:
        records.extend(world.records)
    st = world.stats
    return {
        "policy": policy,
        "scheduler": scheduler,
        "rate_scale": rate_scale,
        "summary": summary,
        "sim": {
            "wall_s": round(wall, 3),
            "virtual_s": round(world.loop.now, 3),
            "events": world.loop.processed,
            "events_per_s": round(world.loop.processed / wall, 1) if wall > 0 else None,
            "route_calls": st.route_calls,
            "route_us_mean": round(route_s / st.route_calls * 1e6, 1) if st.route_calls else None,
            "decisions_per_s": round(st.route_calls / route_s, 1) if route_s > 0 else None,
            "envelopes": st.envelopes,
            "deliveries": st.deliveries,
            "heartbeats": st.heartbeats,
            "engine_wakes": st.wakes,
            "stale_wakes": st.stale_wakes,
            "shed_by_router": st.shed,
            "disaggregated": st.extra.get("disaggregated", 0),
            "outages": st.extra.get("outages", 0),
            "retried": st.extra.get("retried", 0),
            "kv_transfer_ms_mean": round(sum(world.transfers_ms) / len(world.transfers_ms), 3)
            if world.transfers_ms
            else None,
        },
    }


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """Everything a sweep needs; picklable so worker processes can rebuild the workload."""

    workload: str
    options: WorkloadOptions
    policies: tuple[str, ...]
    schedulers: tuple[str, ...]
    rate_scales: tuple[float, ...]
    sim: SimConfig
    profile_dir: str | None = None  # cProfile output per run when set
    # every request's record per run (JSON lines, the router's predicted TTFT included) when set
    records_dir: str | None = None


def _cells(spec: SweepSpec) -> list[tuple[str, str, float]]:
    return [
        (pol, sch, rate)
        for rate in spec.rate_scales
        for sch in spec.schedulers
        for pol in spec.policies
    ]


def _workload(spec: SweepSpec) -> list[Request]:
    """The workload at rate x1 and uncut: each cell compresses and limits its own copy."""
    base = replace(spec.options, rate_scale=1.0, max_requests=None)
    return build_workload(spec.workload, base, profile=load_profile(spec.sim.profile))


def _scaled(requests: list[Request], opts: WorkloadOptions, rate: float) -> list[Request]:
    out = scale_rate(requests, opts.rate_scale * rate)
    return limit(out, opts.max_requests)


def run_file_stem(policy: str) -> str:
    """A policy spec as a file name's stem: ``e2[rebalance=false]`` -> ``e2[rebalance-false]``
    (no ``:``, ``,``, ``=`` or ``/``)."""
    for bad, good in ((":", "_"), (",", "_"), ("=", "-"), ("/", "_")):
        policy = policy.replace(bad, good)
    return policy


def _run_cell(spec: SweepSpec, cell: tuple[str, str, float], requests: list[Request]) -> dict:
    pol, sch, rate = cell
    reqs = _scaled(requests, spec.options, rate)
    name = f"{run_file_stem(pol)}-{sch}-x{rate:g}"
    prof = Path(spec.profile_dir) / f"{name}.prof" if spec.profile_dir else None
    records_to = Path(spec.records_dir) / f"{name}.jsonl" if spec.records_dir else None
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    result = run_one(
        reqs,
        pol,
        sch,
        spec.sim,
        rate_scale=rate,
        profile_path=prof,
        records=records if records_to is not None else None,
        predictions=records_to is not None,
    )
    if prof is not None:
        result["profile"] = profile_breakdown(prof)
    if records_to is not None:
        write_records(records_to, records)
        result["records"] = str(records_to)
    s = result["summary"]
    print(
        f"sim: {pol:<28} {sch:<7} x{rate:<5g} {len(reqs):>6} req  "
        f"SLO {100 * s.get('slo_attainment', 0):5.1f}%  "
        f"TTFT p99 {(s.get('ttft_ms') or {}).get('p99') or 0:9.0f} ms  "
        f"hit {100 * (s.get('prefix_hit_rate') or 0):5.1f}%  "
        f"({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return result


_WORKER_SPEC: SweepSpec | None = None
_WORKER_REQS: list[Request] | None = None


def _worker_cell(cell: tuple[str, str, float]) -> dict:
    global _WORKER_SPEC, _WORKER_REQS
    assert _WORKER_SPEC is not None
    if _WORKER_REQS is None:
        _WORKER_REQS = _workload(_WORKER_SPEC)
    return _run_cell(_WORKER_SPEC, cell, _WORKER_REQS)


def _init_worker(spec: SweepSpec) -> None:
    """A forked worker inherits the parent's workload; a spawned one rebuilds it once."""
    global _WORKER_SPEC, _WORKER_REQS
    if spec != _WORKER_SPEC:
        _WORKER_SPEC, _WORKER_REQS = spec, None


def sweep(spec: SweepSpec, *, jobs: int = 1) -> dict:
    """Run every (policy, scheduler, rate) cell; the result document (``kind: kvgate-sim``)."""
    t0 = time.perf_counter()
    requests = _workload(spec)
    cells = _cells(spec)
    if jobs > 1 and len(cells) > 1:
        global _WORKER_SPEC, _WORKER_REQS
        _WORKER_SPEC, _WORKER_REQS = spec, requests
        try:
            with ProcessPoolExecutor(
                max_workers=min(jobs, len(cells)), initializer=_init_worker, initargs=(spec,)
            ) as pool:
                runs = list(pool.map(_worker_cell, cells))
        finally:
            _WORKER_SPEC, _WORKER_REQS = None, None
    else:
        runs = [_run_cell(spec, c, requests) for c in cells]
    return {
        "kind": "kvgate-sim",
        "workload": {
            "name": spec.workload,
            "options": asdict(spec.options),
            "shape": describe(requests),
        },
        "world": spec.sim.to_dict(),
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 3),
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def profile_breakdown(profile_path: Path, top: int = 12) -> dict:
    """Where a profiled run spent its time: own seconds per top-level package (bench, engine,
    router, ...) and the costliest functions, so hot spots can be reported to their owners."""
    stats = pstats.Stats(str(profile_path))
    by_package: dict[str, float] = {}
    rows = []
    root = str(Path(__file__).resolve().parents[2]) + "/"
    for (file, line, fn), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file.startswith(root):
            rel = file[len(root) :]
            package = rel.split("/", 1)[0]
        else:
            rel = file
            package = "builtins" if file == "~" else "stdlib/other"
        by_package[package] = by_package.get(package, 0.0) + own
        rows.append((f"{rel}:{line}:{fn}", own, cum, calls))
    rows.sort(key=lambda r: -r[1])
    total = sum(by_package.values()) or 1.0
    return {
        "total_s": round(total, 3),
        "own_s_by_package": {
            k: round(v, 3) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])
        },
        "top_functions": [
            {"function": f, "own_s": round(o, 3), "cum_s": round(c, 3), "calls": n}
            for f, o, c, n in rows[:top]
        ],
    }
