"""Does the router's online cost model converge? Engines that are not what their profile says.

    .venv/bin/python -m bench.bench_cost_fit [--engines 8] [--requests 3000] [--workload tool_use]
        [--reporting events|bridge] [--scheduler slo|fcfs|preble]

A simulated fleet whose engines all announce the default profile, but run truly 2x faster (a
quarter of them), 2x slower (a quarter) or as announced (the rest). The router fits each
engine's prefill and decode speed online (:class:`kvgate.cost_model.SpeedFit`, from the
engines' FirstToken and heartbeat reports). For every routed request the simulator records the
router's predicted TTFT on the engine it chose and the TTFT the request got; per engine and per
time bucket the benchmark reports the median error ``|log2(predicted / observed)|`` (1.0 = off
by 2x) and the fitted factors, with the fit on and off (``ClusterConfig.fit_speed``), and the SLO
attainment and p99 TTFT of e2 both ways. Saves ``results/cost_fit.json`` and a plot.

``--reporting bridge``: the engines report as a plain vLLM behind the bridge does (KV events and
heartbeats without prefill timings, no request events, the decode step as vLLM's mean inter-token
latency) and, by default, serve as one does (``--scheduler fcfs``: arrival order, chunked prefill
mixed into the decode steps; before the fifty-third session they ran kvgate's S-EDF, which no
deployment puts behind the bridge), so the only evidence of their prefill speed is the TTFT the
gateway sees (``Router.first_token``); three runs: by default each engine read against the fleet's
fastest from every TTFT against the router's prediction (``ClusterConfig.fit_relative_ttft``: the
fastest is taken as its profile, so the engines truly 2x faster read as announced and the rest 2x
slower than they are), the absolute fit from the TTFTs of requests that found their engine idle
(``fit_gateway_ttft``, off by default), and neither. Saves ``results/cost_fit_bridge.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import orjson

from bench.matrix import SCALED_SLO, base_rate
from bench.metrics import RequestRecord
from bench.sim.runner import SimConfig, build_world
from bench.sim.world import LinkConfig
from bench.workloads import WorkloadOptions, build_workload, scale_rate
from engine.scheduler import POLICIES as SCHEDULERS
from kvgate.cost_model import load_profile
from router.cluster_state import ClusterConfig

RESULT = Path("results/cost_fit.json")
RESULT_BRIDGE = Path("results/cost_fit_bridge.json")


def speeds_for(engines: int) -> tuple[float, ...]:
    """A quarter 2x faster, a quarter 2x slower, the rest as announced (interleaved)."""
    pattern = (0.5, 1.0, 2.0, 1.0)
    return tuple(pattern[i % 4] for i in range(engines))


def run(
    workload: str,
    engines: int,
    requests: int,
    load: float,
    fit: bool,
    seed: int,
    link: LinkConfig | None = None,
    gateway_fit: bool = False,
    relative_fit: bool = True,
    scheduler: str = "slo",
) -> tuple[list[RequestRecord], dict[str, tuple[float, float]], dict]:
    """One simulation; the records, the final fitted factors per engine and the summary."""
    profile = load_profile("mistral-7b-a6000")
    opts = WorkloadOptions(seed=seed, rate=4.0, duration=1.5 * requests / 4.0 + 30.0,
                           max_requests=requests, slo=SCALED_SLO)  # fmt: skip
    reqs = build_workload(workload, opts, profile=profile)
    # offered load: ``load`` x the fleet's nominal prefill capacity, as the matrix guesses it
    mean_ms = sum(profile.prefill_ms(r.input_tokens) for r in reqs) / len(reqs)
    capacity_rps = sum(1.0 / f for f in speeds_for(engines)) * 1000.0 / mean_ms
    reqs = scale_rate(reqs, load * capacity_rps / base_rate(reqs))
    cfg = SimConfig(
        engines=engines,
        seed=seed,
        speeds=speeds_for(engines),
        cluster=replace(
            ClusterConfig(),
            fit_speed=fit,
            fit_gateway_ttft=gateway_fit,
            fit_relative_ttft=relative_fit,
        ),
        link=link or LinkConfig(),
    )
    world = build_world("e2", scheduler, cfg, predictions=True)
    world.run(reqs, drain_s=cfg.drain_s)
    router = world.router.router  # (the simulator's timing wrapper around the real router)
    factors = {
        eid: (round(e.speed.prefill, 4), round(router.cluster.decode_scale(e), 4))
        for eid, e in router.cluster.engines.items()
    }
    from bench.metrics import summarize

    return world.records, factors, summarize(world.records, engines=sorted(factors))


def errors_over_time(
    records: list[RequestRecord], speeds: dict[str, float], buckets: int
) -> dict[str, list[float | None]]:
    """Per engine: the median |log2(predicted / observed TTFT)| in each of ``buckets`` equal
    slices of the arrivals (None: no request there)."""
    routed = [r for r in records if r.predicted_ttft_ms and r.ttft_s and r.engine]
    if not routed:
        return {}
    t0 = min(r.arrival for r in routed)
    span = max(r.arrival for r in routed) - t0 or 1.0
    out: dict[str, list[list[float]]] = {e: [[] for _ in range(buckets)] for e in speeds}
    for r in routed:
        b = min(int((r.arrival - t0) / span * buckets), buckets - 1)
        err = abs(math.log2(r.predicted_ttft_ms / max(r.ttft_s * 1000.0, 1e-3)))
        out[r.engine][b].append(err)
    return {
        e: [round(statistics.median(v), 3) if v else None for v in series]
        for e, series in out.items()
    }


def by_class(series: dict[str, list], speeds: dict[str, float]) -> dict[str, list]:
    """The per-engine series pooled by true speed (median of the engines' medians)."""
    out: dict[str, list] = {}
    for factor in sorted(set(speeds.values())):
        members = [series[e] for e, f in speeds.items() if f == factor and e in series]
        pooled = []
        for vals in zip(*members, strict=True):
            got = [v for v in vals if v is not None]
            pooled.append(round(statistics.median(got), 3) if got else None)
        out[f"x{factor:g}"] = pooled
    return out


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, key in zip(axes, ("fit", "no_fit"), strict=True):
        for cls, series in doc[key]["error_by_class"].items():
            xs = [i for i, v in enumerate(series) if v is not None]
            ax.plot(xs, [series[i] for i in xs], marker="o", label=f"engines {cls} slower")
        ax.set_title(doc[key]["title"], fontsize=9)
        ax.set_xlabel("time (tenths of the run)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("median |log2(predicted / observed TTFT)|")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="tool_use")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--load", type=float, default=0.7, help="x the fleet's nominal capacity")
    ap.add_argument("--buckets", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reporting",
        choices=("events", "bridge"),
        default="events",
        help="events: kvgate's engine (request events, step timings); bridge: a plain vLLM "
        "behind the bridge (neither: the gateway's TTFTs are the evidence)",
    )
    ap.add_argument(
        "--scheduler",
        choices=tuple(SCHEDULERS),
        default=None,
        help="the engines' local scheduler (default: slo with events, fcfs behind the bridge: a "
        "plain vLLM serves in arrival order)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    bridge = args.reporting == "bridge"
    scheduler = args.scheduler or ("fcfs" if bridge else "slo")
    out = args.out or (RESULT_BRIDGE if bridge else RESULT)
    names = [f"e{i:02d}" for i in range(args.engines)]
    speeds = dict(zip(names, speeds_for(args.engines), strict=True))
    doc: dict = {
        "kind": "kvgate-cost-fit",
        "workload": args.workload,
        "engines": args.engines,
        "requests": args.requests,
        "load": args.load,
        "reporting": args.reporting,
        "scheduler": scheduler,
        "true_time_factors": speeds,
    }
    # (key, the engines' link, fit_speed, fit_gateway_ttft, fit_relative_ttft, title)
    if bridge:
        muted = LinkConfig(request_events=False)
        runs = (
            (
                "fit",
                muted,
                True,
                False,
                True,
                "e2 behind the bridge, prefill fitted against the fleet's fastest (the default)",
            ),
            ("absolute", muted, True, True, False, "... from idle engines' TTFTs alone"),
            ("no_fit", muted, True, False, False, "... not fitted from the gateway's TTFTs"),
        )
    else:
        runs = (
            ("fit", LinkConfig(), True, False, True, "e2, online fit on"),
            ("no_fit", LinkConfig(), False, False, True, "e2, online fit off"),
        )
    for key, link, fit, gateway_fit, relative_fit, title in runs:
        records, factors, summary = run(
            args.workload, args.engines, args.requests, args.load, fit, args.seed, link,
            gateway_fit, relative_fit, scheduler,
        )  # fmt: skip
        series = errors_over_time(records, speeds, args.buckets)
        doc[key] = {
            "title": title,
            "fitted_factors": factors,  # engine -> (prefill, decode)
            "error_by_engine": series,
            "error_by_class": by_class(series, speeds),
            "slo_attainment": summary["slo_attainment"],
            "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "per_engine_requests": summary["per_engine_requests"],
        }
        print(
            f"{title}: attainment {100 * summary['slo_attainment']:.1f}%, "
            f"TTFT p99 {summary['ttft_ms']['p99']:.0f} ms; error by class (first, last tenth): "
            + ", ".join(f"{c} {s[0]} -> {s[-1]}" for c, s in doc[key]["error_by_class"].items()),
            file=sys.stderr,
        )
    for eid, (pf, df) in doc["fit"]["fitted_factors"].items():
        print(f"  {eid}: true x{speeds[eid]:g}, fitted prefill x{pf:.3f} decode x{df:.3f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    png = out.with_suffix(".png")
    if plot(doc, png):
        print(f"wrote {png}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
