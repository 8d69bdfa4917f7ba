"""Routing through engine outages: engines crash while traffic runs and come back cold.

    .venv/bin/python -m bench.bench_outages [--workloads mooncake,tool_use] [--fleet 16]
        [--down 4] [--jobs 2] [--out results/outages.json]

A fleet of 10 to 1,000 engines loses engines all the time (deploys, OOMs, preempted nodes). In
the simulator (:class:`bench.sim.world.Outage`) ``--down`` engines (every other one from e00)
go down ``--down-at`` of the way through a matrix cell's arrivals and come back cold (an empty
cache, a new epoch) at ``--up-at``; what they were serving fails, and the gateway's own circuit
breakers (``gateway.pool.EnginePool``) and retries route around them. Each workload runs at
``--rate`` x the matrix's knee for it (round robin's 90% point, from ``--knees-from``, else
found afresh), with ``--requests`` requests so that the outage spans many seconds. Printed and
saved per policy: SLO attainment overall and before, during and after the outage, requests that
failed with their engine (502), the gateway's retries, and the restarted engines' share of the
requests after they came back against the share the policy gave them before they went down (in
a mixed fleet the down engines are fast ones): a router that keeps a cold engine idle wastes the
capacity it got back; one that floods it makes its requests prefill what the others hold.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import orjson

from bench.matrix import KINDS, MatrixSpec, base_workload, calibrate, compact, load_knees
from bench.sim.runner import run_one
from bench.sim.world import Outage
from bench.workloads import scale_rate

RESULT = Path("results/outages.json")
POLICIES = ("e2", "cache_aware", "least_load", "round_robin")
WORKLOADS = ("mooncake", "tool_use", "zipf_doc_qa", "qwen_mix", "azure")


@dataclasses.dataclass(frozen=True, slots=True)
class OutageSpec:
    """What the benchmark runs (picklable for worker processes)."""

    fleet: int = 16
    kind: str = "homo"
    rate: float = 1.0  # x the knee
    requests: int = 3000
    down: int = 4  # engines down: e00, e02, ... (in a mixed fleet, fast ones)
    down_at: float = 0.3  # fractions of the arrivals' span
    up_at: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not 1 <= self.down <= self.fleet // 2:
            raise ValueError(f"down: 1 to {self.fleet // 2} engines (every other one)")
        if not 0.0 <= self.down_at < self.up_at <= 1.0:
            raise ValueError("need 0 <= down_at < up_at <= 1")
        if self.requests < 100 or self.rate <= 0:
            raise ValueError("requests >= 100 and rate > 0")


def run_outage(spec: OutageSpec, workload: str, policy: str, scale: float) -> dict:
    """One policy through the outage on one workload: the figures above."""
    matrix = MatrixSpec()
    reqs = scale_rate(base_workload(workload, 0, spec.requests, matrix.profile), scale)
    start, span = reqs[0].arrival, reqs[-1].arrival - reqs[0].arrival
    down_at, up_at = start + spec.down_at * span, start + spec.up_at * span
    outages = tuple(Outage(2 * i, down_at, up_at) for i in range(spec.down))
    cfg = dataclasses.replace(matrix.sim_config(spec.fleet, spec.kind, spec.seed), outages=outages)
    records: list = []
    result = run_one(reqs, policy, matrix.scheduler, cfg, rate_scale=scale, records=records)
    slow = list(range(1, spec.fleet, 2)) if spec.kind == "hetero" else []
    figures = compact(result, seed=spec.seed, scale=scale, rps=0.0, slow=slow)
    phases = {"before": [0, 0], "during": [0, 0], "after": [0, 0]}
    restarted = {f"e{o.engine:02d}" for o in outages}
    engines: dict[str, collections.Counter[str]] = {
        "before": collections.Counter(),
        "after": collections.Counter(),
    }
    for r in records:
        phase = "before" if r.arrival < down_at else "during" if r.arrival < up_at else "after"
        phases[phase][0] += 1
        phases[phase][1] += r.slo_met
        if phase in engines and r.engine:
            engines[phase][r.engine] += 1

    def share(phase: str) -> float | None:
        total = sum(engines[phase].values())
        mine = sum(engines[phase][e] for e in restarted)
        return round(mine / total, 4) if total else None

    return {
        "workload": workload,
        "policy": policy,
        "scale": scale,
        "requests": len(records),
        "window_s": round(span, 1),
        "down_s": [round(down_at - start, 1), round(up_at - start, 1)],
        "attainment": figures["attainment"],
        "attainment_by_phase": {k: round(m / n, 4) if n else None for k, (n, m) in phases.items()},
        "failed_with_engine": sum(r.status == 502 for r in records),
        "retried": result["sim"]["retried"],
        # the engines that went down: their share of the requests routed after they came
        # back, against the share the same policy gave them before they went down
        "restarted_share_after": share("after"),
        "restarted_share_before": share("before"),
        "ttft_p99_ms": figures["ttft_p99_ms"],
        "hit_rate": figures["hit_rate"],
        "wall_s": figures["wall_s"],
    }


def _knee(spec: OutageSpec, workload: str, knees: dict) -> float:
    knee = knees.get((workload, spec.fleet, spec.kind))
    if knee is None:
        knee = calibrate(MatrixSpec(), workload, spec.fleet, spec.kind)
    return round(knee["scale"] * spec.rate, 6)


def _row(r: dict) -> str:
    ph = r["attainment_by_phase"]
    after, before = r["restarted_share_after"], r["restarted_share_before"]
    return (
        f"| {r['workload']} | {r['policy']} | {100 * r['attainment']:.1f}% | "
        + " / ".join(f"{100 * ph[k]:.1f}" if ph[k] is not None else "-" for k in ph)
        + f" | {r['failed_with_engine']} | {r['retried']} | "
        + (f"{after:.3f}" if after is not None else "-")
        + (f" ({before:.3f})" if before is not None else "")
        + f" | {r['ttft_p99_ms']} | {r['hit_rate']:.3f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--fleet", type=int, default=16)
    ap.add_argument("--kind", default="homo", choices=KINDS)
    ap.add_argument("--rate", type=float, default=1.0, help="x the knee")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--down", type=int, default=4, help="engines that go down (every other one)")
    ap.add_argument("--down-at", type=float, default=0.3, help="fraction of the arrivals' span")
    ap.add_argument("--up-at", type=float, default=0.6, help="fraction of the arrivals' span")
    ap.add_argument("--knees-from", type=Path, default=Path("results/matrix.json"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    try:
        spec = OutageSpec(
            fleet=args.fleet,
            kind=args.kind,
            rate=args.rate,
            requests=args.requests,
            down=args.down,
            down_at=args.down_at,
            up_at=args.up_at,
        )
    except ValueError as exc:
        ap.error(str(exc))
    knees = load_knees(args.knees_from, MatrixSpec()) if args.knees_from.exists() else {}
    workloads = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    t0 = time.perf_counter()
    scales = {w: _knee(spec, w, knees) for w in workloads}
    jobs = [(spec, w, p, scales[w]) for w in workloads for p in policies]
    print(
        "| workload | policy | SLO att. | before / during / after | failed (502) | retried | "
        "restarted engines' share after (before) | TTFT p99 ms | hit rate |\n"
        "|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    runs = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for r in pool.map(run_outage, *zip(*jobs, strict=True)):
            runs.append(r)
            print(_row(r), flush=True)
    doc = {
        "kind": "kvgate-outages",
        "spec": dataclasses.asdict(spec),
        "knees_from": str(args.knees_from),
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
