"""Trace loaders: the real traces packaged in ``bench/workloads/data/`` (its README names the
sources and licences) and a user's own in the same formats; a trace file may be
gzip-compressed (``.gz``).

* Hash-id JSONL (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``): Mooncake's
  traces (one id per 512-token block, milliseconds) and Qwen-Bailian's (16-token blocks,
  seconds). Each id is one block of ``block_tokens`` tokens, rendered as ``block_tokens x
  bytes_per_token`` bytes of text derived from the id; the last block is cut to what
  ``input_length`` leaves. Equal leading ids therefore give equal leading bytes, and the key is
  exactly ``input_length x bytes_per_token`` bytes (kvgate's token rule gives back
  ``input_length``). The block size and the time unit are inferred from the lines (a wrong
  guess of either loses the trace: every line read as 512-token blocks does not fit, and
  seconds read as milliseconds compress two hours into seven seconds) unless given.
* CSV of arrivals and lengths (Azure's ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``;
  BurstGPT's ``Timestamp``, ``Request tokens``, ``Response tokens``): no prefix information, so
  every prompt is unique text.

Malformed lines are skipped and counted (``LoadStats``), never fatal.
"""

from __future__ import annotations

import csv
import gzip
import importlib.resources
import io
import logging
import math
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _open(path: str | Path, text: bool) -> Iterator[io.IOBase]:
    """The file, decompressed when it ends in ``.gz``. gzip finds a truncated or corrupt file
    only while reading it (EOFError, zlib.error): that is a ValueError naming the file."""
    gz = str(path).endswith(".gz")
    opener = gzip.open if gz else open
    mode = ("rt" if gz else "r") if text else "rb"
    with opener(path, mode, **({"newline": ""} if text else {})) as fh:  # type: ignore[operator]
        try:
            yield fh  # type: ignore[misc]
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ValueError(
                f"{path}: truncated or corrupt gzip file ({type(exc).__name__}: {exc})"
            ) from None


MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake traces' hash block (Qwen-Bailian's is 16)
# block sizes a hash-id trace's lines are tried against when none is given
BLOCK_CANDIDATES = tuple(2**k for k in range(17))
# keys of Qwen-Bailian's trace lines (its timestamps are seconds; Mooncake's are milliseconds)
SESSION_KEYS = ("chat_id", "parent_chat_id", "turn")
TIME_UNITS = ("auto", "ms", "s")


@dataclass(slots=True)
class LoadStats:
    """What a loader read: lines kept and lines skipped (with the first few reasons), lines
    kept but mended (their hash ids cover more or fewer tokens than their length says), and
    what it inferred of the format."""

    kept: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)
    mended: int = 0
    inferred: dict[str, object] = field(default_factory=dict)

    def skip(self, line_no: int, why: str) -> None:
        self.skipped += 1
        if len(self.reasons) < 5:
            self.reasons.append(f"line {line_no}: {why}")


