"""The routing matrix: every policy over workloads x load x fleets, the judge of routing quality.

For each workload, fleet size and fleet kind (``homo``: identical engines; ``hetero``: every
second engine ``slow_factor`` times slower, announcing the same profile, so the router is not
told) the matrix first finds the *knee*: the request rate at which round robin first drops below
90% SLO attainment (90% of what it attains at light load, when that is below 100%), by a
geometric bisection on the rate. Then it runs every policy at multiples
of the knee (x0.5, x1, x1.5, x2) over the same requests (only the arrival times are compressed),
in the discrete-event simulator with the real router and engine code (:mod:`bench.sim`).

Per run it keeps SLO attainment, goodput, TTFT p50/p90/p99 (of served requests), the p99 TTFT of
all requests (:func:`bench.metrics.ttft_p99_all_ms`), TPOT p99, the prefix hit rate, the
load spread (max/mean of the engines' busy time within each speed class, :func:`load_spread`;
and of requests) and how many requests the router shed. Per cell it compares the default policy (e2)
with the best other policy on each metric; the heatmaps show those differences. The verdicts are
issue 17's: in every cell e2's attainment at least the best other's minus 1 point and its p99
TTFT at most 1.1x the best; over the matrix a geometric-mean p99 TTFT at least 20% below
cache_aware's, and at least 2x below round robin's where round robin misses 90%; load max/mean
at most 1.3 unless a hit-rate gain pays for it; attainment within 1 point across the router's
random seeds (``seeds``: the same requests, other tie-breaks and link jitter). :func:`pool`
judges each cell's mean over several documents, such as draws of the workloads.

The cell check takes the p99 of *all* requests, a refused one (shed by the router, rejected by its
engine) counted as never answered. The p99 of served requests alone rewards refusing: a policy
whose engines reject a cell's long prompts drops exactly the slowest first tokens from its p99,
while one that serves them in time shows them (in the matrix of 2026-11 most of e2's p99 misses
were of that kind). When no policy answers 99% of a cell's requests, no p99 exists there and
attainment alone judges the cell; the verdict lists those cells, and every cell whose p99 of
served requests is over 1.1x the best. The geometric means use the p99 of served requests.

Cells are sized by request count (``requests_per_engine`` x engines, clamped), so a 64-engine
cell carries its fleet as many requests per engine as a 4-engine cell does, up to the cap, and by
time: at its rate a cell's arrivals span at least ``min_window_s`` (more requests, up to
``max_window_requests``). Sized by count alone, a big fleet's cell was a burst: 1,600 programming
requests arrived in 0.6 s on 64 engines, fewer than the fleet holds at once (each decodes ~300
tokens, ~13 s), so round robin's "knee" there was the burst the fleet's batches absorb, 8x the
per-engine rate that 4 engines sustain, and a quarter of the cells (57 of 216) lasted under 10 s.
Everything is seeded: a run is a pure function of its inputs (``tests/bench``).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import orjson

from bench import read_json
from bench.metrics import RequestRecord, write_records
from bench.sim.runner import SimConfig, run_file_stem, run_one
from bench.sim.world import LinkConfig
from bench.workloads import Request, WorkloadOptions, build_workload, scale_rate, trace_format
from kvgate.cost_model import load_profile
from router.policies.registry import POLICIES

DEFAULT_WORKLOADS = (
    "mooncake",
    "azure",
    "tool_use",
    "long_doc_qa",
    "programming",
    "multi_turn_chat",
    "preble_mix",
    "qwen_mix",
    "zipf_doc_qa",
)
DEFAULT_POLICIES = tuple(POLICIES)  # every registered policy; e2 (the default) first
DEFAULT_FLEETS = (4, 16, 64)
DEFAULT_KINDS = ("homo", "hetero")
DEFAULT_RATES = (0.5, 1.0, 1.5, 2.0)
SUBJECT = "e2"
KINDS = ("homo", "hetero")
# Workloads with SLOs of their own keep them; the others get DistServe-style scaled SLOs: TTFT
# 5x the request's unloaded prefill time (at least 250 ms), TPOT 100 ms.
OWN_SLOS = {"qwen_mix"}
SCALED_SLO = "scaled:5:100"
SYNTHETIC_RATE = 4.0  # requests/s a synthetic family is generated at (the knee rescales it)
PROBE_REQUESTS = 200  # requests a workload's mean prompt length is read from
LINK_DELAY_S = LinkConfig().link_delay_s  # engine event -> router, s (the simulator's default)
LINK_JITTER_S = 0.001  # ... plus up to this, seeded by the run's seed
# what a matrix document saved before a field existed ran with, where not the field's default
LEGACY_SPEC = {"min_window_s": 0.0}
# the engines' cost profile a document without ``profile_digest`` ran on: the default profile
# with Preble's released prefill curve (until the eighteenth session), a digest no profile
# kvgate ships has now
LEGACY_PROFILE_DIGEST = "preble-released-curve"


def profile_digest(profile: str) -> str:
    """A fingerprint of what the profile named ``profile`` says (its name alone does not
    change when its curve does): round robin's knee moves with the engines' speed."""
    data = load_profile(profile).to_dict()
    data.pop("description", None)
    return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


REPORTING = ("events", "bridge")


@dataclass(frozen=True, slots=True)
class MatrixSpec:
    """What the matrix runs (picklable: worker processes rebuild workloads from it)."""

    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    fleets: tuple[int, ...] = DEFAULT_FLEETS
    kinds: tuple[str, ...] = DEFAULT_KINDS
    rates: tuple[float, ...] = DEFAULT_RATES
    # the router's and the event link's random seeds (tie-breaks, jitter): a policy whose
    # attainment moves with them is fragile; the requests stay the same (workload_seed)
    seeds: tuple[int, ...] = (0,)
    workload_seed: int = 0
    requests_per_engine: int = 40
    min_requests: int = 600
    max_requests: int = 1600
    # at its rate a cell's arrivals span at least this many seconds (more requests, up to
    # max_window_requests; 0: sized by count alone): a shorter cell measures how a fleet
    # absorbs a burst, not how it routes sustained load (see the module docstring)
    min_window_s: float = 20.0
    max_window_requests: int = 2500
    # at most this many prompt tokens a cell (the simulator's cost grows with them: a cell of
    # long-document prompts gets fewer requests)
    max_prompt_tokens: int = 12_000_000
    knee_attainment: float = 0.9  # round robin's attainment that defines the knee
    knee_tolerance: float = 0.05  # bisect until the bracket's ratio is below 1 + this
    scheduler: str = "slo"
    slow_factor: float = 2.0
    profile: str = "mistral-7b-a6000"
    # hetero: every second engine runs this profile, slowed by ``slow_factor``, and announces
    # it at its nominal speed: a fleet of two GPU generations, whose KV memory and block size
    # differ too (the router finds the slowdown online, as in the default hetero fleet; "":
    # ``profile``)
    hetero_profile: str = ""
    baseline: str = "round_robin"  # the policy whose knee defines the rates
    # run the requests the router sheds anyway (bench.sim.world.LinkConfig.run_shed): how
    # many of them would have missed their SLO (the SLO filter's precision)
    run_shed: bool = False
    # what the engines report: "events" (kvgate's engine: request events, step timings) or
    # "bridge" (a plain vLLM behind the bridge: KV events and heartbeats only, the gateway
    # reporting each answer's first token; bench.sim.world.LinkConfig.request_events)
    reporting: str = "events"
    # every request states this max_tokens (0: exactly its answer's length; see
    # bench.workloads.transform.stating_max_tokens): clients that overstate their answers
    stated_max_tokens: int = 0
    # engine events reach the router this long after they happen (s; bench.sim.world.LinkConfig:
    # a reporter's flush and an XREAD take a few ms), plus a uniform jitter per batch seeded by
    # the run's seed: a slow broker's stale view (round robin reads none, so its knee holds)
    link_delay_s: float = LINK_DELAY_S
    link_jitter_s: float = LINK_JITTER_S

    def __post_init__(self) -> None:
        if self.stated_max_tokens < 0:
            raise ValueError("stated_max_tokens must be >= 0")
        if not (self.link_delay_s >= 0.0 and self.link_jitter_s >= 0.0):
            raise ValueError("link_delay_s and link_jitter_s must be >= 0")
        if self.reporting not in REPORTING:
            raise ValueError(f"reporting {self.reporting!r}: one of {', '.join(REPORTING)}")
        for kind in self.kinds:
            if kind not in KINDS:
                raise ValueError(f"fleet kind {kind!r}: one of {', '.join(KINDS)}")
        if self.baseline not in POLICIES and not self.baseline.startswith(tuple(POLICIES)):
            raise ValueError(f"baseline {self.baseline!r} is not a policy")
        if not self.policies or not self.fleets or not self.rates or not self.seeds:
            raise ValueError("policies, fleets, rates and seeds must not be empty")
        if min(self.fleets) < 1 or self.min_requests < 1 or self.max_requests < self.min_requests:
            raise ValueError("fleets and request bounds must be positive and ordered")
        if self.min_window_s < 0 or self.max_window_requests < 1:
            raise ValueError("min_window_s must be >= 0 and max_window_requests positive")

    def requests_for(self, fleet: int, mean_input_tokens: float = 0.0, rps: float = 0.0) -> int:
        """Requests in a cell of ``fleet`` engines, for prompts of this mean length, arriving at
        ``rps`` (0: unknown): enough for ``min_window_s`` of arrivals, within the caps (the
        prompt-token cap bounds the simulator's work, and wins)."""
        n = max(self.min_requests, min(self.max_requests, self.requests_per_engine * fleet))
        n = max(n, min(self.max_window_requests, math.ceil(rps * self.min_window_s)))
        if mean_input_tokens > 0:
            n = min(n, max(int(self.max_prompt_tokens / mean_input_tokens), 100))
        return n

    def sim_config(self, fleet: int, kind: str, seed: int) -> SimConfig:
        return SimConfig(
            engines=fleet,
            profile=self.profile,
            # events reach the router 2-3 ms after they happen, jittered by the seed
            link=LinkConfig(
                link_delay_s=self.link_delay_s,
                link_jitter_s=self.link_jitter_s,
                seed=seed,
                run_shed=self.run_shed,
                request_events=self.reporting == "events",
            ),
            seed=seed,
            slow_factor=self.slow_factor if kind == "hetero" else 1.0,
            profiles=(
                tuple(self.hetero_profile if i % 2 else self.profile for i in range(fleet))
                if kind == "hetero" and self.hetero_profile
                else None
            ),
        )

    def combos(self) -> list[tuple[str, int, str]]:
        """(workload, fleet, kind), biggest fleets first (they take longest: start them early)."""
        return [
            (w, f, k)
            for f in sorted(self.fleets, reverse=True)
            for w in self.workloads
            for k in self.kinds
        ]


QUICK = MatrixSpec(
    workloads=("mooncake", "tool_use", "qwen_mix", "zipf_doc_qa"),
    fleets=(4, 16),
    rates=(1.0, 2.0),
    min_requests=400,
    max_requests=800,
)


# ---------------------------------------------------------------------- workloads


@cache
def base_workload(
    workload: str, seed: int, n: int, profile: str, stated_max_tokens: int = 0
) -> tuple[Request, ...]:
    """The first ``n`` requests of ``workload`` at its own rate, with the matrix's SLOs (cached
    per process: every cell of a combo compresses the same requests)."""
    slo = None if workload in OWN_SLOS else SCALED_SLO
    trace = trace_format(workload) is not None
    opts = WorkloadOptions(
        seed=seed,
        rate=SYNTHETIC_RATE,
        # synthetic families: long enough for n requests (multi-turn sessions end early)
        duration=None if trace else 1.5 * n / SYNTHETIC_RATE + 30.0,
        max_requests=n,
        slo=slo,
        spread=1.0 if trace else 0.0,  # one-second trace timestamps: no artificial bursts
        stated_max_tokens=stated_max_tokens,
    )
    reqs = build_workload(workload, opts, profile=load_profile(profile))
    if len(reqs) < n:
        raise ValueError(f"{workload}: only {len(reqs)} requests, the cell needs {n}")
    return tuple(reqs)


@cache
def cell_requests(spec: MatrixSpec, workload: str, fleet: int, scale: float = 0.0) -> int:
    """How many requests a cell of ``workload`` on ``fleet`` engines at rate ``scale`` (x the
    workload's own rate; 0: sized by count alone) has (see :meth:`MatrixSpec.requests_for`; the
    mean prompt and the rate from the workload's first requests)."""
    probe = base_workload(workload, spec.workload_seed, PROBE_REQUESTS, spec.profile)
    mean = sum(r.input_tokens for r in probe) / len(probe)
    return spec.requests_for(fleet, mean, base_rate(probe) * scale)


def base_rate(requests: Sequence[Request]) -> float:
    """Requests per second of a workload as generated (before compression)."""
    span = requests[-1].arrival - requests[0].arrival
    return (len(requests) - 1) / span if span > 0 else float(len(requests))


def capacity_guess(spec: MatrixSpec, requests: Sequence[Request], fleet: int) -> float:
    """A first rate-scale guess for the knee: the fleet's prefill capacity if nothing were
    cached, at 60% (decode shares the GPU). Only the bisection's starting point."""
    prof = load_profile(spec.profile)
    mean_ms = sum(prof.prefill_ms(r.input_tokens) for r in requests) / len(requests)
    rps = 0.6 * fleet * 1000.0 / max(mean_ms, 1e-3)
    return rps / base_rate(requests)


# ---------------------------------------------------------------------- one run


def compact(result: dict, *, seed: int, scale: float, rps: float, slow: Sequence[int]) -> dict:
    """The figures the matrix keeps of one simulator run (see :func:`bench.sim.runner.run_one`)."""
    s = result["summary"]
    busy = list(s.get("busy_s", {}).values())
    per_engine = list(s.get("per_engine_requests", {}).values())
    return {
        "policy": result["policy"],
        "seed": seed,
        "scale": scale,
        "rps": round(rps, 4),
        "requests": s["requests"],
        "attainment": s.get("slo_attainment", 0.0),
        "goodput_rps": s.get("goodput_rps"),
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p90_ms": s["ttft_ms"]["p90"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "ttft_p99_all_ms": s.get("ttft_p99_all_ms"),
        "tpot_p99_ms": s["tpot_ms"]["p99"],
        "hit_rate": s.get("prefix_hit_rate") or 0.0,
        "load_max_mean": load_spread(busy, slow),
        "requests_max_mean": (
            round(max(per_engine) / (sum(per_engine) / len(per_engine)), 4)
            if per_engine and sum(per_engine)
            else None
        ),
        "slow_engine_share": (
            round(sum(per_engine[i] for i in slow) / sum(per_engine), 4)
            if slow and per_engine and sum(per_engine)
            else None
        ),
        "shed_router": result["sim"]["shed_by_router"],
        "shed_runs": s.get("shed_runs"),
        "rejected": s.get("status", {}).get("429", 0) - result["sim"]["shed_by_router"],
        "reasons": s.get("reasons", {}),
        "wall_s": result["sim"]["wall_s"],
    }


def load_spread(busy: Sequence[float], slow: Sequence[int]) -> float | None:
    """Load max/mean: the engines' busy time (GPU time in steps: fair to cached requests, which
    cost little, and to slow engines, which take longer for the same work), the worst ratio
    within each speed class (a fleet of two speeds is balanced when equals are: idling a slow
    engine that would only add latency is not imbalance)."""
    slow_set = set(slow)
    worst: float | None = None
    for cls in (
        [b for i, b in enumerate(busy) if i not in slow_set],
        [b for i, b in enumerate(busy) if i in slow_set],
    ):
        mean = sum(cls) / len(cls) if cls else 0.0
        if mean > 0:
            ratio = max(cls) / mean
            worst = ratio if worst is None else max(worst, ratio)
    return round(worst, 4) if worst is not None else None


def run_cell_policy(
    spec: MatrixSpec,
    workload: str,
    fleet: int,
    kind: str,
    policy: str,
    scale: float,
    seed: int,
    records: Path | None = None,
) -> dict:
    """One policy on one cell: the compact figures (``records``: every request's record
    written there too, one JSON line each, the router's predicted TTFT included)."""
    n = cell_requests(spec, workload, fleet, scale)
    base = base_workload(workload, spec.workload_seed, n, spec.profile, spec.stated_max_tokens)
    reqs = scale_rate(base, scale)
    cfg = spec.sim_config(fleet, kind, seed)
    recs: list[RequestRecord] = []
    result = run_one(
        reqs,
        policy,
        spec.scheduler,
        cfg,
        rate_scale=scale,
        records=recs if records is not None else None,
        predictions=records is not None,
    )
    if records is not None:
        write_records(records, recs)
    slow = range(1, fleet, 2) if kind == "hetero" else ()
    return compact(result, seed=seed, scale=scale, rps=base_rate(base) * scale, slow=list(slow))


class NoKnee(RuntimeError):
    """The baseline's attainment crosses the knee at no rate the search tries: the combo has no
    cells (the matrix skips it and says why)."""


def calibrate(spec: MatrixSpec, workload: str, fleet: int, kind: str) -> dict:
    """The knee: the smallest rate scale (within ``knee_tolerance``) at which the baseline's
    attainment is below ``knee_attainment`` x its attainment at light load (1/8 of a capacity
    guess; read only when the search falls below a quarter of the guess). The light-load
    factor is 1 unless some requests cannot meet their SLO on some engines even alone (a
    heterogeneous fleet whose slow engines cannot decode a long context within its TPOT):
    then the knee is where load costs another 10%, not a rate near zero. Found by doubling or
    halving from the capacity guess, then bisecting geometrically.
    Returns the probes and the baseline's run at the knee (reused as its x1 cell)."""
    seed = spec.seeds[0]
    # (each probe has as many requests as a cell at its rate: run_cell_policy)
    base = base_workload(
        workload, spec.workload_seed, cell_requests(spec, workload, fleet), spec.profile
    )
    probes: dict[float, dict] = {}

    def attainment(scale: float) -> float:
        scale = float(f"{scale:.6g}")
        if scale not in probes:
            probes[scale] = run_cell_policy(spec, workload, fleet, kind, spec.baseline, scale, seed)
        return probes[scale]["attainment"]

    guess = float(f"{capacity_guess(spec, base, fleet):.6g}")

    def knee(target: float, floor: float) -> tuple[float, float] | None:
        """(lo, hi) within the tolerance around ``target``; None when the baseline misses
        ``target`` at every rate down to ``floor``."""
        s = guess
        lo = hi = None
        for _ in range(16):  # bracket (bounded)
            if attainment(s) >= target:
                lo = s
                if hi is not None:
                    break
                s *= 2.0
            else:
                hi = s
                if lo is not None:
                    break
                if s / 2.0 < floor:
                    return None
                s /= 2.0
            s = float(f"{s:.6g}")
        if hi is None:
            raise NoKnee(
                f"{workload}/{fleet}/{kind}: {spec.baseline} stays at or above "
                f"{100 * target:.0f}% SLO attainment up to x{s:g} of the workload's rate: its "
                "load does not grow with the rate (closed-loop sessions, such as chat_sessions', "
                "or cells too small to load the fleet; run it with kvgate bench sim instead)"
            )
        if lo is None:
            raise NoKnee(
                f"{workload}/{fleet}/{kind}: {spec.baseline} stays below {100 * target:.0f}% "
                f"SLO attainment down to x{s:g} of the workload's rate"
            )
        while hi / lo > 1.0 + spec.knee_tolerance:
            mid = float(f"{math.sqrt(lo * hi):.6g}")
            if mid in (lo, hi):
                break
            if attainment(mid) >= target:
                lo = mid
            else:
                hi = mid
        return lo, hi

    light = 1.0
    target = spec.knee_attainment
    found = knee(target, guess / 4)
    if found is None:  # even a quarter of the capacity guess misses it: what does light load get?
        light = attainment(guess / 8)
        target = spec.knee_attainment * light
        found = knee(target, 0.0)
    assert found is not None
    hi = found[1]
    rps = probes[hi]["rps"]
    return {
        "scale": hi,
        "rps": rps,
        "rps_per_engine": round(rps / fleet, 4),
        "requests": cell_requests(spec, workload, fleet, hi),
        "light_attainment": light,
        "target_attainment": round(target, 4),
        "probes": [{"scale": k, "attainment": v["attainment"]} for k, v in sorted(probes.items())],
        "baseline_run": probes[hi],
    }


# ---------------------------------------------------------------------- the matrix


def _worker_calibrate(spec: MatrixSpec, combo: tuple[str, int, str]) -> dict:
    return calibrate(spec, *combo)


def _worker_run(
    spec: MatrixSpec,
    combo: tuple[str, int, str],
    policy: str,
    scale: float,
    seed: int,
    records: Path | None = None,
) -> dict:
    return run_cell_policy(spec, *combo, policy, scale, seed, records)


def records_path(
    records_dir: Path, combo: tuple[str, int, str], rate: float, policy: str, seed: int
) -> Path:
    """Where ``--records`` writes one run's requests: ``WORKLOAD-FLEET-KIND-xRATE-POLICY-sSEED
    .jsonl`` (a trace file's workload by its stem)."""
    workload, fleet, kind = combo
    name = f"{Path(workload).stem}-{fleet}-{kind}-x{rate:g}-{run_file_stem(policy)}-s{seed}"
    return records_dir / f"{name}.jsonl"


class _Inline:
    """A stand-in for the process pool when ``jobs == 1`` (runs each task when submitted)."""

    def submit(self, fn: Callable, *args: object) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # a failed task fails its future, as in a pool
            fut.set_exception(exc)
        return fut

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def load_knees(path: Path, spec: MatrixSpec | None = None) -> dict[tuple[str, int, str], dict]:
    """The knees of an earlier matrix document, by (workload, fleet, kind): a rerun of changed
    policies can skip calibration (round robin's knee does not depend on them). With ``spec``,
    only from a document on the same engines (scheduler, profile and what it says, slowness)
    whose cells spanned as long (``min_window_s``: round robin's knee moves with it). From a
    document drawn with another ``workload_seed`` the knees are taken as rates (the same
    workload's other draws load a fleet alike) without their baseline run, which was of other
    requests."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("kind") != "kvgate-matrix":
        raise ValueError(f"{path}: not a kvgate-matrix document")
    if spec is not None:
        theirs = doc.get("spec") or {}
        default = MatrixSpec()  # (what an older file that lacks a field ran on)
        for name in ("scheduler", "profile", "slow_factor", "min_window_s", "hetero_profile"):
            had = theirs.get(name, LEGACY_SPEC.get(name, getattr(default, name)))
            if had != getattr(spec, name):
                raise ValueError(
                    f"{path}: its knees are for {name} {had!r}, not {getattr(spec, name)!r}"
                )
        digest = doc.get("profile_digest", LEGACY_PROFILE_DIGEST)
        if digest != profile_digest(spec.profile):
            raise ValueError(
                f"{path}: its knees are for another version of profile {spec.profile!r} "
                f"(profile_digest {digest!r}; the profile's curve changed since)"
            )
    knees = {(e["workload"], e["fleet"], e["kind"]): e["knee"] for e in doc["combos"]}
    if spec is not None and (doc.get("spec") or {}).get("workload_seed", 0) != spec.workload_seed:
        knees = {
            combo: {k: v for k, v in knee.items() if k != "baseline_run"}
            for combo, knee in knees.items()
        }
    return knees


def run_matrix(
    spec: MatrixSpec,
    *,
    jobs: int = 1,
    out: Path | None = None,
    knees: dict[tuple[str, int, str], dict] | None = None,
    records_dir: Path | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict:
    """Calibrate every combo (or take its knee from ``knees``), run every cell, print progress
    and a table per combo, save the document to ``out`` after every combo (a crash keeps what
    finished). ``records_dir``: every run's requests written there (:func:`records_path`), the
    knee's round-robin run at x1 run again for its records."""
    t0 = time.perf_counter()
    combos = spec.combos()
    doc: dict = {
        "kind": "kvgate-matrix",
        "spec": asdict(spec),
        "profile_digest": profile_digest(spec.profile),
        "combos": [],
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    per_combo = len(spec.rates) * len(spec.policies) * len(spec.seeds)
    total = len(combos) * per_combo
    done = 0
    state: dict[tuple[str, int, str], dict] = {}
    pool_cm = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else _Inline()
    with pool_cm as pool:
        pending: dict[Future, tuple] = {}
        for combo in combos:
            known = (knees or {}).get(combo)
            if known is not None and known["requests"] == cell_requests(
                spec, *combo[:2], known["scale"]
            ):
                fut: Future = Future()
                fut.set_result(known)
                pending[fut] = ("calibrate", combo)
            else:
                pending[pool.submit(_worker_calibrate, spec, combo)] = ("calibrate", combo)
        while pending:
            finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in finished:
                task = pending.pop(fut)
                combo = task[1]
                if task[0] == "calibrate":
                    try:
                        knee = fut.result()
                    except NoKnee as exc:
                        total -= per_combo
                        doc.setdefault("skipped", []).append(
                            {"combo": _name(combo), "why": str(exc)}
                        )
                        log(f"matrix: skipped {exc}")
                        continue
                    st = state[combo] = {"knee": knee, "runs": {}, "left": per_combo}
                    log(
                        f"matrix: knee {_name(combo)}: x{knee['scale']:g} = "
                        f"{knee['rps']:.3g} req/s ({knee['rps_per_engine']:.3g} per engine), "
                        f"{len(knee['probes'])} probes"
                    )
                    for rate in spec.rates:
                        for seed in spec.seeds:
                            for policy in spec.policies:
                                scale = float(f"{knee['scale'] * rate:.6g}")
                                key = (rate, seed, policy)
                                if (
                                    policy == spec.baseline
                                    and records_dir is None
                                    and rate == 1.0
                                    and seed == spec.seeds[0]
                                    # a knee from an older file lacks the newest figure, and
                                    # one from other requests (workload_seed) has none: rerun
                                    and "ttft_p99_all_ms" in knee.get("baseline_run", {})
                                ):
                                    st["runs"][key] = knee["baseline_run"]
                                    st["left"] -= 1
                                    done += 1
                                    continue
                                recs = (
                                    records_path(records_dir, combo, rate, policy, seed)
                                    if records_dir is not None
                                    else None
                                )
                                args = (spec, combo, policy, scale, seed, recs)
                                pending[pool.submit(_worker_run, *args)] = ("run", combo, key)
                else:
                    st = state[combo]
                    st["runs"][task[2]] = fut.result()
                    st["left"] -= 1
                    done += 1
                    r = st["runs"][task[2]]
                    log(
                        f"matrix [{done}/{total}] {_name(combo)} x{task[2][0]:g} "
                        f"seed {task[2][1]} {task[2][2]:<16} SLO {100 * r['attainment']:5.1f}% "
                        f"p99 {(r['ttft_p99_ms'] or 0) / 1000:7.2f} s hit "
                        f"{100 * r['hit_rate']:5.1f}% ({r['wall_s']:.1f} s)"
                    )
                if state.get(combo, {}).get("left") == 0:
                    entry = _combo_entry(spec, combo, state.pop(combo))
                    doc["combos"].append(entry)
                    log(format_combo(spec, entry))
                    doc["verdict"] = verdict(doc["combos"])
                    doc["wall_s"] = round(time.perf_counter() - t0, 1)
                    if out is not None:
                        save(doc, out)
    doc["combos"].sort(key=lambda e: (e["workload"], e["fleet"], e["kind"]))
    doc["verdict"] = verdict(doc["combos"])
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    if out is not None:
        save(doc, out)
    return doc


def _name(combo: tuple[str, int, str]) -> str:
    w, f, k = combo
    return f"{w}/{f}/{k}"


def _combo_entry(spec: MatrixSpec, combo: tuple[str, int, str], st: dict) -> dict:
    workload, fleet, kind = combo
    cells = []
    for rate in spec.rates:
        runs = [st["runs"][(rate, seed, policy)] for seed in spec.seeds for policy in spec.policies]
        cells.append({"rate": rate, "scale": runs[0]["scale"], "runs": runs})
    return {"workload": workload, "fleet": fleet, "kind": kind, "knee": st["knee"], "cells": cells}


def save(doc: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    tmp.replace(out)


# ---------------------------------------------------------------------- pooling

# a pooled run's figures: averaged (a mean over the documents), summed, or kept from the first
_MEANS = ("attainment", "goodput_rps", "hit_rate", "load_max_mean", "requests_max_mean",
          "slow_engine_share")  # fmt: skip
_LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_p99_all_ms", "tpot_p99_ms")
_SUMS = ("requests", "shed_router", "rejected", "wall_s")


def _pooled_run(runs: Sequence[dict]) -> dict:
    """One policy's runs of one cell in several documents as one run: attainment, hit rate and
    spreads averaged; a latency percentile averaged where every run has one, else none (a
    run with no p99 of all requests left over 1% unanswered, and so does the pool); counts
    summed."""
    out = dict(runs[0])
    for names, digits in ((_MEANS, 6), (_LATENCIES, 3)):
        for name in names:
            vals = [r.get(name) for r in runs]
            out[name] = round(sum(vals) / len(vals), digits) if None not in vals else None
    for name in _SUMS:
        out[name] = round(sum(r.get(name) or 0 for r in runs), 3)
    reasons: Counter[str] = Counter()
    for r in runs:
        reasons.update(r.get("reasons") or {})
    out["reasons"] = dict(reasons)
    out["shed_runs"] = None
    return out


def pool(docs: Sequence[dict]) -> dict:
    """Several matrix documents of the same cells as one, each cell's runs of a policy (and
    seed) averaged over them, and judged again (:func:`verdict`). A cell's attainment on one
    draw of its requests is a sample: 600 requests at 64% attainment carry a binomial standard
    error of about 2 points, twice the every-cell check's margin. Over draws of the synthetic
    workloads (``--workload-seed``; the traces are the same requests in every draw) the check
    judges each policy's expected attainment there. Only the cells, policies and seeds every
    document holds are kept."""
    if not docs:
        raise ValueError("nothing to pool")
    for d in docs:
        if not isinstance(d, dict) or d.get("kind") != "kvgate-matrix":
            raise ValueError("not a kvgate-matrix document")
        if not isinstance(d.get("combos"), list) or not isinstance(d.get("spec"), dict):
            raise ValueError("a kvgate-matrix document without its spec or combos")

    def cells_of(d: dict) -> dict[tuple, dict[tuple, dict]]:
        out: dict[tuple, dict[tuple, dict]] = {}
        for e in d["combos"]:
            for c in e["cells"]:
                runs = {(r["policy"], r["seed"]): r for r in c["runs"]}
                out[(e["workload"], e["fleet"], e["kind"], c["rate"])] = runs
        return out

    each = [cells_of(d) for d in docs]
    combos: list[dict] = []
    for entry in docs[0]["combos"]:
        cells = []
        for cell in entry["cells"]:
            name = (entry["workload"], entry["fleet"], entry["kind"], cell["rate"])
            if not all(name in c for c in each):
                continue
            runs = [
                _pooled_run([c[name][key] for c in each])
                for key in each[0][name]
                if all(key in c[name] for c in each)
            ]
            cells.append({"rate": cell["rate"], "scale": cell["scale"], "runs": runs})
        if cells:
            combos.append({**entry, "cells": cells})
    spec = dict(docs[0]["spec"])
    spec["workload_seed"] = [d["spec"].get("workload_seed", 0) for d in docs]
    return {
        "kind": "kvgate-matrix",
        "pooled": len(docs),
        "spec": spec,
        "profile_digest": docs[0].get("profile_digest"),
        "combos": combos,
        "verdict": verdict(combos),
        "wall_s": round(sum(d.get("wall_s") or 0 for d in docs), 1),
    }


# ---------------------------------------------------------------------- judging


def _by_policy(cell: dict, seed: int | None = None) -> dict[str, dict]:
    """The cell's runs of one seed (the first by default) by policy."""
    runs = cell["runs"]
    if seed is None:
        seed = runs[0]["seed"]
    return {r["policy"]: r for r in runs if r["seed"] == seed}


def _p99(run: dict) -> float:
    """p99 TTFT of served requests in ms; a run that served nothing counts as infinitely slow."""
    v = run.get("ttft_p99_ms")
    return float(v) if v is not None else math.inf


def _p99_all(run: dict) -> float:
    """p99 TTFT of all requests in ms; infinite when more than 1% got no first token (runs saved
    before the figure existed: the p99 of served requests)."""
    if "ttft_p99_all_ms" not in run:
        return _p99(run)
    v = run["ttft_p99_all_ms"]
    return float(v) if v is not None else math.inf


def _ratio(mine: float, best: float) -> float | None:
    """``mine / best`` rounded, None unless both are finite and ``best`` positive."""
    if not (math.isfinite(mine) and math.isfinite(best)) or best <= 0:
        return None
    return round(mine / best, 4)


def compare(cell: dict, subject: str = SUBJECT) -> dict | None:
    """The subject against the best other policy in one cell (None: the subject did not run).
    ``attainment`` and ``hit_rate`` as differences (points of 1), TTFT as ratios."""
    runs = _by_policy(cell)
    me = runs.get(subject)
    others = [r for p, r in runs.items() if p != subject]
    if me is None or not others:
        return None
    best_att = max(r["attainment"] for r in others)
    best_p99 = min(_p99(r) for r in others)
    best_p99_all = min(_p99_all(r) for r in others)
    mine_all = _p99_all(me)
    best_p50 = min((r["ttft_p50_ms"] or math.inf) for r in others)
    best_hit = max(r["hit_rate"] for r in others)
    return {
        "attainment": round(me["attainment"] - best_att, 4),
        "ttft_p99_ratio": _ratio(_p99(me), best_p99),
        "ttft_p99_all_ratio": _ratio(mine_all, best_p99_all),
        # at most 1.1x the best; both infinite (no policy answers 99% of requests) passes
        "ttft_p99_all_ok": mine_all <= 1.1 * best_p99_all,
        "ttft_p99_all_exists": math.isfinite(best_p99_all) or math.isfinite(mine_all),
        "ttft_p50_ratio": (
            _ratio(me["ttft_p50_ms"], best_p50) if me["ttft_p50_ms"] is not None else None
        ),
        "hit_rate": round(me["hit_rate"] - best_hit, 4),
        "load_max_mean": me["load_max_mean"],
        "best_attainment_by": max(others, key=lambda r: r["attainment"])["policy"],
        "best_p99_by": min(others, key=_p99)["policy"],
        "best_p99_all_by": min(others, key=_p99_all)["policy"],
    }


def _geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _p99_all_text(cmp: dict, mine: float) -> str:
    if not cmp["ttft_p99_all_exists"]:
        return "none for any policy"
    if cmp["ttft_p99_all_ratio"] is not None:
        return f"x{cmp['ttft_p99_all_ratio']} vs {cmp['best_p99_all_by']}"
    if math.isinf(mine):
        return f"none (over 1% unanswered) vs {cmp['best_p99_all_by']}'s"
    return "e2's only (the others: over 1% unanswered)"


def verdict(combos: Sequence[dict], subject: str = SUBJECT) -> dict:
    """Issue 17's checks over what has run so far."""
    cell_fail: list[str] = []
    served_over: list[str] = []
    no_p99: list[str] = []
    spread_fail: list[str] = []
    spread_served: list[str] = []
    over_13: list[str] = []
    seeded = 0
    seed_fail: list[str] = []
    ratios_ca: list[float] = []
    ratios_rr: list[float] = []
    # the same comparisons on the p99 of all requests: (subject's, other's) in each cell
    all_ca: list[tuple[float, float]] = []
    all_rr: list[tuple[float, float]] = []
    n_cells = 0
    for entry in combos:
        for cell in entry["cells"]:
            name = f"{entry['workload']}/{entry['fleet']}/{entry['kind']}/x{cell['rate']:g}"
            # (the subject's spread over router seeds needs no other policy in the cell)
            seeds = sorted({r["seed"] for r in cell["runs"] if r["policy"] == subject})
            if len(seeds) > 1:
                seeded += 1
                atts = [_by_policy(cell, s)[subject]["attainment"] for s in seeds]
                if max(atts) - min(atts) > 0.01:
                    seed_fail.append(f"{name}: attainment {min(atts):.3f}..{max(atts):.3f}")
            cmp = compare(cell, subject)
            if cmp is None:
                continue
            n_cells += 1
            runs = _by_policy(cell)
            me = runs[subject]
            ok_att = cmp["attainment"] >= -0.01
            ok_p99 = cmp["ttft_p99_all_ok"]
            served = cmp["ttft_p99_ratio"]
            if served is None or served > 1.1:
                served_over.append(
                    f"{name}: p99 of served x{served} vs {cmp['best_p99_by']}, attainment "
                    f"{100 * cmp['attainment']:+.1f} pt"
                )
            if not cmp["ttft_p99_all_exists"]:
                no_p99.append(name)
            if not (ok_att and ok_p99):
                cell_fail.append(
                    f"{name}: attainment {100 * cmp['attainment']:+.1f} pt vs "
                    f"{cmp['best_attainment_by']}, p99 of all requests "
                    f"{_p99_all_text(cmp, _p99_all(me))}"
                )
            if "cache_aware" in runs:
                ratios_ca.append(_p99(me) / _p99(runs["cache_aware"]))
                all_ca.append((_p99_all(me), _p99_all(runs["cache_aware"])))
            rr = runs.get("round_robin")
            if rr is not None and rr["attainment"] < 0.9:
                ratios_rr.append(_p99(rr) / _p99(me))
                all_rr.append((_p99_all(me), _p99_all(rr)))
            # the spread a cell's requests make on their own: round robin sends every engine
            # the same count, so its busy-time spread is the sizes' sampling noise (1.5-2 for
            # heavy-tailed prompts at 40 requests an engine); e2 is held to 1.3 or that floor
            lmm = me["load_max_mean"]
            floor = max(1.3, (rr or {}).get("load_max_mean") or 0.0)
            if lmm is not None and lmm > 1.3:
                over_13.append(name)
            # the spread is paid for when it buys hits that beat the balanced baseline: a
            # higher hit rate than round robin's with at least its attainment and at most its p99
            # of all requests (the every-cell check's figure, for its reason: round robin's
            # engines refuse the slowest first tokens, so the p99 of what they serve is low;
            # both infinite: judged on hits and attainment)
            hits_better = rr is not None and (
                me["hit_rate"] > rr["hit_rate"] + 0.01 and me["attainment"] >= rr["attainment"]
            )
            if lmm is not None and lmm > floor:
                if not (hits_better and _p99_all(me) <= _p99_all(rr)):
                    spread_fail.append(f"{name}: load max/mean {lmm:.2f} (round robin {floor:.2f})")
                if not (hits_better and _p99(me) <= _p99(rr)):
                    spread_served.append(name)
    gm_ca = _geomean(ratios_ca)
    gm_rr = _geomean(ratios_rr)
    return {
        "subject": subject,
        "cells": n_cells,
        "cells_failed": cell_fail,
        # cells where no policy answered 99% of requests: judged on attainment alone
        "cells_without_p99": no_p99,
        # the old rule, for the record: p99 of served requests over 1.1x the best other's
        "cells_p99_of_served_over_1_1x": served_over,
        "geomean_p99_vs_cache_aware": round(gm_ca, 4) if gm_ca is not None else None,
        "geomean_p99_gain_vs_round_robin_below_90": round(gm_rr, 4) if gm_rr is not None else None,
        "round_robin_below_90_cells": len(ratios_rr),
        # the geomeans above compare the p99 of served requests, which a policy whose engines
        # refuse its slowest first tokens keeps low; on the p99 of all requests (infinite where
        # over 1% got no first token) the comparison is a tally
        "p99_all_vs_cache_aware": _tally(all_ca),
        "p99_all_vs_round_robin_below_90": _tally(all_rr),
        "load_spread_failed": spread_fail,
        "load_over_1_3": over_13,  # before the floor and the hit-rate excuse
        # the rule until the twentieth session, for the record: hits paid only with a p99 of
        # served requests at most round robin's
        "load_spread_failed_by_served_p99": spread_served,
        "seed_spread_failed": seed_fail,
        "seeded_cells": seeded,
        "passed": {
            "every_cell": not cell_fail,
            "geomean_vs_cache_aware": gm_ca is not None and gm_ca <= 0.8,
            "geomean_vs_round_robin": gm_rr is None or gm_rr >= 2.0,
            "load_spread": not spread_fail,
            "seeds": not seed_fail,
        },
    }


def _tally(pairs: Sequence[tuple[float, float]]) -> dict:
    """Cells by which of (subject, other) has a p99 of all requests (answered 99%): only the
    subject, only the other, both (with the geometric mean of other / subject there: > 1, the
    subject's is lower), neither."""
    both = [other / mine for mine, other in pairs if math.isfinite(mine) and math.isfinite(other)]
    gm = _geomean(both)
    return {
        "subject_only": sum(1 for m, o in pairs if math.isfinite(m) and not math.isfinite(o)),
        "other_only": sum(1 for m, o in pairs if not math.isfinite(m) and math.isfinite(o)),
        "both": len(both),
        "both_geomean_gain": round(gm, 4) if gm is not None else None,
        "neither": sum(1 for m, o in pairs if not (math.isfinite(m) or math.isfinite(o))),
    }


def _tally_text(t: dict | None, subject: str, other: str) -> str:
    if not t:
        return "not recorded"
    gain = f", gain {t['both_geomean_gain']}" if t["both_geomean_gain"] is not None else ""
    return (
        f"only {subject} answers 99% in {t['subject_only']} cells, only {other} in "
        f"{t['other_only']}, both in {t['both']}{gain}, neither in {t['neither']}"
    )


# ---------------------------------------------------------------------- output


def _seconds(ms: float) -> str:
    return f"{ms / 1000:.2f}" if math.isfinite(ms) else "-"


def format_combo(spec: MatrixSpec, entry: dict) -> str:
    """One combo as a text table: a row per (rate, policy)."""
    knee = entry["knee"]
    lines = [
        f"== {entry['workload']} / {entry['fleet']} engines / {entry['kind']}: knee "
        f"{knee['rps']:.3g} req/s ({knee['requests']} requests a cell)",
        f"{'rate':>5} {'policy':<18} {'SLO%':>6} {'p50 s':>7} {'p99 s':>7} {'p99all':>7} "
        f"{'hit%':>6} {'load':>5} {'shed':>5}",
    ]
    for cell in entry["cells"]:
        for r in sorted(_by_policy(cell).values(), key=lambda r: -r["attainment"]):
            lines.append(
                f"x{cell['rate']:<4g} {r['policy']:<18} {100 * r['attainment']:6.1f} "
                f"{(r['ttft_p50_ms'] or 0) / 1000:7.2f} {(r['ttft_p99_ms'] or 0) / 1000:7.2f} "
                f"{_seconds(_p99_all(r)):>7} {100 * r['hit_rate']:6.1f} "
                f"{r['load_max_mean'] or 0:5.2f} "
                f"{r['shed_router'] + r['rejected']:5d}"
            )
    return "\n".join(lines)


def format_verdict(v: dict) -> str:
    p = v["passed"]
    lines = [
        f"verdict for {v['subject']} over {v['cells']} cells:",
        f"  every cell (attainment >= best - 1 pt, p99 of all requests <= 1.1x best): "
        f"{'PASS' if p['every_cell'] else 'FAIL'} ({len(v['cells_failed'])} failed; "
        f"{len(v.get('cells_without_p99', []))} cells where no policy answers 99%; "
        f"{len(v.get('cells_p99_of_served_over_1_1x', []))} with a p99 of served requests over "
        f"1.1x the best)",
        f"  geomean p99 vs cache_aware: {v['geomean_p99_vs_cache_aware']} (<= 0.8: "
        f"{'PASS' if p['geomean_vs_cache_aware'] else 'FAIL'})",
        f"  geomean p99 gain vs round_robin where it is below 90% "
        f"({v['round_robin_below_90_cells']} cells): "
        f"{v['geomean_p99_gain_vs_round_robin_below_90']} (>= 2: "
        f"{'PASS' if p['geomean_vs_round_robin'] else 'FAIL'})",
        "  p99 of all requests (over 1% unanswered: none) vs cache_aware: "
        + _tally_text(v.get("p99_all_vs_cache_aware"), v["subject"], "cache_aware"),
        "  ... vs round_robin where it is below 90%: "
        + _tally_text(v.get("p99_all_vs_round_robin_below_90"), v["subject"], "round_robin"),
        f"  load max/mean <= max(1.3, round robin's) unless hits pay: "
        f"{'PASS' if p['load_spread'] else 'FAIL'} ({len(v['load_spread_failed'])} failed; "
        f"{len(v.get('load_over_1_3', []))} cells over 1.3; "
        f"{len(v.get('load_spread_failed_by_served_p99', []))} if hits pay only with a p99 of "
        f"served requests at most round robin's)",
        "  attainment within 1 pt across seeds: "
        + (
            f"{'PASS' if p['seeds'] else 'FAIL'} ({len(v['seed_spread_failed'])} of "
            f"{v.get('seeded_cells', 0)} cells with several seeds over 1 pt)"
            if v.get("seeded_cells")
            else "not measured (one seed; run with --seeds 0,1,2)"
        ),
    ]
    lines += [f"    cell: {c}" for c in v["cells_failed"]]
    lines += [f"    served p99: {c}" for c in v.get("cells_p99_of_served_over_1_1x", [])]
    lines += [f"    load: {c}" for c in v["load_spread_failed"]]
    lines += [f"    seeds: {c}" for c in v["seed_spread_failed"]]
    return "\n".join(lines)


HEATMAP_METRICS = {
    # metric -> (title, colour map, centre, how to read a cell)
    "attainment": ("SLO attainment: e2 minus the best other (points)", "RdYlGn", 0.0),
    "ttft_p99_ratio": ("p99 TTFT of served: e2 / the best other (log2)", "RdYlGn_r", 0.0),
    "ttft_p99_all_ratio": (
        "p99 TTFT of all requests: e2 / the best other (log2; blank: over 1% unanswered)",
        "RdYlGn_r",
        0.0,
    ),
    "hit_rate": ("prefix hit rate: e2 minus the best other (points)", "RdYlGn", 0.0),
    "load_max_mean": ("load max/mean of e2 (busy time, within a speed class)", "RdYlGn_r", 1.3),
}


def heatmap_grid(doc: dict, metric: str) -> tuple[list[str], list[str], list[list[float | None]]]:
    """Rows (workload/kind), columns (fleet x rate) and values of one heatmap."""
    combos = doc["combos"]
    rows = sorted({(e["workload"], e["kind"]) for e in combos})
    cols = sorted({(e["fleet"], c["rate"]) for e in combos for c in e["cells"]})
    grid: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    for e in combos:
        for c in e["cells"]:
            cmp = compare(c)
            if cmp is None:
                continue
            v = cmp.get(metric)
            if v is None:
                continue
            if metric in ("ttft_p99_ratio", "ttft_p99_all_ratio"):
                v = math.log2(v) if v > 0 else None
            elif metric in ("attainment", "hit_rate"):
                v = 100.0 * v
            grid[rows.index((e["workload"], e["kind"]))][cols.index((e["fleet"], c["rate"]))] = v
    return (
        [f"{w} ({k})" for w, k in rows],
        [f"{f} eng x{r:g}" for f, r in cols],
        grid,
    )


def draw_heatmaps(doc: dict, out_dir: Path, stem: str = "matrix") -> list[Path]:
    """One PNG per metric; ImportError without matplotlib (the caller says so: a silent
    empty list left users looking for heatmaps that were never drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, (title, cmap, centre) in HEATMAP_METRICS.items():
        rows, cols, grid = heatmap_grid(doc, metric)
        if not rows:
            continue
        vals = [v for row in grid for v in row if v is not None]
        if not vals:
            continue
        span = max(abs(v - centre) for v in vals) or 1.0
        norm = TwoSlopeNorm(vcenter=centre, vmin=centre - span, vmax=centre + span)
        data = [[math.nan if v is None else v for v in row] for row in grid]
        fig, ax = plt.subplots(figsize=(3.0 + 0.55 * len(cols), 1.4 + 0.32 * len(rows)))
        im = ax.imshow(data, cmap=cmap, norm=norm, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(
                        j,
                        i,
                        f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}",
                        ha="center",
                        va="center",
                        fontsize=5.5,
                    )
        ax.set_title(title, fontsize=8, wrap=True)
        fig.colorbar(im, ax=ax, shrink=0.8)
        fig.tight_layout()
        path = out_dir / f"{stem}_{metric}.png"
        fig.savefig(path, dpi=130)
        plt.close(fig)
        paths.append(path)
    return paths


def quick_spec(**changes: object) -> MatrixSpec:
    """The ``--quick`` slice, with overrides."""
    return replace(QUICK, **changes)  # type: ignore[arg-type]
