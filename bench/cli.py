"""``kvgate bench``: replay a workload live, simulate a cluster, compare, report.

Verbs:

* ``kvgate bench replay --url URL --workload mooncake ...``: open-loop live replay to any
  OpenAI-compatible server; per-request JSONL and a summary JSON.
* ``kvgate bench sim --trace mooncake --engines 16 --policies e2,round_robin ...``: the
  discrete-event simulator, every policy x scheduler x rate side by side; one JSON.
* ``kvgate bench fidelity``: the same trace slice live (real engines + gateway on loopback) and
  simulated; p50/p99 TTFT error; one JSON.
* ``kvgate bench matrix [--quick] --jobs 2``: every policy over workloads x load x fleets (the
  judge of routing quality); a table per combo, JSON, heatmaps and issue 17's verdicts;
  ``--pool A.json B.json`` judges each cell's mean over earlier runs (draws of the workloads).
* ``kvgate bench report --inputs A.json B.json --out report.md``: Markdown tables and PNG plots.
* ``kvgate bench workloads``: list the workloads and describe one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from pathlib import Path

import orjson

from bench import read_json
from bench.workloads import WORKLOADS, WorkloadOptions
from engine.scheduler import POLICIES as SCHEDULERS
from kvgate.cli_support import http_url, non_negative_float, positive_float, positive_int
from kvgate.cost_model import ProfileError, load_profile

RESULTS = Path("results/tmp")  # git-ignored; pass --out for results to keep


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError("want positive numbers")
    return vals


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated names; a policy spec's own commas go inside brackets: e2[a=1,b=2]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    if not out:
        raise argparse.ArgumentTypeError("want at least one name")
    return tuple(out)


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers (seeds)."""
    try:
        return tuple(int(x) for x in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


def _counts(text: str) -> tuple[int, ...]:
    """Comma-separated counts >= 1 (engines)."""
    vals = _ints(text)
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"want counts >= 1, got {text!r}")
    return vals


def _schedulers(text: str) -> tuple[str, ...]:
    """Comma-separated engine scheduler names, checked against the engine's registry."""
    names = _names(text)
    for name in names:
        if name not in SCHEDULERS:
            raise argparse.ArgumentTypeError(
                f"unknown scheduler {name!r} (known: {', '.join(SCHEDULERS)})"
            )
    return names


def _policy_specs(text: str) -> tuple[str, ...]:
    """Comma-separated router policy specs (:func:`_names`), each checked while the arguments
    are parsed: a bad name, option or option value is refused before any work."""
    from bench.sim.policies import check_policy

    specs = _names(text)
    for spec in specs:
        try:
            check_policy(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"policy {spec!r}: {exc}") from None
    return specs


def _add_workload_args(p: argparse.ArgumentParser, *, default: str = "mooncake") -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--trace",
        "--workload",
        dest="workload",
        default=default,
        help=f"workload: {', '.join(WORKLOADS)}, or a trace file: hash-id .jsonl (Mooncake,"
        " Qwen-Bailian) or a .csv of arrivals and lengths (Azure, BurstGPT), gzipped or not",
    )
    g.add_argument(
        "--trace-block-tokens",
        type=int,
        default=None,
        metavar="N",
        help="a .jsonl trace's tokens per hash id (default: inferred from its lines; Mooncake"
        " 512, Qwen-Bailian 16)",
    )
    g.add_argument(
        "--trace-time-unit",
        choices=("auto", "ms", "s"),
        default="auto",
        help="a trace file's numeric timestamps (default auto: .jsonl milliseconds when all are"
        " integers and the lines carry no chat_id/turn, else seconds; .csv seconds)",
    )
    g.add_argument(
        "--start", type=non_negative_float, default=0.0, help="window start, trace seconds"
    )
    g.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        help="window length, trace seconds (default: all)",
    )
    g.add_argument(
        "--max-requests", type=positive_int, default=None, help="keep at most N (>= 1) requests"
    )
    g.add_argument(
        "--keep", type=float, default=1.0, help="thin the window to this fraction (by request id)"
    )
    g.add_argument(
        "--spread", type=float, default=0.0, help="spread same-timestamp requests over N s"
    )
    g.add_argument(
        "--rate", type=positive_float, default=4.0, help="synthetic workloads: requests/s"
    )
    g.add_argument("--cv", type=float, default=1.0, help="synthetic: inter-arrival CV (1=Poisson)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--slo",
        default=None,
        help="SLOs: keep | class:NAME | scaled:K[:TPOT_MS] | TTFT_MS,TPOT_MS "
        "(default: traces scaled:5:100, synthetic keep their own)",
    )
    g.add_argument("--model", default="kvgate-sim", help="model name in requests")
    g.add_argument(
        "--stated-max-tokens",
        type=int,
        default=0,
        metavar="N",
        help="every request states max_tokens N (or its answer's length, if longer), as clients "
        "sending an SDK default or the model's limit do; the answers keep their lengths "
        "(default 0: each states exactly its answer's length)",
    )