def hash_segments(
    hash_ids: list[int],
    input_tokens: int,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    bytes_per_token: int = BYTES_PER_TOKEN,
    tail_seed: int = 0,
    blocks: dict[int, Segment] | None = None,
) -> tuple[tuple[Segment, ...], bool]:
    """The prompt of one hash-id line: one segment per id, then whether it had to be mended.

    The ids name the prompt's leading blocks of ``block_tokens``; the last may be partial
    (Mooncake's). Ids beyond ``input_tokens`` are dropped, and tokens beyond the ids (a trace
    that hashes only whole blocks) are a segment of their own (``tail_seed``): the length is the
    request's, the ids say what it shares. ``blocks`` keeps one segment object per id (a
    trace's requests share most of theirs)."""
    if not hash_ids:
        raise ValueError("no hash_ids")
    if input_tokens < 1:
        raise ValueError("input_length must be >= 1")
    covered = -(-input_tokens // block_tokens)  # blocks the length fills, the last partial
    ids = hash_ids[:covered]
    mended = len(hash_ids) != covered
    cache = blocks if blocks is not None else {}
    full = block_tokens * bytes_per_token
    out: list[Segment] = []
    for hid in ids:
        seg = cache.get(hid)
        if seg is None:
            seg = cache[hid] = Segment(content_seed("mooncake", hid), full)
        out.append(seg)
    last = min(block_tokens, input_tokens - block_tokens * (len(ids) - 1))
    if last < block_tokens:
        out[-1] = Segment(out[-1].seed, last * bytes_per_token)
    rest = input_tokens - block_tokens * (len(ids) - 1) - last
    if rest > 0:
        out.append(Segment(tail_seed, rest * bytes_per_token))
    return tuple(out), mended


def _fits(block: int, tokens: int, n: int) -> bool:
    """Whether ``n`` ids of ``block``-token blocks name ``tokens`` tokens: the last one partial
    (Mooncake's) or every one whole, the rest unhashed."""
    return -(-tokens // block) == n or tokens // block == n


def infer_block_tokens(lines: list[tuple[int, int]]) -> tuple[int, float]:
    """The block size (of ``BLOCK_CANDIDATES``) that most ``(input tokens, ids)`` lines fit,
    and the share they are. Only lines of two ids or more say anything (one id fits any block
    at least that long); with none, Mooncake's 512."""
    telling = [(t, n) for t, n in lines if n >= 2]
    if not telling:
        return MOONCAKE_BLOCK_TOKENS, 0.0
    best, best_fit = MOONCAKE_BLOCK_TOKENS, -1
    for b in BLOCK_CANDIDATES:
        fit = sum(1 for t, n in telling if _fits(b, t, n))
        if fit > best_fit:
            best, best_fit = b, fit
    return best, best_fit / len(telling)


def infer_time_unit(timestamps: list[float], session_keys: bool) -> str:
    """``s`` when a timestamp has a fraction or the lines carry Qwen-Bailian's session keys
    (its trace counts seconds), else ``ms`` (Mooncake's integer milliseconds)."""
    if session_keys or any(not float(t).is_integer() for t in timestamps):
        return "s"
    return "ms"


def load_hash_trace(
    path: str | Path = MOONCAKE_PATH,
    *,
    model: str = DEFAULT_MODEL,
    block_tokens: int | None = None,
    time_unit: str = "auto",
    bytes_per_token: int = BYTES_PER_TOKEN,
    stats: LoadStats | None = None,
) -> list[Request]:
    """Every valid line of a hash-id JSONL trace, as completions, sorted by arrival.

    Each line has ``timestamp``, ``input_length``, ``output_length`` and ``hash_ids`` (one id per
    block of the prompt; equal leading ids are a shared prefix): Mooncake's traces (512-token
    blocks, milliseconds) and Qwen-Bailian's (16-token blocks, seconds, with session keys). The
    block size (``block_tokens``) and the time unit (``ms`` or ``s``) are inferred from the
    lines unless given; what was inferred is in ``stats.inferred`` and logged."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time unit {time_unit!r}: one of {', '.join(TIME_UNITS)}")
    if block_tokens is not None and block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    stats = stats if stats is not None else LoadStats()
    rows: list[tuple[int, float, int, int, list[int]]] = []
    session_keys = False
    with _open(path, text=False) as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
                ts = float(row["timestamp"])
                n_in = int(row["input_length"])
                n_out = int(row["output_length"])
                ids = [int(h) for h in row["hash_ids"]]
                if not (math.isfinite(ts) and ts >= 0):
                    raise ValueError(f"timestamp {ts} is not a time")
                if n_in < 1 or n_out < 1:
                    raise ValueError("token counts must be >= 1")
                if not ids:
                    raise ValueError("no hash_ids")
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                stats.skip(line_no, str(exc)[:200])
                continue
            session_keys = session_keys or any(k in row for k in SESSION_KEYS)
            rows.append((line_no, ts, n_in, n_out, ids))
    if block_tokens is None:
        block_tokens, share = infer_block_tokens([(r[2], len(r[4])) for r in rows])
        stats.inferred["block_tokens"] = block_tokens
        stats.inferred["lines_fitting_block"] = round(share, 4)
    if time_unit == "auto":
        time_unit = infer_time_unit([r[1] for r in rows], session_keys)
        stats.inferred["time_unit"] = time_unit
    per_s = 1000.0 if time_unit == "ms" else 1.0
    blocks: dict[int, Segment] = {}
    out: list[Request] = []
    for i, (line_no, ts, n_in, n_out, ids) in enumerate(rows):
        rows[i] = (line_no, ts, n_in, n_out, [])  # (the ids live on in the segments)
        segments, mended = hash_segments(
            ids,
            n_in,
            block_tokens=block_tokens,
            bytes_per_token=bytes_per_token,
            tail_seed=content_seed("trace-tail", line_no),
            blocks=blocks,
        )
        stats.mended += mended
        out.append(
            Request(
                request_id=f"mc-{line_no}",
                arrival=ts / per_s,
                turns=(Turn("", segments),),
                input_tokens=n_in,
                output_tokens=n_out,
                model=model,
                kind="mooncake",
                extra={"hash_ids": len(ids)},
            )
        )
    stats.kept = len(out)
    if stats.inferred:  # (an assumption the numbers rest on: shown, with its override)
        log.warning(
            "%s: read as %d-token hash blocks%s, timestamps in %s (%s; --trace-block-tokens and"
            " --trace-time-unit override)",
            Path(path).name,
            block_tokens,
            f" ({stats.inferred['lines_fitting_block']:.1%} of multi-block lines fit)"
            if "lines_fitting_block" in stats.inferred
            else "",
            "seconds" if time_unit == "s" else "milliseconds",
            "inferred: " + ", ".join(stats.inferred),
        )
    if stats.mended:
        log.warning(
            "%s: %d lines' hash ids cover more or fewer than their input_length at %d-token"
            " blocks (kept: the length decides, the ids the shared prefix)",
            Path(path).name,
            stats.mended,
            block_tokens,
        )
    if stats.skipped:
        log.warning(
            "%s: skipped %d lines: %s", Path(path).name, stats.skipped, "; ".join(stats.reasons)
        )
    out.sort(key=lambda r: r.arrival)
    return out


def load_mooncake(*, model: str = DEFAULT_MODEL) -> list[Request]:
    """The packaged Mooncake conversation trace (512-token blocks, milliseconds: nothing to
    infer)."""
    return load_hash_trace(
        MOONCAKE_PATH, model=model, block_tokens=MOONCAKE_BLOCK_TOKENS, time_unit="ms"
    )


def _azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (any number of decimals)."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


# the columns a CSV trace may name its arrival and lengths by (Azure LLM 2023 and 2024,
# BurstGPT, and the hash-id traces' JSON names), matched without regard to case
CSV_COLUMNS = {
    "time": ("TIMESTAMP", "arrival_time"),
    "input": ("ContextTokens", "Request tokens", "input_length", "input_tokens"),
    "output": ("GeneratedTokens", "Response tokens", "output_length", "output_tokens"),
}


def _columns(header: list[str] | None) -> dict[str, str]:
    """The header's name for each of ``CSV_COLUMNS`` (ValueError naming what is missing)."""
    by_lower = {h.strip().lower(): h for h in header or []}
    found: dict[str, str] = {}
    for role, names in CSV_COLUMNS.items():
        hit = next((by_lower[n.lower()] for n in names if n.lower() in by_lower), None)
        if hit is None:
            raise ValueError(
                f"CSV trace has no {role} column: want one of {', '.join(names)}"
                f" (header: {', '.join(header or []) or 'none'})"
            )
        found[role] = hit
    return found


def _csv_time(text: str, per_s: float) -> float:
    """A CSV timestamp in seconds: a number (in ``per_s`` units a second) or a date and time."""
    try:
        return float(text) / per_s
    except ValueError:
        return _azure_time(text)


def load_csv_trace(
    path: str | Path = AZURE_PATH,
    *,
    model: str = DEFAULT_MODEL,
    time_unit: str = "auto",
    bytes_per_token: int = BYTES_PER_TOKEN,
    stats: LoadStats | None = None,
) -> list[Request]:
    """Every valid row of a CSV trace of arrivals and lengths, arrivals from 0, each prompt
    unique text (no prefix information): Azure's LLM inference traces (``TIMESTAMP`` a date and
    time, ``ContextTokens``, ``GeneratedTokens``), BurstGPT (``Timestamp`` in seconds, ``Request
    tokens``, ``Response tokens``; its failed requests, 0 tokens out, are skipped) and the like
    (``CSV_COLUMNS``). A numeric timestamp counts seconds unless ``time_unit`` is ``ms``."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time unit {time_unit!r}: one of {', '.join(TIME_UNITS)}")
    per_s = 1000.0 if time_unit == "ms" else 1.0
    stats = stats if stats is not None else LoadStats()
    rows: list[tuple[float, int, int, int]] = []
    with _open(path, text=True) as fh:
        reader = csv.DictReader(fh)
        cols = _columns(reader.fieldnames)
        for line_no, row in enumerate(reader, 2):
            try:
                t = _csv_time(row[cols["time"]], per_s)
                n_in = int(row[cols["input"]])
                n_out = int(row[cols["output"]])
                if n_in < 1 or n_out < 1:
                    raise ValueError("token counts must be >= 1")
                if not math.isfinite(t):
                    raise ValueError("timestamp is not a time")
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
        log.warning(
            "%s: skipped %d rows: %s", Path(path).name, stats.skipped, "; ".join(stats.reasons)
        )
    return out


def azure_lengths(path: str | Path = AZURE_PATH) -> list[tuple[int, int]]:
    """(input, output) token pairs of the Azure trace, for synthetic workloads to sample."""
    return [(r.input_tokens, r.output_tokens) for r in load_csv_trace(path)]
