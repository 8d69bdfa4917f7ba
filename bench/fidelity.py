"""Fidelity: the same trace slice live (real HTTP stack on loopback) and simulated; TTFT error.

Live: ``N`` kvgate engines (``engine.server``, each with its reporter on one in-process
``broker.MemoryBroker``), the router (``router.core.Router`` inside
``router.service.EmbeddedRouter``, fed by the broker consumer) and the gateway
(``gateway.app.create_app``), all on 127.0.0.1 free ports in this process; the workload is
replayed open-loop through the gateway with :mod:`bench.replay`.

Simulated: :mod:`bench.sim` with the same engine ids, profile, scheduler, policy, seed and
heartbeat period. The report is ``(sim - live) / live`` for TTFT p50 and p99; the target is 10%.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.metrics import RequestRecord, summarize, write_records
from bench.replay import ReplayConfig, replay
from bench.sim.policies import make_router
from bench.sim.runner import SimConfig, engine_ids, run_one
from bench.workloads import Request, WorkloadOptions, build_workload, describe
from kvgate.cost_model import load_profile
from kvgate.stats import percentile
from router.core import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FidelitySpec:
    """One fidelity comparison (``options.rate_scale`` etc. shape the slice)."""

    workload: str = "mooncake"
    options: WorkloadOptions = field(
        default_factory=lambda: WorkloadOptions(start=600.0, duration=600.0, keep=0.25, spread=1.0)
    )
    policy: str = "e2"
    scheduler: str = "slo"
    sim: SimConfig = field(default_factory=lambda: SimConfig(engines=4))
    tolerance: float = 0.10
    progress: bool = True
    request_timeout_s: float = 900.0
    drain_timeout_s: float = 900.0


def relative_error(sim: float | None, live: float | None) -> float | None:
    """``(sim - live) / live``; None when either is missing or live is zero."""
    if sim is None or live is None or live == 0:
        return None
    return round((sim - live) / live, 4)


async def _wait_alive(router: Router, n: int, timeout_s: float = 20.0) -> None:
    """Until the router has heard a heartbeat from all ``n`` engines (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [e for e in router.engines(time.time()) if e.alive and e.models]
        if len(alive) >= n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(alive)} of {n} engines reached the router")
        await asyncio.sleep(0.05)


async def run_live(
    requests: list[Request], spec: FidelitySpec, records: list[RequestRecord] | None = None
) -> dict:
    """Replay ``requests`` through a live loopback stack; the replay summary plus stack facts.

    ``records``, when given, receives every request's record."""
    from broker import MemoryBroker
    from engine.server import EngineServerConfig
    from engine.server import serve as serve_engine
    from gateway.app import create_app, serve
    from gateway.config import GatewayConfig
    from router.service import EmbeddedRouter

    sim = spec.sim
    model = requests[0].model if requests else "kvgate-sim"
    broker = MemoryBroker()
    runners = []
    try:
        urls = []
        for eid in engine_ids(sim.engines):
            cfg = EngineServerConfig(
                engine_id=eid,
                model=model,
                profile=sim.profile,
                policy=spec.scheduler,
                heartbeat_s=sim.link.heartbeat_s,
            )
            runner, url = await serve_engine(cfg, broker)
            runners.append(runner)
            urls.append((eid, url))
        router = make_router(spec.policy, random.Random(f"router:{sim.seed}"))
        if sim.static_engines:
            # as the simulator does: the same engines in the same order, so the policies'
            # iteration order and seeded tie-breaks match (not heartbeat arrival order)
            profile_name = load_profile(sim.profile).name
            for eid, url in urls:
                router.add_static_engine(eid, url, (model,), profile=profile_name)
        service = EmbeddedRouter(router, broker)
        await service.start()
        try:
            await _wait_alive(router, sim.engines)
            app = create_app(GatewayConfig(port=0, debug_header=True, access_log=False), service)
            gw_runner, port = await serve(app, "127.0.0.1", 0, drain_timeout_s=5.0)
            runners.append(gw_runner)
            cfg = ReplayConfig(
                base_url=f"http://127.0.0.1:{port}",
                progress=spec.progress,
                request_timeout_s=spec.request_timeout_s,
                drain_timeout_s=spec.drain_timeout_s,
            )
            result = await replay(requests, cfg)
        finally:
            await service.close()
        summary = summarize(result.records, engines=engine_ids(sim.engines))
        if records is not None:
            records.extend(result.records)
        summary["client_send_lag_ms"] = result.summary.get("client_send_lag_ms")
        summary["wall_s"] = result.summary.get("wall_s")
        return summary
    finally:
        for runner in reversed(runners):
            with contextlib.suppress(Exception):
                await runner.cleanup()
        with contextlib.suppress(Exception):
            await broker.close()


