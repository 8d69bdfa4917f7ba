"""One engine, three local schedulers, a QwenTrace-style mix at rising rates (virtual time).

    .venv/bin/python -m bench.bench_engine_sched [--requests 600] [--rates 0.25,0.5,...]

Workload (FlowPrefill's four task kinds and SLOs from ``kvgate.slo``; mix weights those of
``bench.workloads.synthetic.qwen_mix``: 55% chat, 15% image, 20% search, 10% file):

* chat and image: ``qwen_mix``'s requests (chat lengths drawn from the Azure conversation trace
  behind shared system prompts, keeping prompts <= 1024 tokens, the trace's shorter half: on
  this profile a 2K-token prompt alone takes 250 ms, the whole chat TTFT SLO, so longer ones
  could never attain it on any scheduler; image requests a ~1k-token image plus a question);
* search and file: Mooncake conversation-trace requests (real lengths and real prefix sharing
  through their hash ids), those with input <= 8K tokens as search, 8K-32K as file;
* Poisson arrivals; the same request sequence for every policy at a rate.

A request attains its SLO when it is served with TTFT <= its TTFT SLO and mean TPOT <= its TPOT
SLO (a rejected request does not). Goodput = attained requests per second of arrivals. The
figure of merit is the highest rate at which attainment stays >= 90% (linear interpolation
between measured rates), i.e. FlowPrefill's "max goodput at 90% SLO attainment".
Saves ``results/engine_sched.json``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from bench.workloads import traces
from bench.workloads.request import Request
from bench.workloads.synthetic import arrivals, qwen_mix
from engine.core import EngineCore, EngineRequest
from engine.scheduler import POLICIES
from engine.scheduler.state import SchedulerConfig
from kvgate.cost_model import default_profile
from kvgate.slo import SLO_CLASSES
from kvgate.stats import percentile

RESULT = Path("results/engine_sched.json")
WEIGHTS = {"chat": 0.55, "image": 0.15, "search": 0.2, "file": 0.1}
CHAT_MAX, SEARCH_MAX, FILE_MAX = 1024, 8192, 32768
TARGET_ATTAINMENT = 0.9


def build_mix(rate: float, n_requests: int, seed: int, pool: dict[str, list[Request]]) -> list:
    """``n_requests`` engine requests at ``rate``: kinds by WEIGHTS, prompts from the pools."""
    rng = random.Random(f"engine-sched:{seed}:{rate}")
    times = arrivals(rng, rate, n_requests / rate * 1.5)[:n_requests]
    kinds = list(WEIGHTS)
    cum, acc = [], 0.0
    for k in kinds:
        acc += WEIGHTS[k]
        cum.append(acc)
    out = []
    used = {k: 0 for k in kinds}
    for i, t in enumerate(times):
        x = rng.random() * acc
        kind = next(k for k, c in zip(kinds, cum, strict=True) if x <= c)
        src = pool[kind][used[kind] % len(pool[kind])]
        used[kind] += 1
        out.append((f"{kind}-{i}", t, src, kind))
    return out


def load_pools(seed: int, per_kind: int) -> dict[str, list[Request]]:
    qwen = qwen_mix(
        50.0,
        per_kind / 10.0,
        seed,
        chat_lengths=traces.azure_lengths(),
        weights={"chat": 0.75, "image": 0.25},
    )
    pool: dict[str, list[Request]] = {
        "chat": [r for r in qwen if r.kind == "chat" and r.input_tokens <= CHAT_MAX][:per_kind],
        "image": [r for r in qwen if r.kind == "image"][:per_kind],
    }
    mooncake = traces.load_mooncake()
    pool["search"] = [r for r in mooncake if r.input_tokens <= SEARCH_MAX][:per_kind]
    pool["file"] = [r for r in mooncake if SEARCH_MAX < r.input_tokens <= FILE_MAX][:per_kind]
    return pool


def policy_config(spec: str, base: SchedulerConfig) -> tuple[str, SchedulerConfig]:
    """``name`` or ``name:budget`` (the chunked-prefill token budget of fcfs/preble)."""
    name, _, budget = spec.partition(":")
    if name not in POLICIES:
        raise SystemExit(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return name, (replace(base, chunked_budget=int(budget)) if budget else base)


def simulate(spec: str, mix: list, keys: dict[int, bytes], profile, config) -> dict:
    """Run one engine over ``mix`` in virtual time; per-kind attainment and latencies."""
    policy, config = policy_config(spec, config)
    core = EngineCore("bench", profile, policy=policy, config=config)
    reqs = [
        EngineRequest(rid, keys[id(src)], src.input_tokens, src.output_tokens, SLO_CLASSES[kind], t)
        for rid, t, src, kind in mix
    ]
    kind_of = {rid: kind for rid, _, _, kind in mix}
    results: dict[str, tuple[float, float] | None] = {}
    i = 0
    wall = time.perf_counter()
    while True:
        nxt = core.next_event_time()
        arrival = reqs[i].arrival if i < len(reqs) else None
        if nxt is None and arrival is None:
            break
        if arrival is not None and (nxt is None or arrival <= nxt):
            core.submit(reqs[i], arrival)
            i += 1
            continue
        for out in core.advance(nxt):
            if out.usage is not None:
                results[out.request_id] = (out.usage.ttft_ms, out.usage.tpot_ms)
            elif out.rejected is not None:
                results[out.request_id] = None
        core.drain_events()
    wall = time.perf_counter() - wall
    span = reqs[-1].arrival - reqs[0].arrival if len(reqs) > 1 else 1.0
    per_kind: dict[str, dict] = {}
    ok_all = ok_ttft_all = 0
    for kind in WEIGHTS:
        rids = [rid for rid, k in kind_of.items() if k == kind]
        slo = SLO_CLASSES[kind]
        served = [results[r] for r in rids if results.get(r) is not None]
        ok = sum(1 for ttft, tpot in served if ttft <= slo.ttft_ms and tpot <= slo.tpot_ms)
        ok_ttft = sum(1 for ttft, _ in served if ttft <= slo.ttft_ms)
        ok_all += ok
        ok_ttft_all += ok_ttft
        per_kind[kind] = {
            "requests": len(rids),
            "attainment": ok / len(rids) if rids else None,
            "rejected": len(rids) - len(served),
            "ttft_p50_ms": percentile([s[0] for s in served], 0.5),
            "ttft_p99_ms": percentile([s[0] for s in served], 0.99),
            "tpot_p50_ms": percentile([s[1] for s in served], 0.5),
        }
    n = len(reqs)
    return {
        "attainment": ok_all / n,
        "ttft_attainment": ok_ttft_all / n,
        "goodput_rps": ok_all / span,
        "rejected": sum(1 for r in results.values() if r is None),
        "per_kind": per_kind,
        "wall_s": wall,
        "requests_per_wall_s": n / wall if wall > 0 else None,
    }


def max_rate_at(rates: Sequence[float], attainment: Sequence[float], target: float) -> float:
    """Highest rate with attainment >= target, interpolating across the first crossing."""
    best = 0.0
    for i, (r, a) in enumerate(zip(rates, attainment, strict=True)):
        if a >= target:
            best = r
            continue
        if i > 0 and attainment[i - 1] >= target:
            r0, a0 = rates[i - 1], attainment[i - 1]
            best = r0 + (r - r0) * (a0 - target) / (a0 - a)
        break
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per rate")
    ap.add_argument(
        "--rates", default="0.1,0.2,0.3,0.4,0.5,0.75,1,1.5,2,2.5,3,4", help="requests/s"
    )
    ap.add_argument(
        "--policies",
        default="slo,fcfs,preble,fcfs:512",
        help="comma-separated; name:N sets fcfs/preble's chunked-prefill token budget",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    policies = args.policies.split(",")
    profile = default_profile()
    config = SchedulerConfig(stream_outputs=False)
    t0 = time.perf_counter()
    pool = load_pools(args.seed, args.requests)
    keys = {id(r): r.key() for rs in pool.values() for r in rs}
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for rate in rates:
        mix = build_mix(rate, args.requests, args.seed, pool)
        for policy in policies:
            res = simulate(policy, mix, keys, profile, config)
            res["rate"] = rate
            runs[policy].append(res)
            print(
                f"rate {rate:5.2f}/s {policy:8s} attainment {res['attainment']:6.1%} "
                f"(ttft-only {res['ttft_attainment']:6.1%}) goodput {res['goodput_rps']:5.2f}/s "
                f"rejected {res['rejected']:4d}  [{res['requests_per_wall_s']:.0f} req/s wall]",
                flush=True,
            )
    summary = {}
    for policy in policies:
        att = [r["attainment"] for r in runs[policy]]
        ttft_att = [r["ttft_attainment"] for r in runs[policy]]
        summary[policy] = {
            "max_rate_at_90pct": max_rate_at(rates, att, TARGET_ATTAINMENT),
            "max_rate_at_90pct_ttft_only": max_rate_at(rates, ttft_att, TARGET_ATTAINMENT),
        }
    base = summary.get("fcfs", {}).get("max_rate_at_90pct")
    for policy in policies:
        mine = summary[policy]["max_rate_at_90pct"]
        summary[policy]["vs_fcfs"] = (mine / base) if base else None
        print(
            f"{policy:8s} max rate at >= 90% attainment: {mine:.2f}/s"
            + (f" ({mine / base:.1f}x fcfs)" if base else "")
            + f"; TTFT-only: {summary[policy]['max_rate_at_90pct_ttft_only']:.2f}/s"
        )
    out = {
        "benchmark": "engine_sched",
        "profile": profile.name,
        "scheduler_config": {
            k: getattr(config, k) for k in config.__dataclass_fields__ if k != "stream_outputs"
        },
        "mix": WEIGHTS,
        "requests_per_rate": args.requests,
        "rates": rates,
        "summary": summary,
        "runs": runs,
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(f"saved {args.out} ({out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