def _workload_options(args: argparse.Namespace, rate_scale: float = 1.0) -> WorkloadOptions:
    return WorkloadOptions(
        seed=args.seed,
        rate=args.rate,
        duration=args.duration,
        start=args.start,
        rate_scale=rate_scale,
        max_requests=args.max_requests,
        slo=args.slo,
        model=args.model,
        cv=args.cv,
        keep=args.keep,
        spread=args.spread,
        trace_block_tokens=args.trace_block_tokens,
        stated_max_tokens=args.stated_max_tokens,
        trace_time_unit=args.trace_time_unit,
    )


def _add_sim_world_args(p: argparse.ArgumentParser, engines: int = 16) -> None:
    g = p.add_argument_group("simulated cluster")
    g.add_argument(
        "--engines",
        type=positive_int,
        default=None,
        help=f"simulated engines (default {engines}, or as many as --roles, --speeds or "
        "--engine-profiles name)",
    )
    p.set_defaults(default_engines=engines)
    g.add_argument("--profile", default="mistral-7b-a6000", help="engine cost profile")
    g.add_argument(
        "--link-delay", type=float, default=0.002, help="engine event -> router delay, s"
    )
    g.add_argument("--link-jitter", type=float, default=0.0, help="extra uniform delay, s")
    g.add_argument("--network-delay", type=float, default=0.0005, help="gateway -> engine, s")
    g.add_argument("--heartbeat", type=float, default=1.0, help="engine heartbeat period, s")
    g.add_argument(
        "--reporting",
        default="events",
        choices=("events", "bridge"),
        help="what the engines report: events (kvgate's engine, the default) or bridge (as a "
        "plain vLLM behind the bridge: KV events and heartbeats only; the gateway reports each "
        "answer's first token)",
    )
    g.add_argument("--ingress-ms", type=float, default=0.0, help="client -> router, fixed ms")
    g.add_argument(
        "--ingress-ms-per-mb", type=float, default=0.0, help="client -> router, ms per MB of key"
    )
    g.add_argument(
        "--roles",
        type=parse_roles,
        default=None,
        metavar="ROLE:N,...",
        help="prefill/decode disaggregation: engines by role in order, e.g. prefill:4,decode:4 "
        "(their sum is the engine count; default: every engine both)",
    )
    g.add_argument(
        "--speeds",
        type=parse_speeds,
        default=None,
        metavar="FACTOR:N,...",
        help="a mixed fleet: engines by time factor in order, e.g. 1:8,2:8 (8 at the profile's "
        "speed, 8 taking twice as long; their sum is the engine count)",
    )
    g.add_argument(
        "--engine-profiles",
        type=parse_engine_profiles,
        default=None,
        metavar="PROFILE:N,...",
        help="a fleet of GPU generations: engines by cost profile in order (a name, a JSON path "
        "or NAME@xK), e.g. mistral-7b-a6000:8,my-24gb-card.json:8; each announces its own, "
        "--speeds slowing it on top as --announce says (default: --profile for every engine; "
        "every profile must share --profile's bytes_per_token)",
    )
    g.add_argument(
        "--announce",
        choices=("same", "true"),
        default="same",
        help="what engines off the profile's speed announce: same (the profile: the router "
        "finds their speed online, as with a mis-profiled engine) or true (PROFILE@xFACTOR)",
    )
    g.add_argument(
        "--join",
        type=parse_join,
        default=None,
        metavar="N@T",
        help="a fleet scaled out while traffic runs: the last N engines join T seconds into the "
        "run (the router learns of each from its first heartbeat), e.g. 8@30",
    )
    g.add_argument(
        "--outage",
        type=parse_outage,
        action="append",
        default=None,
        metavar="I@DOWN[:UP]",
        help="engine I (0-based) goes down DOWN seconds into the run and comes back cold at UP "
        "(its requests in flight fail, the gateway's breakers and retries route around it); "
        "repeatable, e.g. 2@60:90",
    )
    g.add_argument("--kv-link-gbps", type=float, default=100.0, help="KV link, Gb/s")
    g.add_argument("--kv-bytes-per-token", type=int, default=131_072, help="KV size per token")


