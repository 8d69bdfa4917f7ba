"""Workloads for replay and simulation: one request record, trace loaders, synthetic families.

:func:`build_workload` is the one entry point (CLI, simulator, fidelity run): a workload name
(or a trace path) and :class:`WorkloadOptions` give a seeded, arrival-sorted list of
:class:`Request`. The order of operations is fixed: load or generate, spread
timestamp ties over ``spread`` seconds, take the window
``[start, start + duration)`` in trace time, keep a ``keep`` fraction of it (by request id),
compress time by ``rate_scale``, keep at most ``max_requests``, then assign SLOs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.workloads import synthetic, traces
from bench.workloads.request import (
    DEFAULT_MODEL,
    Request,
    Segment,
    Turn,
    content_seed,
    segment_bytes,
    tokens_for_bytes,
)
from bench.workloads.transform import (
    assign_slo,
    at_bytes_per_token,
    describe,
    limit,
    merge,
    parse_slo_spec,
    scale_rate,
    spread_ties,
    stating_max_tokens,
    thin,
    window,
)
from kvgate.cost_model import CostProfile, default_profile

__all__ = [
    "DEFAULT_MODEL",
    "WORKLOADS",
    "Request",
    "Segment",
    "Turn",
    "WorkloadOptions",
    "assign_slo",
    "build_workload",
    "content_seed",
    "describe",
    "limit",
    "merge",
    "parse_slo_spec",
    "scale_rate",
    "segment_bytes",
    "spread_ties",
    "thin",
    "tokens_for_bytes",
    "trace_format",
    "window",
]


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """How to cut and shape a workload (see the module docstring for the order)."""

    seed: int = 0
    rate: float = 4.0  # synthetic families: requests per second before rate_scale
    duration: float | None = None  # window length in trace seconds (synthetic: 600 if None)
    start: float = 0.0
    rate_scale: float = 1.0
    max_requests: int | None = None
    slo: str | None = None  # None: the workload's default (see DEFAULT_SLO)
    model: str = DEFAULT_MODEL
    cv: float = 1.0
    keep: float = 1.0  # thin the window to this fraction of its requests (by request id)
    spread: float = 0.0  # spread requests sharing a timestamp over this many seconds
    # a trace file's hash block in tokens and its timestamps' unit (None / "auto": inferred)
    trace_block_tokens: int | None = None
    trace_time_unit: str = "auto"
    # every request states this max_tokens (or its answer's length, if longer; 0: exactly its
    # answer's length): clients that overstate it (transform.stating_max_tokens)
    stated_max_tokens: int = 0


SYNTHETIC_DURATION_S = 600.0

# Traces carry no SLOs: by default each request may take 5x its unloaded prefill time to its
# first token (at least 250 ms) and 100 ms per output token. Synthetic families keep theirs.
DEFAULT_SLO = {"mooncake": "scaled:5:100", "azure": "scaled:5:100"}


def _mooncake(opts: WorkloadOptions, path: Path | None = None) -> list[Request]:
    """Mooncake conversation trace: 1 h of Kimi traffic, shared prefixes from hash_ids."""
    if path is None:
        return traces.load_mooncake(model=opts.model)
    return traces.load_hash_trace(
        path, model=opts.model, block_tokens=opts.trace_block_tokens, time_unit=opts.trace_time_unit
    )


def _azure(opts: WorkloadOptions, path: Path | None = None) -> list[Request]:
    """Azure LLM inference trace (conversation, Nov 2023): arrivals, lengths, unique prompts."""
    return traces.load_csv_trace(
        path or traces.AZURE_PATH, model=opts.model, time_unit=opts.trace_time_unit
    )


def _synthetic(fn: Callable[..., list[Request]]) -> Callable[[WorkloadOptions], list[Request]]:
    def build(opts: WorkloadOptions) -> list[Request]:
        dur = opts.duration if opts.duration is not None else SYNTHETIC_DURATION_S
        return fn(opts.rate, opts.start + dur, opts.seed, cv=opts.cv, model=opts.model)

    build.__doc__ = fn.__doc__
    return build


def _qwen(opts: WorkloadOptions) -> list[Request]:
    """QwenTrace-style chat / image / search / file mix with FlowPrefill's SLOs."""
    dur = opts.duration if opts.duration is not None else SYNTHETIC_DURATION_S
    lengths = traces.azure_lengths() if traces.AZURE_PATH.exists() else None
    return synthetic.qwen_mix(
        opts.rate, opts.start + dur, opts.seed, chat_lengths=lengths, cv=opts.cv, model=opts.model
    )