def run_sim(
    requests: list[Request], spec: FidelitySpec, records: list[RequestRecord] | None = None
) -> dict:
    """The same requests through the simulator; its result dict (summary + sim stats)."""
    return run_one(requests, spec.policy, spec.scheduler, spec.sim, records=records)


def common_ttft(live: list[RequestRecord], sim: list[RequestRecord]) -> dict:
    """TTFT percentiles over the requests that succeeded both live and simulated.

    When routing feedback (sheds, rejections) lets different requests through, percentiles over
    each run's own successes compare different populations; this compares the same ones.
    """
    ok_live = {r.request_id: r.ttft_s for r in live if r.ok and r.ttft_s is not None}
    ok_sim = {r.request_id: r.ttft_s for r in sim if r.ok and r.ttft_s is not None}
    both = sorted(ok_live.keys() & ok_sim.keys())
    out: dict = {"requests": len(both)}
    for name, src in (("live", ok_live), ("sim", ok_sim)):
        vals = [src[k] for k in both]
        out[name] = {
            q: round(percentile(vals, p) * 1000, 3) if vals else None
            for q, p in (("p50", 0.5), ("p99", 0.99))
        }
    out["error"] = {
        f"ttft_{q}": relative_error(out["sim"][q], out["live"][q]) for q in ("p50", "p99")
    }
    same_engine = {r.request_id: r.engine for r in live}
    out["same_engine_share"] = round(
        sum(1 for r in sim if r.engine is not None and same_engine.get(r.request_id) == r.engine)
        / max(len(sim), 1),
        4,
    )
    return out


async def run_fidelity(spec: FidelitySpec, records_prefix: Path | None = None) -> dict:
    """Simulated, then live; the comparison document (``kind: kvgate-fidelity``).

    With ``records_prefix``, per-request records go to ``PREFIX.live.jsonl`` and
    ``PREFIX.sim.jsonl``."""
    requests = build_workload(spec.workload, spec.options, profile=load_profile(spec.sim.profile))
    if not requests:
        raise ValueError("the fidelity slice has no requests")
    t0 = time.perf_counter()
    sim_records: list[RequestRecord] = []
    live_records: list[RequestRecord] = []
    sim_result = run_sim(requests, spec, sim_records)  # first: it never competes with live
    sim_wall = time.perf_counter() - t0
    live = await run_live(requests, spec, live_records)
    if records_prefix is not None:
        write_records(Path(f"{records_prefix}.live.jsonl"), live_records)
        write_records(Path(f"{records_prefix}.sim.jsonl"), sim_records)
    sim = sim_result["summary"]
    err = {
        f"ttft_{q}": relative_error(sim["ttft_ms"][q], live["ttft_ms"][q]) for q in ("p50", "p99")
    }
    err.update(
        {f"tpot_{q}": relative_error(sim["tpot_ms"][q], live["tpot_ms"][q]) for q in ("p50", "p99")}
    )
    ok = all(err[k] is not None and abs(err[k]) <= spec.tolerance for k in ("ttft_p50", "ttft_p99"))
    opts = spec.options
    return {
        "kind": "kvgate-fidelity",
        "label": f"{spec.workload} {opts.duration:g} s from {opts.start:g} s, keep {opts.keep:g}, "
        f"x{opts.rate_scale:g}, {spec.sim.engines} engines, {spec.policy}/{spec.scheduler}",
        "description": (
            "live: engines + router + gateway on loopback (in-process broker), open-loop "
            "streaming replay; sim: bench.sim with the same parts and settings"
        ),
        "workload": {"name": spec.workload, "options": asdict(opts), "shape": describe(requests)},
        "policy": spec.policy,
        "scheduler": spec.scheduler,
        "world": spec.sim.to_dict(),
        "live": live,
        "sim": sim,
        "sim_stats": {**sim_result["sim"], "wall_s": round(sim_wall, 3)},
        "error": err,
        "common": common_ttft(live_records, sim_records),
        "tolerance": spec.tolerance,
        "within_tolerance": ok,
    }
