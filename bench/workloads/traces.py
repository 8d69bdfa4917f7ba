"""Loaders for the real traces packaged in ``bench/workloads/data/`` (its README names the
sources and licences); a trace file may be gzip-compressed (``.gz``).

* Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``): each hash
  id is one block of ``block_tokens`` (512) tokens, rendered as ``block_tokens x
  bytes_per_token`` bytes of text derived from the id; the last block is cut to what
  ``input_length`` leaves. Equal leading ids therefore give equal leading bytes, and the key is
  exactly ``input_length x bytes_per_token`` bytes (kvgate's token rule gives back
  ``input_length``).
* Azure LLM inference CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``): arrivals and
  lengths; no prefix information, so every prompt is unique text.

Malformed lines are skipped and counted (``LoadStats``), never fatal.
"""

from __future__ import annotations

import csv
import gzip
import importlib.resources
import io
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import orjson

from bench.workloads.request import (
    BYTES_PER_TOKEN,
    DEFAULT_MODEL,
    Request,
    Segment,
    Turn,
    content_seed,
)

log = logging.getLogger(__name__)

# The package's own copies; KVGATE_TRACE_DIR points at a folder with the same names instead
# (compressed or not).
PACKAGED = Path(str(importlib.resources.files("bench.workloads"))) / "data"


def _trace(name: str) -> Path:
    folder = Path(os.environ.get("KVGATE_TRACE_DIR") or PACKAGED)
    plain = folder / name
    return plain if plain.exists() else folder / f"{name}.gz"


MOONCAKE_PATH = _trace("mooncake_conversation_trace.jsonl")
AZURE_PATH = _trace("azure_llm_2023_conv.csv")


def _open(path: str | Path, text: bool) -> io.IOBase:
    """The file, decompressed when it ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", newline="") if text else gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, newline="") if text else open(path, "rb")  # type: ignore[return-value]


MOONCAKE_BLOCK_TOKENS = 512


@dataclass(slots=True)
class LoadStats:
    """What a loader read: lines kept and lines skipped (with the first few reasons)."""

    kept: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    def skip(self, line_no: int, why: str) -> None:
        self.skipped += 1
        if len(self.reasons) < 5:
            self.reasons.append(f"line {line_no}: {why}")


def mooncake_segments(
    hash_ids: list[int],
    input_tokens: int,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    bytes_per_token: int = BYTES_PER_TOKEN,
    seeds: dict[int, int] | None = None,
) -> tuple[Segment, ...]:
    """The prompt of one Mooncake line: one segment per hash id, the last one partial."""
    if not hash_ids:
        raise ValueError("no hash_ids")
    n = len(hash_ids)
    last_tokens = input_tokens - block_tokens * (n - 1)
    if not 0 < last_tokens <= block_tokens:
        raise ValueError(
            f"input_length {input_tokens} does not fit {n} blocks of {block_tokens} tokens"
        )
    cache = seeds if seeds is not None else {}
    out = []
    full = block_tokens * bytes_per_token
    for i, hid in enumerate(hash_ids):
        seed = cache.get(hid)
        if seed is None:
            seed = cache[hid] = content_seed("mooncake", hid)
        out.append(Segment(seed, full if i < n - 1 else last_tokens * bytes_per_token))
    return tuple(out)


def load_mooncake(
    path: str | Path = MOONCAKE_PATH,
    *,
    model: str = DEFAULT_MODEL,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    bytes_per_token: int = BYTES_PER_TOKEN,
    stats: LoadStats | None = None,
) -> list[Request]:
    """Every valid line of a Mooncake trace, as completions, sorted by arrival."""
    stats = stats if stats is not None else LoadStats()
    seeds: dict[int, int] = {}
    out: list[Request] = []
    with _open(path, text=False) as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
                ts = float(row["timestamp"]) / 1000.0
                n_in = int(row["input_length"])
                n_out = int(row["output_length"])
                ids = [int(h) for h in row["hash_ids"]]
                segments = mooncake_segments(
                    ids,
                    n_in,
                    block_tokens=block_tokens,
                    bytes_per_token=bytes_per_token,
                    seeds=seeds,
                )
                req = Request(
                    request_id=f"mc-{line_no}",
                    arrival=ts,
                    turns=(Turn("", segments),),
                    input_tokens=n_in,
                    output_tokens=n_out,
                    model=model,
                    kind="mooncake",
                    extra={"hash_ids": len(ids)},
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                stats.skip(line_no, str(exc)[:200])
                continue
            out.append(req)
    stats.kept = len(out)
    if stats.skipped:
        log.warning("mooncake: skipped %d lines: %s", stats.skipped, "; ".join(stats.reasons))
    out.sort(key=lambda r: r.arrival)
    return out


def _azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (any number of decimals)."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def load_azure(
    path: str | Path = AZURE_PATH,
    *,
    model: str = DEFAULT_MODEL,
    bytes_per_token: int = BYTES_PER_TOKEN,
    stats: LoadStats | None = None,
) -> list[Request]:
    """Every valid row of an Azure LLM trace, arrivals from 0, each prompt unique text."""
    stats = stats if stats is not None else LoadStats()
    rows: list[tuple[float, int, int, int]] = []
    with _open(path, text=True) as fh:
        reader = csv.DictReader(fh)
        for line_no, row in enumerate(reader, 2):
            try:
                t = _azure_time(row["TIMESTAMP"])
                n_in = int(row["ContextTokens"])
                n_out = int(row["GeneratedTokens"])
                if n_in < 1 or n_out < 1:
                    raise ValueError("token counts must be >= 1")
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                stats.skip(line_no, str(exc)[:200])
                continue
            rows.append((t, line_no, n_in, n_out))
    rows.sort()
    t0 = rows[0][0] if rows else 0.0
    out = [
        Request(
            request_id=f"az-{line_no}",
            arrival=t - t0,
            turns=(Turn("", (Segment(content_seed("azure", line_no), n_in * bytes_per_token),)),),
            input_tokens=n_in,
            output_tokens=n_out,
            model=model,
            kind="azure",
        )
        for t, line_no, n_in, n_out in rows
    ]
    stats.kept = len(out)
    if stats.skipped:
        log.warning("azure: skipped %d rows: %s", stats.skipped, "; ".join(stats.reasons))
    return out


def azure_lengths(path: str | Path = AZURE_PATH) -> list[tuple[int, int]]:
    """(input, output) token pairs of the Azure trace, for synthetic workloads to sample."""
    return [(r.input_tokens, r.output_tokens) for r in load_azure(path)]
