"""Trace shapes the routing matrix does not hold, written as hash-id traces for ``kvgate bench
sim --trace``: a check that what the matrix taught the router carries to traffic it was not
tuned on (docs/BENCHMARKS.md, *Held-out traces*).

Each is written in Qwen-Bailian's format (one JSON line a request: seconds, 16-token hash ids,
session keys), so the simulator reads it as it reads a user's own trace:

* ``reasoning``: 30 system prompts of 300-4,000 tokens (Zipf-popular), a short question each,
  long answers (median 1,200 tokens, up to 8,000): decode-heavy, the batch the bottleneck.
* ``rotating_docs``: 200 documents of 1,500-9,000 tokens asked about in Zipf order, the order
  shifting every two minutes: yesterday's hot documents go cold while they are still cached.
* ``agent_sessions``: agent loops on three tool prompts (3,000-6,000 tokens), 4-24 turns each
  a few seconds apart, each turn appending its answer and a tool result (up to 6,000 tokens):
  contexts growing to 60,000 tokens that must stay where they are cached.
* ``bimodal``: nothing shared; 92% short prompts (median 300 tokens) and 8% huge ones (median
  24,000): balance under a heavy tail of sizes, with no hit to gain.

Three more, written in the fiftieth session after the router's last change:

* ``rag_chunks``: retrieval-augmented prompts: one of 4 system prompts, then 3-8 chunks of
  256-512 tokens drawn from 3,000 (Zipf-popular, most relevant first), then the question:
  beyond the system prompt a prefix is shared only as far as the retrieved chunks agree.
* ``diurnal_docs``: questions on 150 documents of 1,000-8,000 tokens (Zipf-popular) whose rate
  swings from 0.2x to 1.8x its mean and back every 60 seconds of the trace (a day compressed,
  so that a matrix cell's few hundred requests span several): a fleet past its capacity at
  each peak and idle in each trough, where windowed rates lag.
* ``fanout``: jobs that send 2-16 requests at once (parallel samples, parallel tool calls) on
  one fresh context of 1,000-6,000 tokens behind one of 20 instruction prompts: a new prefix
  that many requests want before any engine has computed it.

Three more, written in the fifty-third session before any run on them:

* ``hot_prompt``: six in ten requests open with one agent prompt of ~14,000 tokens and a short
  unique task, the rest are short prompts sharing nothing: a prefix too hot for one engine to
  prefill behind, beside traffic that only needs balance.
* ``two_tier``: chat sessions (turns of a few hundred tokens on a growing history, a few seconds
  apart) beside one-off summaries of long documents (8,000-40,000 tokens, nothing shared, long
  answers): short turns that must keep their history's engine without queueing behind a huge
  prefill.
* ``tenant_bursts``: 60 tenants, each with its own system prompt of 1,500-5,000 tokens, active in
  bursts of 10-40 seconds at many times their mean rate, then quiet: a prefix that turns hot
  at once, with no warning, and cold again.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from bench.workloads.synthetic import Zipf, arrivals, lognormal_int

BLOCK_TOKENS = 16  # Qwen-Bailian's hash block


class _Ids:
    """Fresh hash ids: equal ids are equal content, so a prefix is shared by reusing them."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK_TOKENS)
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def _line(i: int, t: float, ids: list[int], n_out: int, parent: int = -1, turn: int = 1) -> dict:
    return {
        "chat_id": i,
        "parent_chat_id": parent,
        "timestamp": round(t, 3),
        "input_length": len(ids) * BLOCK_TOKENS,
        "output_length": n_out,
        "hash_ids": ids,
        "turn": turn,
    }


def reasoning(rng: random.Random, rate: float, duration: float) -> list[dict]:
    ids = _Ids()
    prompts = [ids.take(lognormal_int(rng, 1200, 0.6, 300, 4000)) for _ in range(30)]
    pick = Zipf(len(prompts), 1.1)
    return [
        _line(
            i,
            t,
            prompts[pick.sample(rng)] + ids.take(lognormal_int(rng, 150, 0.8, 20, 1500)),
            lognormal_int(rng, 1200, 0.7, 100, 8000),
        )
        for i, t in enumerate(arrivals(rng, rate, duration))
    ]