def _preble_mix(opts: WorkloadOptions) -> list[Request]:
    """The four Preble families at a quarter of the rate each, interleaved."""
    part = WorkloadOptions(
        seed=opts.seed,
        rate=opts.rate / 4,
        duration=opts.duration,
        start=opts.start,
        model=opts.model,
        cv=opts.cv,
    )
    fams = ("tool_use", "long_doc_qa", "programming", "multi_turn_chat")
    return merge(*(WORKLOADS[f](part) for f in fams))


WORKLOADS: dict[str, Callable[[WorkloadOptions], list[Request]]] = {
    "mooncake": _mooncake,
    "azure": _azure,
    "tool_use": _synthetic(synthetic.tool_use),
    "long_doc_qa": _synthetic(synthetic.long_doc_qa),
    "programming": _synthetic(synthetic.programming),
    "multi_turn_chat": _synthetic(synthetic.multi_turn_chat),
    "chat_sessions": _synthetic(synthetic.chat_sessions),
    "preble_mix": _preble_mix,
    "qwen_mix": _qwen,
    "zipf_doc_qa": _synthetic(synthetic.zipf_doc_qa),
}


def trace_format(name: str) -> str | None:
    """``jsonl`` (hash ids) or ``csv`` (lengths) for a trace file's name, gzipped or not, or
    a packaged trace's; None for anything else."""
    if name == "mooncake":
        return "jsonl"
    if name == "azure":
        return "csv"
    plain = name.removesuffix(".gz")
    if plain.endswith((".jsonl", ".json")):
        return "jsonl"
    return "csv" if plain.endswith(".csv") else None


def build_workload(
    name: str, opts: WorkloadOptions | None = None, *, profile: CostProfile | None = None
) -> list[Request]:
    """The requests of workload ``name`` (a registry key, or a trace path: hash-id JSONL or
    a CSV of lengths, either may be gzipped); ValueError when there are none."""
    opts = opts or WorkloadOptions()
    kind = name
    if name in WORKLOADS:
        reqs = WORKLOADS[name](opts)
    else:
        path = Path(name)
        fmt = trace_format(name)
        if fmt == "jsonl":
            kind, reqs = "mooncake", _mooncake(opts, path)
        elif fmt == "csv":
            kind, reqs = "azure", _azure(opts, path)
        else:
            known = ", ".join(WORKLOADS)
            raise ValueError(
                f"unknown workload {name!r}: one of {known}, or a .jsonl/.csv trace (or .gz)"
            )
        if not reqs:
            raise ValueError(
                f"no requests in {name}: no line was a request (the log names the first"
                " skipped lines and why)"
            )
    reqs = spread_ties(reqs, opts.spread)
    reqs = window(reqs, opts.start, opts.duration)
    reqs = thin(reqs, opts.keep, opts.seed)
    reqs = scale_rate(reqs, opts.rate_scale)
    reqs = limit(reqs, opts.max_requests)
    if not reqs:
        cut = [
            f"start {opts.start:g} s" if opts.start else "",
            f"duration {opts.duration:g} s" if opts.duration is not None else "",
            f"keep {opts.keep:g}" if opts.keep != 1 else "",
            f"max requests {opts.max_requests}" if opts.max_requests is not None else "",
        ]
        where = ", ".join(c for c in cut if c)
        raise ValueError(f"no requests in {name}" + (f" within {where}" if where else ""))
    spec = opts.slo or DEFAULT_SLO.get(kind, "keep")
    profile = profile or default_profile()
    reqs = at_bytes_per_token(assign_slo(reqs, spec, profile), profile.bytes_per_token)
    return stating_max_tokens(reqs, opts.stated_max_tokens)
