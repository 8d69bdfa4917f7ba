"""Why a run went as it did: the per-request records of ``--records`` (``bench sim``, ``bench
matrix``, ``bench replay``, ``bench fidelity``) summed up, and two runs of the same requests
compared request by request (``kvgate bench records``).

A matrix verdict says that e2 lost a cell; the records say which requests it lost and how. Every
request ends one way (:func:`outcome`): its SLO met; served late (its first token, or its
tokens after it); refused by its engine, for the cause the engine's message names (kvgate's
S-EDF engine: :data:`engine.scheduler.base.REFUSAL_CAUSES`; a refused request wasted the GPU
time it got only when its prefill was paused and abandoned); shed by the router; or failed.
The summary counts those outcomes overall, by request kind, by prompt size, by engine and over
time, and reads the router's predicted TTFT (simulator runs) against what came. The comparison
lists the requests one run met and the other did not, with how the other lost them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from bench.metrics import STATUS_OK
from engine.scheduler.base import refusal_cause
from kvgate.stats import percentile

TIME_BINS = 5  # the run's span cut into this many equal parts (cold start against the rest)
SIZE_BINS = 4  # prompt sizes by quartile of the first run's


class RecordsError(ValueError):
    """A records file that cannot be read (the message names the file and the line)."""


def load(path: Path) -> list[dict]:
    """The records of one JSON-lines file (:func:`bench.metrics.write_records`); a line that is
    not a JSON object with a ``request_id`` is an error naming the file and line."""
    out: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordsError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("request_id"), str):
                raise RecordsError(f"{path}:{n}: not a request record (no request_id)")
            out.append(rec)
    if not out:
        raise RecordsError(f"{path}: no records")
    return out


def met(rec: dict) -> bool:
    """Whether the request met its SLO (the record's own verdict when it has one)."""
    if "slo_met" in rec:
        return bool(rec["slo_met"])
    return outcome(rec) == "met"


def outcome(rec: dict) -> str:
    """How the request ended: ``met``, ``late_ttft``, ``late_tpot``, ``shed`` (the router's
    429, or too long for any engine), ``refused:CAUSE`` (its engine's, by
    :func:`engine.scheduler.base.refusal_cause`) or ``failed`` (no answer, or an error)."""
    status = rec.get("status")
    error = rec.get("error") or ""
    if rec.get("reason") in ("shed", "too_long"):
        return "shed"
    if status != STATUS_OK:
        if status == 429 and error:
            return "refused:" + refusal_cause(error)
        return "failed"
    if error:
        return "failed"
    ttft = rec.get("ttft_s")
    if ttft is None:
        return "failed"
    if ttft * 1000.0 > _num(rec.get("slo_ttft_ms"), math.inf):
        return "late_ttft"
    tpot = rec.get("tpot_s")
    if tpot is not None and tpot * 1000.0 > _num(rec.get("slo_tpot_ms"), math.inf):
        return "late_tpot"
    return "met"


def _engine(rec: dict) -> str:
    return rec.get("engine") or "-"


def _num(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) else default


def size_edges(records: Sequence[dict], bins: int = SIZE_BINS) -> list[int]:
    """Prompt-size bin edges: the quantiles of the records' input tokens (distinct, ascending)."""
    sizes = sorted(int(r.get("input_tokens") or 0) for r in records)
    edges = {sizes[len(sizes) * k // bins] for k in range(1, bins)}
    return sorted(e for e in edges if e > sizes[0])


def _size_label(tokens: int, edges: Sequence[int]) -> str:
    lo = 0
    for e in edges:
        if tokens < e:
            return f"{lo}-{e - 1} tok"
        lo = e
    return f">={lo} tok"


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {f"p{round(100 * q)}": round(percentile(values, q), 3) for q in (0.1, 0.5, 0.9)}


def _group(
    records: Iterable[dict], key: Callable[[dict], object], order: Sequence[str] = ()
) -> dict[str, dict]:
    """Requests, met and outcomes per group (``key(record)`` names the group), the groups in
    ``order`` first, then as they come."""
    groups: dict[str, dict] = {}
    for name in order:
        groups[name] = {"requests": 0, "met": 0, "outcomes": Counter()}
    for r in records:
        g = groups.setdefault(str(key(r)), {"requests": 0, "met": 0, "outcomes": Counter()})
        g["requests"] += 1
        g["met"] += met(r)
        g["outcomes"][outcome(r)] += 1
    groups = {name: g for name, g in groups.items() if g["requests"]}
    for g in groups.values():
        g["attainment"] = round(g["met"] / g["requests"], 6)
        g["outcomes"] = dict(g["outcomes"].most_common())
    return groups


def summarize(records: Sequence[dict], edges: Sequence[int] | None = None) -> dict:
    """One run's requests: attainment, outcomes, and both by kind (when there are several), by
    prompt size (``edges``: bin edges in tokens; default the quartiles of these records), by
    engine (with its hit rate: cached over prompt tokens of what it served) and by time; and,
    where the router's predictions are recorded, observed over predicted TTFT of the served
    requests and how many predicted in time missed."""
    if edges is None:
        edges = size_edges(records)
    n = len(records)
    out: dict = {
        "requests": n,
        "attainment": round(sum(met(r) for r in records) / n, 6),
        "outcomes": dict(Counter(outcome(r) for r in records).most_common()),
    }
    kinds = {r.get("kind") for r in records}
    if len(kinds) > 1:
        out["by_kind"] = _group(records, lambda r: r.get("kind"))
    sizes = [_size_label(e - 1, edges) for e in edges] + [
        _size_label(edges[-1] if edges else 0, edges)
    ]
    out["by_size"] = _group(
        records, lambda r: _size_label(int(r.get("input_tokens") or 0), edges), sizes
    )
    by_engine = _group(records, _engine)
    prompt: Counter[str] = Counter()  # the prompt and cached tokens each engine served
    cached: Counter[str] = Counter()
    for r in records:
        if r.get("status") == STATUS_OK:
            prompt[_engine(r)] += int(r.get("prompt_tokens") or r.get("input_tokens") or 0)
            cached[_engine(r)] += int(r.get("cached_tokens") or 0)
    for eid, g in by_engine.items():
        g["hit_rate"] = round(cached[eid] / prompt[eid], 4) if prompt[eid] else None
    out["by_engine"] = dict(sorted(by_engine.items()))
    t0 = min(_num(r.get("arrival"), 0.0) for r in records)
    span = max(_num(r.get("arrival"), 0.0) for r in records) - t0
    width = span / TIME_BINS if span > 0 else 1.0

    def time_bin(r: dict) -> str:
        k = min(int((_num(r.get("arrival"), 0.0) - t0) / width), TIME_BINS - 1)
        return f"{t0 + k * width:.1f}-{t0 + (k + 1) * width:.1f} s"

    out["by_time"] = _group(sorted(records, key=lambda r: _num(r.get("arrival"), 0.0)), time_bin)
    predicted = [r for r in records if r.get("predicted_ttft_ms")]
    if predicted:
        ratios = [
            r["ttft_s"] * 1000.0 / r["predicted_ttft_ms"]
            for r in predicted
            if r.get("status") == STATUS_OK and r.get("ttft_s") is not None
        ]
        in_time = [r for r in predicted if r["predicted_ttft_ms"] <= _num(r.get("slo_ttft_ms"), 0)]
        out["prediction"] = {
            "observed_over_predicted": _quantiles(ratios),
            "predicted_in_time": len(in_time),
            "of_which_missed": sum(1 for r in in_time if not met(r)),
        }
    return out


def compare(base: Sequence[dict], other: Sequence[dict]) -> dict:
    """Two runs of the same requests (matched by ``request_id``): the requests each met and the
    other did not, how the other lost them, and their cached tokens in each run."""
    by_id = {r["request_id"]: r for r in base}
    pairs = [(by_id[r["request_id"]], r) for r in other if r["request_id"] in by_id]
    if not pairs:
        raise RecordsError("the two runs share no request_id: not the same requests")
    only_base = [(a, b) for a, b in pairs if met(a) and not met(b)]
    only_other = [(a, b) for a, b in pairs if met(b) and not met(a)]

    def side(lost: list[tuple[dict, dict]], loser: int) -> dict:
        winner = 1 - loser
        served = [p for p in lost if p[loser].get("status") == STATUS_OK]
        return {
            "requests": len(lost),
            "lost_as": dict(Counter(outcome(p[loser]) for p in lost).most_common()),
            "mean_input_tokens": _mean(int(p[0].get("input_tokens") or 0) for p in lost),
            # the prefix the winner found cached; the loser's, over those it served (late)
            "cached_tokens_winner": _mean(int(p[winner].get("cached_tokens") or 0) for p in lost),
            "cached_tokens_loser_served": _mean(
                int(p[loser].get("cached_tokens") or 0) for p in served
            ),
            "by_kind": dict(Counter(p[0].get("kind") for p in lost).most_common()),
        }

    return {
        "common": len(pairs),
        "met_only_by_base": side(only_base, 1),
        "met_only_by_other": side(only_other, 0),
    }


def _mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return round(sum(vals) / len(vals), 1) if vals else None


# ---------------------------------------------------------------------------- text


def _outcomes_text(outcomes: dict[str, int], n: int) -> str:
    return ", ".join(f"{k} {v} ({100 * v / n:.1f}%)" for k, v in outcomes.items())


def _table(title: str, groups: dict[str, dict], extra: str = "") -> list[str]:
    lines = [f"  {title}:"]
    for name, g in groups.items():
        more = ""
        if extra and g.get(extra) is not None:
            more = f"  {extra.replace('_', ' ')} {100 * g[extra]:.1f}%"
        misses = {k: v for k, v in g["outcomes"].items() if k != "met"}
        lost = ", ".join(f"{k} {v}" for k, v in misses.items()) or "-"
        lines.append(
            f"    {name:<18} {g['requests']:>5} requests  SLO {100 * g['attainment']:5.1f}%{more}"
            f"  lost: {lost}"
        )
    return lines


def format_summary(name: str, s: dict) -> str:
    """``summarize``'s figures as text."""
    lines = [
        f"{name}: {s['requests']} requests, SLO met {100 * s['attainment']:.1f}%",
        "  outcomes: " + _outcomes_text(s["outcomes"], s["requests"]),
    ]
    if "by_kind" in s:
        lines += _table("by kind", s["by_kind"])
    lines += _table("by prompt size", s["by_size"])
    lines += _table("by engine", s["by_engine"], "hit_rate")
    lines += _table("by arrival time", s["by_time"])
    p = s.get("prediction")
    if p:
        q = p["observed_over_predicted"]
        ratio = f"p10 {q['p10']} p50 {q['p50']} p90 {q['p90']}" if q else "none served"
        lines.append(
            f"  router's predicted TTFT: observed/predicted {ratio}; predicted within the SLO "
            f"{p['predicted_in_time']}, of which missed {p['of_which_missed']}"
        )
    return "\n".join(lines)


def format_compare(base: str, other: str, c: dict) -> str:
    """``compare``'s figures as text."""
    lines = [f"{other} against {base} ({c['common']} requests in both):"]
    for key, winner, loser in (
        ("met_only_by_base", base, other),
        ("met_only_by_other", other, base),
    ):
        s = c[key]
        if not s["requests"]:
            lines.append(f"  met by {winner} only: none")
            continue
        lost = ", ".join(f"{k} {v}" for k, v in s["lost_as"].items())
        late = s["cached_tokens_loser_served"]
        lines.append(
            f"  met by {winner} only: {s['requests']} (mean prompt {s['mean_input_tokens']} "
            f"tokens, {s['cached_tokens_winner']} cached in {winner}"
            + (f", {late} in {loser} where it served them late" if late is not None else "")
            + f"); {loser} lost them as: {lost}"
        )
    return "\n".join(lines)


def report(paths: Sequence[Path]) -> tuple[str, dict]:
    """Each file summed up (prompt sizes binned alike: by the first file's quartiles), and
    every later file compared with the first; the text and the JSON-ready figures."""
    runs = [(p, load(p)) for p in paths]
    edges = size_edges(runs[0][1])
    # each file by its name, or its folder and name where two share a name (two runs of one
    # cell, recorded to two folders)
    names = [p.name for p in paths]
    label = {p: p.name if names.count(p.name) == 1 else f"{p.parent.name}/{p.name}" for p in paths}
    doc: dict = {"runs": {}, "comparisons": {}}
    texts: list[str] = []
    for path, recs in runs:
        s = summarize(recs, edges)
        doc["runs"][str(path)] = s
        texts.append(format_summary(label[path], s))
    base_path, base = runs[0]
    for path, recs in runs[1:]:
        c = compare(base, recs)
        doc["comparisons"][str(path)] = c
        texts.append(format_compare(label[base_path], label[path], c))
    return "\n\n".join(texts), doc