def parse_roles(spec: str) -> tuple[str, ...]:
    """``prefill:2,decode:2`` -> each engine's role, in order."""
    out: list[str] = []
    for part in spec.split(","):
        role, _, n = part.strip().partition(":")
        if role not in ("both", "prefill", "decode") or not n.isdigit():
            raise argparse.ArgumentTypeError(f"--roles {spec!r}: expected ROLE:N,... ")
        out += [role] * int(n)
    if not out:
        raise argparse.ArgumentTypeError("--roles: no engine")
    return tuple(out)


def parse_join(spec: str) -> tuple[int, float]:
    """``8@30`` -> (8 engines, joining at 30 s)."""
    n, _, t = spec.strip().partition("@")
    try:
        count, at = int(n), float(t)
    except ValueError:
        count, at = 0, math.nan
    if count < 1 or not (math.isfinite(at) and at > 0):
        raise argparse.ArgumentTypeError(
            f"--join {spec!r}: expected N@T, N >= 1 engines joining at T > 0 seconds"
        )
    return count, at


def parse_outage(spec: str):  # -> bench.sim.world.Outage (import kept lazy)
    """``3@60:90`` -> engine 3 down at 60 s, back (cold) at 90 s; ``3@60``: it stays down."""
    from bench.sim.world import Outage

    index, _, times = spec.strip().partition("@")
    down, _, up = times.partition(":")
    try:
        return Outage(int(index), float(down), float(up) if up else None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--outage {spec!r}: expected I@DOWN[:UP], engine index I down at DOWN seconds and "
            f"back at UP > DOWN ({exc})"
        ) from None


def parse_speeds(spec: str) -> tuple[float, ...]:
    """``1:8,2:8`` -> each engine's time factor, in order."""
    out: list[float] = []
    for part in spec.split(","):
        factor, _, n = part.strip().partition(":")
        try:
            f = float(factor)
        except ValueError:
            f = math.nan
        if not (math.isfinite(f) and f > 0) or not n.isdigit():
            raise argparse.ArgumentTypeError(
                f"--speeds {spec!r}: expected FACTOR:N,... with positive factors"
            )
        out += [f] * int(n)
    if not out:
        raise argparse.ArgumentTypeError("--speeds: no engine")
    return tuple(out)


