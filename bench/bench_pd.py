"""Colocated against prefill/decode-disaggregated fleets of the same engine count, in the
simulator (the same Router and EngineCore objects as live; ``bench.sim.world`` models the KV's
move): TTFT, TPOT, SLO attainment and goodput on Mooncake and qwen_mix, at a few loads.

``.venv/bin/python -m bench.bench_pd [--quick]`` writes ``results/pd.json`` (about 2 minutes;
run it under the machine's CPU lock). Every fleet has ``--engines`` engines: ``colocated`` all
``both``; ``pd P:D`` P prefill and D decode engines over a 100 Gb/s link (and the 4:4 split over
a 10 Gb/s one), KV 128 KiB per token (Mistral-7B fp16).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from bench.sim.runner import SimConfig, run_one
from bench.workloads import WorkloadOptions, build_workload
from bench.workloads.transform import scale_rate

RESULTS = Path(__file__).resolve().parent.parent / "results"


def fleets(n: int) -> dict[str, tuple[tuple[str, ...] | None, float]]:
    """Name -> (roles, link Gb/s)."""
    half, quarter = n // 2, max(n // 4, 1)

    def pd(p: int) -> tuple[str, ...]:
        return ("prefill",) * p + ("decode",) * (n - p)

    return {
        "colocated": (None, 100.0),
        f"pd {half}:{n - half}": (pd(half), 100.0),
        f"pd {quarter}:{n - quarter}": (pd(quarter), 100.0),
        f"pd {n - quarter}:{quarter}": (pd(n - quarter), 100.0),
        f"pd {half}:{n - half} @10Gb/s": (pd(half), 10.0),
    }


WORKLOADS = {
    # (options, rate scales): loads around each fleet's knee for 8 engines
    "mooncake": (WorkloadOptions(max_requests=800), (1.0, 2.0, 3.0)),
    "qwen_mix": (WorkloadOptions(rate=8.0, duration=120.0), (1.0, 2.0, 3.0)),
}


def row(workload: str, fleet: str, rate: float, result: dict) -> dict:
    s = result["summary"]
    return {
        "workload": workload,
        "fleet": fleet,
        "rate_scale": rate,
        "requests": s["requests"],
        "offered_rps": s["offered_rps"],
        "slo_attainment": s["slo_attainment"],
        "goodput_rps": s["goodput_rps"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "tpot_p99_ms": s["tpot_ms"]["p99"],
        "prefix_hit_rate": s["prefix_hit_rate"],
        "shed": s["status"].get("429", 0),
        "disaggregated": result["sim"]["disaggregated"],
        "kv_transfer_ms_mean": result["sim"]["kv_transfer_ms_mean"],
    }


def table(rows: list[dict]) -> str:
    head = (
        "| workload | fleet | rate x | SLO att. | goodput req/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | KV move ms |"
    )
    out = [head, "|" + "---|" * 10]
    for r in rows:
        kv = r["kv_transfer_ms_mean"]
        out.append(
            f"| {r['workload']} | {r['fleet']} | {r['rate_scale']:g} | "
            f"{r['slo_attainment']:.1%} | {r['goodput_rps']:.2f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | "
            f"{'-' if kv is None else f'{kv:.0f}'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer requests, one load")
    ap.add_argument("--out", type=Path, default=RESULTS / "pd.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for name, (opts, rates) in WORKLOADS.items():
        if args.quick:
            opts = WorkloadOptions(
                rate=opts.rate, duration=20.0 if opts.duration else None, max_requests=120
            )
            rates = rates[:1]
        base = build_workload(name, opts)
        for rate in rates:
            reqs = scale_rate(base, rate)
            for fleet, (roles, gbps) in fleets(args.engines).items():
                cfg = SimConfig(engines=args.engines, roles=roles, kv_link_gbps=gbps)
                result = run_one(reqs, "e2", "slo", cfg, rate_scale=rate)
                r = row(name, fleet, rate, result)
                rows.append(r)
                print(
                    f"{name:9s} {fleet:18s} x{rate:g}  att {r['slo_attainment']:.1%}  "
                    f"goodput {r['goodput_rps']:.2f}  TTFT p99 {r['ttft_p99_ms']:.0f} ms  "
                    f"TPOT p99 {r['tpot_p99_ms']:.1f} ms",
                    flush=True,
                )
    text = table(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "kind": "pd",
                "engines": args.engines,
                "policy": "e2",
                "scheduler": "slo",
                "kv_bytes_per_token": 131_072,
                "rows": rows,
                "table": text,
                "wall_s": round(time.perf_counter() - t0, 1),
                "host": platform.node(),
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
