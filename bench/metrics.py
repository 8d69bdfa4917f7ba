"""Per-request records and their summary, shared by live replay and the simulator.

Both produce :class:`RequestRecord` objects and summarise them with :func:`summarize`, so a live
run and a simulated run of the same workload are compared on exactly the same definitions:

* TTFT: arrival (scheduled send time) to the first output token;
* TTFT p99 of all requests: the p99 with every request that got no first token (shed, rejected,
  failed) counted as never answered, so None when more than 1% got none. The percentiles of
  served requests alone favour whoever refuses its slowest requests;
* TPOT: mean time per output token after the first, ``(t_last - t_first) / (tokens - 1)``;
* SLO met: finished OK with TTFT <= its TTFT objective and TPOT <= its TPOT objective;
* goodput: SLO-meeting requests per second of offered load;
* prefix hit rate: cached prompt tokens / prompt tokens, over finished requests;
* load spread: max/mean and coefficient of variation of requests (and prefill tokens) per engine.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from kvgate.stats import percentile

if TYPE_CHECKING:
    from bench.workloads.request import Request

STATUS_OK = 200
STATUS_SHED = 429  # shed by the router or rejected by the engine (SLO cannot be met)
STATUS_TRANSPORT = 0  # no HTTP answer (connection error, timeout)


@dataclass(slots=True)
class RequestRecord:
    """How one request went (times in seconds)."""

    request_id: str
    kind: str
    arrival: float
    input_tokens: int
    output_tokens: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    status: int = STATUS_TRANSPORT
    engine: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    max_gap_s: float | None = None  # longest wait between two streamed chunks (a stall or not)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reason: str | None = None
    matched_bytes: int | None = None
    error: str | None = None
    shed_run: bool = False  # the router shed it; the simulator ran it anyway (LinkConfig.run_shed)
    predicted_ttft_ms: float | None = None  # the router's prediction on its engine (sim only)

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK and self.error is None

    @property
    def slo_met(self) -> bool:
        if not self.ok or self.ttft_s is None:
            return False
        if self.ttft_s * 1000.0 > self.slo_ttft_ms:
            return False
        return self.tpot_s is None or self.tpot_s * 1000.0 <= self.slo_tpot_ms

    def to_dict(self) -> dict:
        out = asdict(self)
        out["slo_met"] = self.slo_met
        return out

    @classmethod
    def for_request(cls, req: Request, **fields: object) -> RequestRecord:
        """A record for ``req`` before anything happened to it (replay and simulator alike)."""
        return cls(
            request_id=req.request_id,
            kind=req.kind,
            arrival=req.arrival,
            input_tokens=req.input_tokens,
            output_tokens=req.output_tokens,
            slo_ttft_ms=req.slo.ttft_ms,
            slo_tpot_ms=req.slo.tpot_ms,
            **fields,  # type: ignore[arg-type]
        )


def _pcts(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99/mean of ``values`` (seconds) in ms; None when there are none."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "p50": round(percentile(values, 0.5) * scale, 3),
        "p90": round(percentile(values, 0.9) * scale, 3),
        "p99": round(percentile(values, 0.99) * scale, 3),
        "mean": round(sum(values) / len(values) * scale, 3),
    }


def ttft_p99_all_ms(records: Sequence[RequestRecord]) -> float | None:
    """p99 TTFT in ms over every request, one without a first token counted as infinitely late
    (None: more than 1% had none, so no p99 exists). Interpolates as :func:`percentile` does."""
    answered = sorted(r.ttft_s for r in records if r.ok and r.ttft_s is not None)
    pos = (len(records) - 1) * 0.99
    lo, hi = math.floor(pos), math.ceil(pos)
    if not records or hi >= len(answered):
        return None  # the p99 falls on (or between) requests answered never
    return round((answered[lo] + (answered[hi] - answered[lo]) * (pos - lo)) * 1000.0, 3)


def spread(counts: Iterable[float]) -> dict[str, float | None]:
    """How unevenly work is spread: max/mean and coefficient of variation (0 = perfectly even)."""
    vals = list(counts)
    if not vals or sum(vals) == 0:
        return {"max_over_mean": None, "cv": None, "min": None, "max": None}
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    return {
        "max_over_mean": round(max(vals) / mean, 4),
        "cv": round(math.sqrt(var) / mean, 4),
        "min": min(vals),
        "max": max(vals),
    }


def _shed_runs(records: Sequence[RequestRecord]) -> dict | None:
    """How the requests the router shed fared when run anyway (None: none was): the filter's
    precision is the share that missed their SLO even so."""
    runs = [r for r in records if r.shed_run]
    if not runs:
        return None
    missed = sum(1 for r in runs if not r.slo_met)
    return {"requests": len(runs), "missed": missed, "precision": round(missed / len(runs), 4)}


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    """One JSON line per request (its :class:`RequestRecord` fields and ``slo_met``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for rec in records:
            fh.write(orjson.dumps(rec.to_dict()) + b"\n")


def summarize(records: Sequence[RequestRecord], engines: Sequence[str] = ()) -> dict:
    """The figures DESIGN.md section 5 asks for, over ``records``.

    ``engines`` lists every engine so idle ones count in the load spread.
    """
    n = len(records)
    if n == 0:
        return {"requests": 0}
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    met = sum(1 for r in records if r.slo_met)
    first = min(r.arrival for r in records)
    last = max(r.arrival for r in records)
    span = max(last - first, 1e-9)
    end = max((r.arrival + (r.e2e_s or 0.0)) for r in records)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    per_engine: dict[str, int] = dict.fromkeys(engines, 0)
    per_engine_prefill: dict[str, int] = dict.fromkeys(engines, 0)
    for r in records:
        if r.engine is not None:
            per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
            per_engine_prefill[r.engine] = per_engine_prefill.get(r.engine, 0) + max(
                r.prompt_tokens - r.cached_tokens, 0
            )
    by_kind: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_kind[r.kind].append(r)
    return {
        "requests": n,
        "ok": len(ok),
        "status": {str(k): v for k, v in sorted(Counter(r.status for r in records).items())},
        "offered_rps": round(n / span, 4) if n > 1 else None,
        "makespan_s": round(end - first, 3),
        "ttft_ms": _pcts(ttft),
        "ttft_p99_all_ms": ttft_p99_all_ms(records),
        "tpot_ms": _pcts(tpot),
        "e2e_ms": _pcts(e2e),
        "slo_attainment": round(met / n, 4),
        "goodput_rps": round(met / span, 4) if n > 1 else None,
        "throughput_tokens_s": round(out_tokens / max(end - first, 1e-9), 2),
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
        "load_spread_requests": spread(per_engine.values()),
        "load_spread_prefill_tokens": spread(per_engine_prefill.values()),
        "per_engine_requests": dict(sorted(per_engine.items())),
        "reasons": dict(sorted(Counter(r.reason for r in records if r.reason).items())),
        "shed_runs": _shed_runs(records),
        "by_kind": {
            k: {
                "requests": len(v),
                "slo_attainment": round(sum(1 for r in v if r.slo_met) / len(v), 4),
                "ttft_p99_ms": _pcts([r.ttft_s for r in v if r.ok and r.ttft_s is not None])["p99"],
            }
            for k, v in sorted(by_kind.items())
        },
    }