def parse_engine_profiles(spec: str) -> tuple[str, ...]:
    """``a6000:8,other.json:8`` -> each engine's profile spec, in order (checked when the
    fleet is built: a missing profile is a clear error there)."""
    out: list[str] = []
    for part in spec.split(","):
        name, _, n = part.strip().rpartition(":")
        if not name or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(
                f"--engine-profiles {spec!r}: expected PROFILE:N,... with N >= 1"
            )
        out += [name] * int(n)
    return tuple(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = sub.add_parser("replay", help="live open-loop replay to an OpenAI-compatible URL")
    p.add_argument(
        "--url", type=http_url, required=True, help="base URL, e.g. http://127.0.0.1:8000"
    )
    _add_workload_args(p)
    p.add_argument("--rate-scale", type=float, default=1.0, help="compress time: x2 = 2x rate")
    p.add_argument("--max-duration", type=float, default=None, help="send nothing after N s")
    p.add_argument("--no-hint", action="store_true", help="omit body field kvgate{...}")
    p.add_argument("--no-slo-headers", action="store_true", help="omit x-kvgate-*-ms headers")
    p.add_argument("--no-ignore-eos", action="store_true", help="omit ignore_eos: true")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT)")
    p.add_argument("--served-model", default=None, help="override the model name sent")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="after the last send, s")
    p.add_argument("--max-inflight", type=int, default=4096)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "replay", help="output prefix")

    p = sub.add_parser("sim", help="discrete-event simulation of the router and N engines")
    _add_workload_args(p)
    _add_sim_world_args(p)
    p.add_argument(
        "--policies",
        type=_policy_specs,
        default=("e2", "round_robin", "least_load", "cache_aware"),
        help="router policies, comma-separated; options as e2[rebalance=false] "
        "(aliases: see bench/sim/policies.py, e.g. e2-no-m, e2-no-band, e2-rebalance)",
    )
    p.add_argument(
        "--schedulers",
        type=_schedulers,
        default=("slo",),
        help=f"engine schedulers, comma-separated: {', '.join(SCHEDULERS)}",
    )
    p.add_argument("--rate-scale", type=_floats, default=(1.0,), help="one or more, e.g. 1,2,4")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--cprofile", type=Path, default=None, help="write cProfile files here")
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write every request's record, one JSON line each, to "
        "DIR/POLICY-SCHEDULER-xRATE.jsonl: its engine, the router's reason and predicted TTFT "
        "there, cached tokens, TTFT, status and whether it met its SLOs (why a policy lost)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "sim.json")

    p = sub.add_parser("fidelity", help="the same slice live and simulated; TTFT error")
    _add_workload_args(p)
    _add_sim_world_args(p, engines=4)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--policy", default="e2")
    p.add_argument("--scheduler", default="slo")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--records", action="store_true", help="also write OUT.live/.sim.jsonl")
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    p.add_argument("--no-progress", action="store_true")
    # a 10-minute window, a quarter of its requests: 4 engines carry what 16 carry at full rate
    # ingress: measured on the development machine from a live run (live minus simulated TTFT
    # of the same requests on the same engine: 6.5 ms + 27 ms per MB of prompt); the per-MB part
    # is the request body's (transfer, JSON, hashing), the fixed part is split with the response
    p.set_defaults(
        start=600.0, duration=600.0, keep=0.25, spread=1.0, heartbeat=0.2, ingress_ms=3.0,
        ingress_ms_per_mb=27.0,
    )  # fmt: skip

    p = sub.add_parser(
        "matrix",
        help="every policy over workloads x load x fleets; tables, JSON, heatmaps, verdicts",
        description="Runs every routing policy in the simulator over workloads x rates x fleet "
        "sizes x fleet kinds (homogeneous; heterogeneous: every second engine slower). Rates "
        "are multiples of each combo's knee, the rate at which round robin first drops below "
        "90% SLO attainment (found by bisection). Prints progress and a table per combo, "
        "saves JSON after each combo, draws a heatmap per metric (e2 against the best other "
        "policy) and prints the verdicts. Defaults: the full matrix (~30 min with --jobs 2 "
        "on the development machine); --quick runs a slice.",
    )
    p.add_argument("--quick", action="store_true", help="a slice: 4 workloads, 4 and 16 engines")
    p.add_argument("--workloads", type=_names, default=None, help="comma-separated workloads")
    p.add_argument(
        "--policies",
        type=_policy_specs,
        default=None,
        help="router policy specs, as bench sim's (default: every policy)",
    )
    p.add_argument("--fleets", type=_counts, default=None, help="engine counts, e.g. 4,16,64")
    p.add_argument("--kinds", type=_names, default=None, help="homo, hetero")
    p.add_argument("--rates", type=_floats, default=None, help="multiples of the knee")
    p.add_argument("--seeds", type=_ints, default=None, help="e.g. 0,1,2 (knee from the first)")
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write every run's requests, one JSON line each, to "
        "DIR/WORKLOAD-FLEET-KIND-xRATE-POLICY-sSEED.jsonl (engine, the router's reason and "
        "predicted TTFT there, cached tokens, TTFT, status, SLO met): why a policy lost a cell; "
        "narrow the matrix to that cell with --workloads, --fleets, --kinds and --rates",
    )
    p.add_argument(
        "--workload-seed",
        type=int,
        default=None,
        help="draw the synthetic workloads' requests with this seed (default 0; the traces "
        "are fixed): another draw of the same workloads, to check a result is not one draw's",
    )
    p.add_argument(
        "--stated-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="every request states max_tokens N (or its answer's length, if longer): clients "
        "that overstate their answers (default: exactly the answer's length)",
    )
    p.add_argument(
        "--link-delay",
        type=float,
        default=None,
        metavar="S",
        help="engine events reach the router S seconds after they happen (default 0.002: a "
        "reporter's flush and an XREAD); a slow broker's stale view",
    )
    p.add_argument(
        "--link-jitter",
        type=float,
        default=None,
        metavar="S",
        help="... plus a uniform delay up to S seconds per batch, seeded (default 0.001)",
    )
    p.add_argument("--requests-per-engine", type=positive_int, default=None)
    p.add_argument("--min-requests", type=positive_int, default=None)
    p.add_argument("--max-requests", type=positive_int, default=None)
    p.add_argument(
        "--min-window-s",
        type=float,
        default=None,
        help="each cell's arrivals span at least this long at its rate (default 20; 0: sized "
        "by request count alone, which makes a big fleet's cell a burst)",
    )
    p.add_argument(
        "--max-window-requests",
        type=positive_int,
        default=None,
        help="at most this many requests a cell for --min-window-s (default 2500)",
    )
    p.add_argument("--slow-factor", type=float, default=None, help="hetero: slow engines' factor")
    p.add_argument(
        "--hetero-profile",
        default=None,
        metavar="PROFILE",
        help="hetero: every second engine runs this profile, slowed by --slow-factor, and "
        "announces it at its nominal speed: two GPU generations, their KV memory and block "
        "size differing too (default: --profile; must share its bytes_per_token)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="the engines' cost profile: a name, a JSON path, or NAME@xK for hardware K times "
        "slower (mistral-7b-a6000@x0.2: 5x faster; default mistral-7b-a6000)",
    )
    p.add_argument(
        "--scheduler",
        default=None,
        choices=tuple(SCHEDULERS),
        help="the engines' local scheduler (default slo; fcfs is vLLM's own order)",
    )
    p.add_argument(
        "--run-shed",
        action="store_true",
        help="run the requests the router sheds anyway, to measure the SLO filter's precision",
    )
    p.add_argument(
        "--reporting",
        default=None,
        choices=("events", "bridge"),
        help="what the engines report: events (kvgate's engine, the default) or bridge (as a "
        "plain vLLM behind the bridge: KV events and heartbeats only; the gateway reports each "
        "answer's first token)",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument(
        "--knees-from",
        type=Path,
        default=None,
        help="take each combo's knee from an earlier matrix JSON (skips calibration)",
    )
    p.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: judge each cell's mean over these matrix documents (draws of the "
        "workloads: --workload-seed), print the verdicts, and save the pooled document to "
        "--out if given",
    )
    p.add_argument("--out", type=Path, default=None, help="default: results/matrix.json")
    p.add_argument(
        "--plots",
        type=Path,
        default=None,
        help="heatmap folder (default: beside out); heatmaps need matplotlib (the bench extra)",
    )
    p.add_argument("--no-plots", action="store_true")

    p = sub.add_parser(
        "records",
        help="why a run went as it did: --records files summed up and compared request by request",
        description="Sum up each file of per-request records (written by --records of bench "
        "sim, matrix, replay or fidelity): SLO attainment, how each request was lost (served "
        "late; refused by its engine, by the cause its message names; shed by the router), by "
        "kind, prompt size, engine and arrival time, and the router's predicted TTFT against "
        "the observed one. Every file after the first is compared with it request by request: "
        "the requests one run met and the other did not, and how the other lost them.",
    )
    p.add_argument("files", type=Path, nargs="+", help="records files (JSON lines)")
    p.add_argument("--json", type=Path, default=None, help="also save the figures here (JSON)")

    p = sub.add_parser("report", help="Markdown tables and PNG plots from result JSONs")
    p.add_argument("--inputs", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, default=RESULTS / "report.md")
    p.add_argument("--no-plots", action="store_true")

    p = sub.add_parser("workloads", help="list workloads; describe one")
    p.add_argument("name", nargs="?", default=None)
    _add_workload_args(p)
    p.add_argument("--rate-scale", type=float, default=1.0)


def _run_replay(args: argparse.Namespace) -> int:
    from bench.replay import ReplayConfig, replay
    from bench.workloads import build_workload

    reqs = build_workload(args.workload, _workload_options(args, args.rate_scale))
    cfg = ReplayConfig(
        base_url=args.url,
        model=args.served_model,
        stream=not args.no_stream,
        send_hint=not args.no_hint,
        ignore_eos=not args.no_ignore_eos,
        slo_headers=not args.no_slo_headers,
        max_duration_s=args.max_duration,
        request_timeout_s=args.timeout,
        drain_timeout_s=args.drain_timeout,
        max_inflight=args.max_inflight,
        api_key=args.api_key,
        progress=not args.no_progress,
    )
    result = asyncio.run(replay(reqs, cfg))
    out: Path = args.out
    jsonl, summary = Path(f"{out}.jsonl"), Path(f"{out}.summary.json")
    result.write(jsonl, summary)
    _print_summary(result.summary)
    print(f"wrote {jsonl} and {summary}")
    if result.records and not any(r.ok for r in result.records):
        first = next((r for r in result.records if r.error), result.records[0])
        print(
            f"kvgate bench replay: no request succeeded; the first failed with status "
            f"{first.status}: {first.error or 'no error text'}",
            file=sys.stderr,
        )
        return 1
    return 0


def _print_summary(s: dict) -> None:
    if not s.get("requests"):
        print("no requests")
        return
    print(
        f"{s['requests']} requests, {s['ok']} ok, status {s['status']}; "
        f"TTFT p50 {s['ttft_ms']['p50']} ms p99 {s['ttft_ms']['p99']} ms; "
        f"TPOT p50 {s['tpot_ms']['p50']} ms p99 {s['tpot_ms']['p99']} ms; "
        f"SLO attainment {100 * s['slo_attainment']:.1f}%; "
        f"prefix hit rate {s['prefix_hit_rate']}"
    )


def _sim_config(args: argparse.Namespace):  # -> SimConfig (import kept lazy)
    from bench.sim.runner import SimConfig
    from bench.sim.world import LinkConfig

    roles = getattr(args, "roles", None)
    speeds = getattr(args, "speeds", None)
    profiles = getattr(args, "engine_profiles", None)
    named = {
        flag: len(v)
        for flag, v in (("--roles", roles), ("--speeds", speeds), ("--engine-profiles", profiles))
        if v
    }
    if len(set(named.values())) > 1:
        raise ValueError(
            "the fleet flags name different engine counts: "
            + ", ".join(f"{flag} {n}" for flag, n in named.items())
        )
    engines = args.engines
    for flag, n in named.items():
        if engines is not None and engines != n:
            raise ValueError(f"--engines {engines}, but {flag} names {n} engines")
    if engines is None:
        engines = next(iter(named.values()), args.default_engines)
    joins = None
    join = getattr(args, "join", None)
    if join is not None:
        late, at = join
        if late >= engines:
            raise ValueError(f"--join {late}@{at:g}: some of the {engines} engines must start")
        joins = (0.0,) * (engines - late) + (at,) * late
    return SimConfig(
        engines=engines,
        joins=joins,
        outages=tuple(getattr(args, "outage", None) or ()),
        roles=roles,
        speeds=speeds,
        profiles=profiles,
        slow_announce=getattr(args, "announce", "same"),
        kv_link_gbps=getattr(args, "kv_link_gbps", 100.0),
        kv_bytes_per_token=getattr(args, "kv_bytes_per_token", 131_072),
        profile=args.profile,
        link=LinkConfig(
            link_delay_s=args.link_delay,
            link_jitter_s=args.link_jitter,
            network_delay_s=args.network_delay,
            heartbeat_s=args.heartbeat,
            seed=args.seed,
            ingress_s=args.ingress_ms / 1000.0,
            ingress_s_per_mb=args.ingress_ms_per_mb / 1000.0,
            request_events=getattr(args, "reporting", "events") == "events",
        ),
        seed=args.seed,
    )


def _run_sim(args: argparse.Namespace) -> int:
    from bench.report import runs_table
    from bench.sim.runner import SweepSpec, sweep

    spec = SweepSpec(
        workload=args.workload,
        options=_workload_options(args),
        policies=args.policies,
        schedulers=args.schedulers,
        rate_scales=args.rate_scale,
        sim=_sim_config(args),
        profile_dir=str(args.cprofile) if args.cprofile else None,
        records_dir=str(args.records) if args.records else None,
    )
    result = sweep(spec, jobs=args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    from bench.report import load_runs

    runs, _ = load_runs([args.out])
    print(runs_table(runs))
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


def _run_fidelity(args: argparse.Namespace) -> int:
    from bench.fidelity import FidelitySpec, run_fidelity

    for flag in ("speeds", "engine_profiles"):
        if getattr(args, flag, None):
            raise ValueError(
                f"--{flag.replace('_', '-')}: the live engines of a fidelity run all run the "
                "profile"
            )
    if getattr(args, "join", None):
        raise ValueError("--join: a fidelity run's live engines all start together")

    spec = FidelitySpec(
        workload=args.workload,
        options=_workload_options(args, args.rate_scale),
        policy=args.policy,
        scheduler=args.scheduler,
        sim=_sim_config(args),
        tolerance=args.tolerance,
        progress=not args.no_progress,
    )
    prefix = args.out.with_suffix("") if args.records else None
    result = asyncio.run(run_fidelity(spec, records_prefix=prefix))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    err = result["error"]
    print(
        f"TTFT p50 live {result['live']['ttft_ms']['p50']} sim {result['sim']['ttft_ms']['p50']} "
        f"({100 * (err['ttft_p50'] or 0):+.1f}%); p99 live {result['live']['ttft_ms']['p99']} "
        f"sim {result['sim']['ttft_ms']['p99']} ({100 * (err['ttft_p99'] or 0):+.1f}%)"
    )
    print(f"wrote {args.out}")
    return 0 if result["within_tolerance"] else 1


def _run_matrix(args: argparse.Namespace) -> int:
    from bench.matrix import MatrixSpec, format_verdict, quick_spec, run_matrix

    if args.pool:
        return _pool_matrix(args)
    if args.out is None:
        args.out = RESULTS / "matrix.json"
    changes: dict = {}
    for name in ("workloads", "policies", "kinds", "rates"):
        if getattr(args, name) is not None:
            changes[name] = tuple(getattr(args, name))
    if args.fleets is not None:
        changes["fleets"] = args.fleets
    if args.seeds is not None:
        changes["seeds"] = args.seeds
    for name in (
        "requests_per_engine",
        "min_requests",
        "max_requests",
        "min_window_s",
        "max_window_requests",
        "slow_factor",
        "hetero_profile",
        "profile",
        "scheduler",
        "reporting",
        "workload_seed",
        "stated_max_tokens",
    ):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    for name in ("link_delay", "link_jitter"):
        if getattr(args, name) is not None:
            changes[f"{name}_s"] = getattr(args, name)
    if args.run_shed:
        changes["run_shed"] = True
    try:
        spec = quick_spec(**changes) if args.quick else MatrixSpec(**changes)
    except ValueError as exc:
        print(f"kvgate bench matrix: {exc}", file=sys.stderr)
        return 2
    from bench.matrix import load_knees

    try:
        load_profile(spec.profile)
        spec.sim_config(2, "hetero", 0)  # (its engines' profiles, as every hetero cell's)
    except (ProfileError, ValueError) as exc:
        print(f"kvgate bench matrix: {exc}", file=sys.stderr)
        return 2

    try:
        knees = load_knees(args.knees_from, spec) if args.knees_from else None
    except (OSError, ValueError) as exc:
        print(f"kvgate bench matrix: {exc}", file=sys.stderr)
        return 2
    doc = run_matrix(spec, jobs=args.jobs, out=args.out, knees=knees, records_dir=args.records)
    print(format_verdict(doc["verdict"]))
    for skipped in doc.get("skipped", ()):
        print(f"skipped (no knee): {skipped['why']}")
    if not args.no_plots:
        _heatmaps(doc, args)
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s)")
    return 0


def _heatmaps(doc: dict, args: argparse.Namespace) -> None:
    """The matrix's heatmaps beside its JSON, or one line saying why there are none."""
    from bench.matrix import draw_heatmaps

    try:
        paths = draw_heatmaps(doc, args.plots or args.out.parent, stem=args.out.stem)
    except ImportError:
        print(
            "kvgate bench matrix: matplotlib is not installed; tables only (no heatmaps: "
            "pip install 'kvgate[bench]')",
            file=sys.stderr,
        )
        return
    for path in paths:
        print(f"wrote {path}")


def _pool_matrix(args: argparse.Namespace) -> int:
    """``kvgate bench matrix --pool A.json B.json ...``: the verdicts on each cell's mean."""
    from bench.matrix import format_verdict, pool, save

    try:
        doc = pool([read_json(path) for path in args.pool])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"kvgate bench matrix --pool: {exc}", file=sys.stderr)
        return 2
    print(f"pooled {len(args.pool)} documents (workload seeds {doc['spec']['workload_seed']})")
    print(format_verdict(doc["verdict"]))
    if args.out is not None:
        save(doc, args.out)
        if not args.no_plots:
            _heatmaps(doc, args)
        print(f"wrote {args.out}")
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from bench.report import build_report

    missing = [p for p in args.inputs if not p.exists()]
    if missing:
        print(f"no such file: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    out, images = build_report(args.inputs, args.out, plots=not args.no_plots)
    print(f"wrote {out}" + (f" and {len(images)} plots" if images else ""))
    return 0


def _run_workloads(args: argparse.Namespace) -> int:
    from bench.workloads import build_workload, describe

    if args.name is None:
        for name, fn in WORKLOADS.items():
            doc = (fn.__doc__ or "").strip().splitlines()
            print(f"{name:<16} {doc[0] if doc else ''}")
        return 0
    reqs = build_workload(args.name, _workload_options(args, args.rate_scale))
    print(orjson.dumps(describe(reqs), option=orjson.OPT_INDENT_2).decode())
    return 0


def _run_records(args: argparse.Namespace) -> int:
    from bench.records import report

    text, doc = report(args.files)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")
    return 0


VERBS = {
    "replay": _run_replay,
    "sim": _run_sim,
    "fidelity": _run_fidelity,
    "matrix": _run_matrix,
    "records": _run_records,
    "report": _run_report,
    "workloads": _run_workloads,
}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return VERBS[args.verb](args)
    except (ValueError, OSError) as exc:
        print(f"kvgate bench {args.verb}: {exc}", file=sys.stderr)
        return 2