def rotating_docs(
    rng: random.Random, rate: float, duration: float, period_s: float = 120.0
) -> list[dict]:
    ids = _Ids()
    docs = [ids.take(lognormal_int(rng, 4000, 0.4, 1500, 9000)) for _ in range(200)]
    pick = Zipf(len(docs), 1.1)
    lines = []
    for i, t in enumerate(arrivals(rng, rate, duration)):
        doc = docs[(pick.sample(rng) + 37 * int(t // period_s)) % len(docs)]
        question = ids.take(lognormal_int(rng, 60, 0.5, 10, 400))
        lines.append(_line(i, t, doc + question, lognormal_int(rng, 150, 0.6, 10, 1000)))
    return lines


def agent_sessions(
    rng: random.Random, rate: float, duration: float, max_context: int = 60_000
) -> list[dict]:
    ids = _Ids()
    tools = [ids.take(n) for n in (3000, 4500, 6000)]
    lines: list[dict] = []
    for t in arrivals(rng, rate / 12.0, duration):  # ~12 turns a session
        context = tools[rng.randrange(len(tools))] + ids.take(
            lognormal_int(rng, 200, 0.6, 20, 1000)
        )
        parent = -1
        for turn in range(1, rng.randint(4, 24) + 1):
            n_out = lognormal_int(rng, 120, 0.6, 10, 800)
            lines.append(_line(len(lines), t, list(context), n_out, parent, turn))
            parent = len(lines) - 1
            context += ids.take(n_out + lognormal_int(rng, 600, 1.0, 20, 6000))
            t += rng.uniform(1.0, 6.0) + 0.02 * n_out  # the answer streams, the tool runs
            if len(context) * BLOCK_TOKENS > max_context or t >= duration:
                break
    lines.sort(key=lambda line: line["timestamp"])
    return lines


def bimodal(rng: random.Random, rate: float, duration: float, huge: float = 0.08) -> list[dict]:
    ids = _Ids()
    lines = []
    for i, t in enumerate(arrivals(rng, rate, duration)):
        if rng.random() < huge:
            n_in = lognormal_int(rng, 24_000, 0.3, 8_000, 60_000)
        else:
            n_in = lognormal_int(rng, 300, 0.8, 20, 3000)
        lines.append(_line(i, t, ids.take(n_in), lognormal_int(rng, 200, 0.8, 5, 2000)))
    return lines


def rag_chunks(rng: random.Random, rate: float, duration: float) -> list[dict]:
    ids = _Ids()
    systems = [ids.take(lognormal_int(rng, 800, 0.4, 400, 1500)) for _ in range(4)]
    chunks = [ids.take(rng.randint(256, 512)) for _ in range(3000)]
    pick_system, pick_chunk = Zipf(len(systems), 1.0), Zipf(len(chunks), 0.9)
    lines = []
    for i, t in enumerate(arrivals(rng, rate, duration)):
        retrieved: list[int] = []  # in the order drawn: the popular (most relevant) first
        k = rng.randint(3, 8)
        while len(retrieved) < k:
            chunk = pick_chunk.sample(rng)
            if chunk not in retrieved:
                retrieved.append(chunk)
        prompt = list(systems[pick_system.sample(rng)])
        for chunk in retrieved:
            prompt += chunks[chunk]
        prompt += ids.take(lognormal_int(rng, 60, 0.6, 10, 300))
        lines.append(_line(i, t, prompt, lognormal_int(rng, 180, 0.6, 10, 1200)))
    return lines


def diurnal_docs(
    rng: random.Random, rate: float, duration: float, period_s: float = 60.0, swing: float = 0.8
) -> list[dict]:
    ids = _Ids()
    docs = [ids.take(lognormal_int(rng, 3000, 0.5, 1000, 8000)) for _ in range(150)]
    pick = Zipf(len(docs), 1.0)
    peak = rate * (1.0 + swing)
    lines = []
    for t in arrivals(rng, peak, duration):  # thinned to the rate's curve
        if rng.random() * peak > rate * (1.0 + swing * math.sin(2 * math.pi * t / period_s)):
            continue
        question = ids.take(lognormal_int(rng, 50, 0.6, 10, 400))
        lines.append(
            _line(
                len(lines),
                t,
                docs[pick.sample(rng)] + question,
                lognormal_int(rng, 150, 0.6, 10, 1000),
            )
        )
    return lines


def fanout(rng: random.Random, rate: float, duration: float) -> list[dict]:
    ids = _Ids()
    instructions = [ids.take(lognormal_int(rng, 800, 0.3, 300, 2000)) for _ in range(20)]
    pick = Zipf(len(instructions), 1.0)
    widths, weights = (2, 4, 8, 16), (0.4, 0.3, 0.2, 0.1)
    mean_width = sum(w * p for w, p in zip(widths, weights, strict=True))
    lines: list[dict] = []
    for t in arrivals(rng, rate / mean_width, duration):
        context = instructions[pick.sample(rng)] + ids.take(
            lognormal_int(rng, 2500, 0.5, 1000, 6000)
        )
        for _ in range(rng.choices(widths, weights)[0]):
            suffix = ids.take(lognormal_int(rng, 30, 0.5, 5, 120))
            sent = t + rng.uniform(0.0, 0.05)
            lines.append(
                _line(len(lines), sent, context + suffix, lognormal_int(rng, 250, 0.7, 10, 2000))
            )
    return _in_order(lines)


def hot_prompt(rng: random.Random, rate: float, duration: float, share: float = 0.6) -> list[dict]:
    ids = _Ids()
    agent = ids.take(lognormal_int(rng, 14_000, 0.1, 12_000, 16_000))
    lines = []
    for i, t in enumerate(arrivals(rng, rate, duration)):
        if rng.random() < share:
            prompt = agent + ids.take(lognormal_int(rng, 120, 0.7, 10, 1500))
        else:
            prompt = ids.take(lognormal_int(rng, 400, 0.8, 20, 4000))
        lines.append(_line(i, t, prompt, lognormal_int(rng, 200, 0.7, 10, 1500)))
    return lines


def two_tier(
    rng: random.Random, rate: float, duration: float, long_share: float = 0.1
) -> list[dict]:
    ids = _Ids()
    lines: list[dict] = []
    for t in arrivals(rng, rate * long_share, duration):  # the one-off summaries
        document = ids.take(lognormal_int(rng, 16_000, 0.5, 8_000, 40_000))
        lines.append(_line(0, t, document, lognormal_int(rng, 500, 0.5, 100, 2000)))
    for t in arrivals(rng, rate * (1.0 - long_share) / 8.0, duration):  # ~8 turns a session
        history = ids.take(lognormal_int(rng, 500, 0.6, 50, 3000))  # a system prompt of its own
        for turn in range(1, rng.randint(2, 14) + 1):
            history += ids.take(lognormal_int(rng, 150, 0.8, 10, 1500))
            n_out = lognormal_int(rng, 180, 0.6, 10, 1200)
            lines.append(_line(0, t, list(history), n_out, turn=turn))
            history += ids.take(n_out)
            t += rng.uniform(2.0, 12.0) + 0.02 * n_out  # the answer streams, the user reads
            if t >= duration:
                break
    return _in_order(lines)


def tenant_bursts(
    rng: random.Random, rate: float, duration: float, tenants: int = 60
) -> list[dict]:
    ids = _Ids()
    systems = [ids.take(lognormal_int(rng, 2500, 0.4, 1500, 5000)) for _ in range(tenants)]
    burst_s, active = 25.0, 4  # bursts of 10-40 s; about four tenants active at once
    lines: list[dict] = []
    for start in arrivals(rng, active / burst_s, duration):
        system = systems[rng.randrange(tenants)]
        for dt in arrivals(rng, rate / active, rng.uniform(10.0, 40.0)):
            if start + dt < duration:
                question = ids.take(lognormal_int(rng, 100, 0.7, 10, 1000))
                n_out = lognormal_int(rng, 180, 0.6, 10, 1200)
                lines.append(_line(0, start + dt, system + question, n_out))
    return _in_order(lines)


def _in_order(lines: list[dict]) -> list[dict]:
    """``lines`` by time, numbered in that order."""
    lines.sort(key=lambda line: line["timestamp"])
    for i, line in enumerate(lines):
        line["chat_id"] = i
    return lines


SHAPES: dict[str, Callable[[random.Random, float, float], list[dict]]] = {
    "reasoning": reasoning,
    "rotating_docs": rotating_docs,
    "agent_sessions": agent_sessions,
    "bimodal": bimodal,
    "rag_chunks": rag_chunks,
    "diurnal_docs": diurnal_docs,
    "fanout": fanout,
    "hot_prompt": hot_prompt,
    "two_tier": two_tier,
    "tenant_bursts": tenant_bursts,
}


def write(shape: str, out: Path, *, rate: float, duration: float, seed: int) -> int:
    """Write ``shape`` to ``out`` (JSON lines); the number of requests."""
    lines = SHAPES[shape](random.Random(seed), rate, duration)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for line in lines:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")
    return len(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("heldout"), help="where the .jsonl go")
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES)
    )
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (scale with --rate-scale)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; one of {', '.join(SHAPES)}")
    if not (args.rate > 0 and args.duration > 0):
        ap.error("--rate and --duration must be positive")
    for shape in shapes:
        path = args.out_dir / f"{shape}.jsonl"
        n = write(shape, path, rate=args.rate, duration=args.duration, seed=args.seed)
        print(f"{path}: {n} requests")


if __name__ == "__main__":
    main()
