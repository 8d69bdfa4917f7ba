"""Measure a running vLLM for a kvgate cost profile (input of ``kvgate engine fit-profile``).

    .venv/bin/python -m bench.measure_vllm --url http://127.0.0.1:8100 --model tiny \\
        --model-dir PATH/TO/MODEL --out vllm.jsonl
    .venv/bin/kvgate engine fit-profile vllm.jsonl --name vllm-cpu-tiny --base BASE \\
        --out kvgate/profiles/vllm-cpu-tiny.json

Prefill rows: the TTFT of a lone streaming request (nothing else running) of ``n`` new tokens
after ``c`` cached ones: a unique prompt (``c = 0``), or a cached document sent once to warm the
cache and then again with a new tail (``c`` = the document's whole blocks). Decode rows: ``B``
concurrent streams of the same length; the median gap between tokens while all ``B`` stream is
one decode step of batch ``B``. Token counts come from the model's own tokenizer (``--model-dir``).
Repeats each point ``--repeat`` times and keeps the median (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

WORDS = (
    "the", "ship", "harbour", "cargo", "weighed", "night", "star", "ledger", "volume", "master",
    "notes", "observatory", "clear", "sky", "counted", "river", "mill", "grain", "bread",
    "market", "town", "road", "bridge", "stone", "wall", "gate", "tower", "bell", "morning",
)  # fmt: skip


def stream(url: str, model: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of each streamed chunk, from the request's send."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter() - t0)
    return times


def text(rng: random.Random, tok, tokens: int, head: str = "") -> str:
    words = [head] if head else []
    while len(tok.encode(" ".join(words)).ids) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--model-dir", required=True, help="for its tokenizer.json")
    ap.add_argument("--prefill", default="16,32,64,128,192,256,320,400,480")
    ap.add_argument("--contexts", default="64,128,256,352", help="cached tokens before a tail")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--decode-contexts", default="96,320", help="prompt tokens of the streams")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    rng = random.Random(7)
    rows = []
    for n in (int(x) for x in args.prefill.split(",")):
        ttfts = []
        for r in range(args.repeat):
            prompt = text(rng, tok, n, head=f"Unique {n}-{r}-{rng.random()}:")
            ttfts.append(stream(args.url, args.model, prompt, 1)[0] * 1000.0)
        n_tok = len(tok.encode(prompt).ids)
        rows.append(
            {"new_tokens": n_tok, "context_tokens": 0, "prefill_ms": statistics.median(ttfts)}
        )
        print(rows[-1], file=sys.stderr)
    for c in (int(x) for x in args.contexts.split(",")):
        for tail_tokens in (32, 128):
            ttfts = []
            for r in range(args.repeat):
                doc = text(rng, tok, c, head=f"Context {c}-{r}-{rng.random()}:")
                stream(args.url, args.model, doc + " warm", 1)  # cache it
                tail = text(rng, tok, tail_tokens, head="then")
                ttfts.append(stream(args.url, args.model, doc + " " + tail, 1)[0] * 1000.0)
            cached = (len(tok.encode(doc).ids) // 32) * 32  # vLLM reuses whole 32-token blocks
            total = len(tok.encode(doc + " " + tail).ids)
            rows.append({"new_tokens": total - cached, "context_tokens": cached,
                         "prefill_ms": statistics.median(ttfts)})  # fmt: skip
            print(rows[-1], file=sys.stderr)
    for ctx, b in itertools.product(
        (int(x) for x in args.decode_contexts.split(",")), [int(x) for x in args.batches.split(",")]
    ):
        gaps: list[float] = []
        for r in range(max(args.repeat // 2, 1)):
            prompts = [text(rng, tok, ctx, head=f"Batch {b}-{r}-{i}-{rng.random()}")
                       for i in range(b)]  # fmt: skip
            results: list[list[float]] = [[] for _ in range(b)]

            def run(i: int, prompts: list[str] = prompts, results: list = results) -> None:
                results[i] = stream(args.url, args.model, prompts[i], 48)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # the middle of the streams, when every request is decoding
            for times in results:
                mid = times[len(times) // 4 : 3 * len(times) // 4]
                gaps += [(y - x) * 1000.0 for x, y in itertools.pairwise(mid)]
        rows.append({"batch": b, "mean_context": ctx + 24, "step_ms": statistics.median(gaps)})
        print(rows[-1], file=sys.stderr)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
