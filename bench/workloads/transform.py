"""Pure operations on a workload: time compression, slicing, limiting, merging, SLO assignment.

Every function takes and returns a list of :class:`Request` sorted by arrival and never mutates
its input.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from bench.workloads.request import BYTES_PER_TOKEN, Request, Segment, Turn, content_seed
from kvgate.cost_model import CostProfile
from kvgate.slo import SLO_CLASSES, Slo


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """Compress time by ``factor``: a factor of 2 doubles the request rate (arrival / 2)."""
    if not factor > 0:
        raise ValueError("rate factor must be positive")
    if factor == 1:
        return list(requests)
    return [r.with_(arrival=r.arrival / factor) for r in requests]


def window(
    requests: Sequence[Request], start: float, duration: float | None, *, rebase: bool = True
) -> list[Request]:
    """Requests arriving in ``[start, start + duration)``; times shifted to start at 0."""
    end = float("inf") if duration is None else start + duration
    picked = [r for r in requests if start <= r.arrival < end]
    if rebase and start:
        picked = [r.with_(arrival=r.arrival - start) for r in picked]
    return picked


def limit(requests: Sequence[Request], max_requests: int | None) -> list[Request]:
    """The first ``max_requests`` requests (all of them when None). A negative count is a
    ValueError: as a slice it would quietly mean all but the last few."""
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    return list(requests if max_requests is None else requests[:max_requests])


def spread_ties(requests: Sequence[Request], width: float) -> list[Request]:
    """Spread requests that share an arrival time evenly over ``[t, t + width)``, in order.

    Mooncake's timestamps have one-second granularity (every request shares its second with
    others): replayed as is, each second is a burst whose order over HTTP is a coin toss, so a
    live run and a simulation see different orders. Spreading keeps the per-second rate and
    gives the ties a deterministic order at least ``width / n`` apart.
    """
    if width <= 0:
        return list(requests)
    out: list[Request] = []
    i = 0
    n = len(requests)
    while i < n:
        j = i
        t = requests[i].arrival
        while j < n and requests[j].arrival == t:
            j += 1
        k = j - i
        if k == 1:
            out.append(requests[i])
        else:
            out.extend(r.with_(arrival=t + width * m / k) for m, r in enumerate(requests[i:j]))
        i = j
    out.sort(key=lambda r: r.arrival)
    return out


def thin(requests: Sequence[Request], keep: float, seed: int = 0) -> list[Request]:
    """Keep each request with probability ``keep``, decided by a hash of its id and ``seed``
    (so the same requests survive whatever else changes): less load, same time structure."""
    if not 0 < keep <= 1:
        raise ValueError("keep must be in (0, 1]")
    if keep == 1:
        return list(requests)
    cut = int(keep * 2**64)
    return [r for r in requests if content_seed(f"thin{seed}", r.request_id) * 2 < cut]


def at_bytes_per_token(requests: Sequence[Request], bytes_per_token: float) -> list[Request]:
    """The requests with their text resized from kvgate's token rule (``BYTES_PER_TOKEN``
    bytes a token, as every workload is written) to ``bytes_per_token``, an engine profile's
    tokenizer: each segment keeps its token count, so shared prefixes stay shared and a
    trace's hash blocks stay whole blocks of the engine's cache. Why: the router reads a
    prompt's tokens off its bytes at the profile's rate, as engines cache them; written at 4
    bytes a token for a 2-byte profile (``vllm-cpu-small``), every prompt looked twice as long
    to the router as the engine prefilled it, and e2 refused Mooncake's long prompts as too
    slow to decode."""
    if bytes_per_token == BYTES_PER_TOKEN:
        return list(requests)
    if not bytes_per_token > 0:
        raise ValueError("bytes_per_token must be positive")

    def seg(s: Segment) -> Segment:
        return Segment(s.seed, max(1, round(s.n_bytes * bytes_per_token / BYTES_PER_TOKEN)))

    return [
        r.with_(
            turns=tuple(Turn(t.role, tuple(seg(s) for s in t.segments)) for t in r.turns),
            reply=seg(r.reply) if r.reply is not None else None,
        )
        for r in requests
    ]


def stating_max_tokens(requests: Sequence[Request], cap: int) -> list[Request]:
    """Every request states ``max_tokens`` = ``cap`` (or its own answer's length, where that is
    longer), as clients that send an SDK default or the model's limit do; the answers keep their
    lengths. 0: each states exactly its answer's length (the traces' replay)."""
    if cap < 0:
        raise ValueError("the stated max_tokens must be >= 0")
    if not cap:
        return list(requests)
    return [r.with_(max_tokens=max(cap, r.output_tokens)) for r in requests]


def merge(*workloads: Iterable[Request]) -> list[Request]:
    """Several workloads interleaved by arrival (stable: ties keep argument order)."""
    return list(heapq.merge(*workloads, key=lambda r: r.arrival))


class SloSpecError(ValueError):
    """An SLO specification that cannot be parsed."""


def parse_slo_spec(spec: str) -> tuple[str, object]:
    """``keep`` | ``class:NAME`` | ``scaled:K`` or ``scaled:K:TPOT_MS`` | ``TTFT_MS,TPOT_MS``."""
    spec = spec.strip()
    if spec == "keep":
        return ("keep", None)
    if spec.startswith("class:"):
        name = spec[6:]
        if name not in SLO_CLASSES:
            raise SloSpecError(f"unknown SLO class {name!r} (known: {', '.join(SLO_CLASSES)})")
        return ("fixed", SLO_CLASSES[name])
    if spec.startswith("scaled:"):
        parts = spec[7:].split(":")
        try:
            k = float(parts[0])
            tpot = float(parts[1]) if len(parts) > 1 else 100.0
        except (ValueError, IndexError) as exc:
            raise SloSpecError(f"bad scaled SLO {spec!r}: want scaled:K[:TPOT_MS]") from exc
        if not (k > 0 and tpot > 0):
            raise SloSpecError("scaled SLO factors must be positive")
        return ("scaled", (k, tpot))
    try:
        ttft, tpot = (float(x) for x in spec.split(","))
    except ValueError as exc:
        raise SloSpecError(
            f"bad SLO spec {spec!r}: keep, class:NAME, scaled:K[:TPOT_MS] or TTFT_MS,TPOT_MS"
        ) from exc
    if not (ttft > 0 and tpot > 0):
        raise SloSpecError("SLO values must be positive")
    return ("fixed", Slo(ttft, tpot, "custom"))


MIN_SCALED_TTFT_MS = 250.0


def scaled_slo(input_tokens: int, profile: CostProfile, k: float, tpot_ms: float) -> Slo:
    """TTFT objective of ``k`` times the request's unloaded prefill time (DistServe's "SLO
    scale"), at least 250 ms: traces without SLOs get objectives a request can meet alone."""
    ttft = max(MIN_SCALED_TTFT_MS, k * profile.prefill_ms(input_tokens, 0))
    return Slo(round(ttft, 3), tpot_ms, f"scaled{k:g}")


def assign_slo(requests: Sequence[Request], spec: str, profile: CostProfile) -> list[Request]:
    """Give every request the SLO ``spec`` describes (see :func:`parse_slo_spec`)."""
    mode, value = parse_slo_spec(spec)
    if mode == "keep":
        return list(requests)
    if mode == "fixed":
        return [r.with_(slo=value) for r in requests]
    k, tpot = value  # type: ignore[misc]
    return [r.with_(slo=scaled_slo(r.input_tokens, profile, k, tpot)) for r in requests]


def describe(requests: Sequence[Request]) -> dict:
    """Size, duration and rate of a workload, for logs and result files."""
    if not requests:
        return {"requests": 0, "duration_s": 0.0, "rate_rps": 0.0}
    span = requests[-1].arrival - requests[0].arrival
    n = len(requests)
    return {
        "requests": n,
        "duration_s": round(span, 3),
        "rate_rps": round(n / span, 4) if span > 0 else None,
        "mean_input_tokens": round(sum(r.input_tokens for r in requests) / n, 1),
        "mean_output_tokens": round(sum(r.output_tokens for r in requests) / n, 1),
    }
