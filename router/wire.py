"""JSON shapes of the router's HTTP API (``POST /route``, ``POST /report``, ``GET /engines``),
shared by :mod:`router.service` and :mod:`router.client`. Pure.

The routing key travels base64-encoded in ``key_b64`` (JSON cannot carry raw bytes, and a
multipart body would cost more than the 33% of base64). Parsing validates every field and raises
:class:`WireError` naming the field, which the service turns into a 400.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, cast, get_args

from kvgate.slo import Slo
from router.api import Candidate, Decision, EngineInfo, Outcome, Reason, RouteRequest

OUTCOMES = frozenset(get_args(Outcome))
REASONS = frozenset(get_args(Reason))
MAX_KEY_BYTES = 64 << 20


class WireError(ValueError):
    """A request body that does not fit the API; ``field`` names the culprit."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _str(body: dict, name: str, *, optional: bool = False, max_len: int = 1024) -> str | None:
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or (not v and not optional) or len(v) > max_len:
        raise WireError(f"{name} must be a string of at most {max_len} chars", name)
    return v


def _int(body: dict, name: str, default: int | None = None) -> int:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise WireError(f"{name} must be a non-negative integer", name)
    return v


def _ms(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise WireError(f"{name} must be a positive number of milliseconds", name)
    return float(v)


def request_to_json(req: RouteRequest) -> dict:
    return {
        "request_id": req.request_id,
        "model": req.model,
        "key_b64": base64.b64encode(req.key).decode("ascii"),
        "input_tokens": req.input_tokens,
        "max_tokens": req.max_tokens,
        "slo": {"ttft_ms": req.slo.ttft_ms, "tpot_ms": req.slo.tpot_ms, "name": req.slo.name},
        "session": req.session,
        "exclude": sorted(req.exclude),
        "prefilled_on": req.prefilled_on,
    }


def request_from_json(body: Any) -> RouteRequest:
    if not isinstance(body, dict):
        raise WireError("body must be a JSON object", "body")
    raw = body.get("key_b64")
    if not isinstance(raw, str) or len(raw) > MAX_KEY_BYTES * 4 // 3 + 4:
        raise WireError("key_b64 must be a base64 string", "key_b64")
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise WireError("key_b64 is not valid base64", "key_b64") from None
    slo_raw = body.get("slo")
    kwargs: dict[str, Any] = {}
    if slo_raw is not None:
        if not isinstance(slo_raw, dict):
            raise WireError("slo must be an object with ttft_ms and tpot_ms", "slo")
        name = slo_raw.get("name", "custom")
        if not isinstance(name, str) or len(name) > 64:
            raise WireError("slo.name must be a short string", "slo.name")
        kwargs["slo"] = Slo(
            _ms(slo_raw.get("ttft_ms"), "slo.ttft_ms"),
            _ms(slo_raw.get("tpot_ms"), "slo.tpot_ms"),
            name,
        )
    exclude = body.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise WireError("exclude must be a list of engine ids", "exclude")
    return RouteRequest(
        request_id=_str(body, "request_id") or "",
        model=_str(body, "model", optional=True) or "",
        key=key,
        input_tokens=_int(body, "input_tokens", 0),
        max_tokens=_int(body, "max_tokens", 0),
        session=_str(body, "session", optional=True),
        exclude=frozenset(exclude),
        prefilled_on=_str(body, "prefilled_on", optional=True),
        **kwargs,
    )


def decision_to_json(d: Decision) -> dict:
    return {
        "engine_id": d.engine_id,
        "url": d.url,
        "reason": d.reason,
        "policy": d.policy,
        "matched_bytes": d.matched_bytes,
        "retry_after_s": d.retry_after_s,
        "detail": d.detail,
        "header": d.header_value(),
        "decode_engine_id": d.decode_engine_id,
        "decode_url": d.decode_url,
        "kv_transfer_ms": d.kv_transfer_ms,
        "candidates": [
            {
                "engine_id": c.engine_id,
                "matched_bytes": c.matched_bytes,
                "load_ms": c.load_ms,
                "eviction_ms": c.eviction_ms,
                "prefill_ms": c.prefill_ms,
                "feasible": c.feasible,
            }
            for c in d.candidates
        ],
    }


def decision_from_json(body: Any) -> Decision:
    if not isinstance(body, dict):
        raise WireError("decision must be a JSON object", "body")
    reason = body.get("reason")
    if reason not in REASONS:
        raise WireError(f"unknown reason {reason!r}", "reason")
    try:
        cands = tuple(
            Candidate(
                str(c["engine_id"]),
                int(c["matched_bytes"]),
                float(c.get("load_ms", 0.0)),
                float(c.get("eviction_ms", 0.0)),
                float(c.get("prefill_ms", 0.0)),
                bool(c.get("feasible", True)),
            )
            for c in body.get("candidates") or ()
        )
        retry = body.get("retry_after_s")
        return Decision(
            engine_id=body.get("engine_id"),
            url=body.get("url"),
            reason=cast(Reason, reason),
            policy=str(body.get("policy", "")),
            matched_bytes=int(body.get("matched_bytes", 0)),
            listing=cands,
            retry_after_s=None if retry is None else float(retry),
            detail=str(body.get("detail", "")),
            decode_engine_id=_str(body, "decode_engine_id", optional=True),
            decode_url=_str(body, "decode_url", optional=True, max_len=2048),
            kv_transfer_ms=float(body.get("kv_transfer_ms") or 0.0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed decision: {exc}", "candidates") from None


def report_to_json(
    request_id: str, engine_id: str, outcome: Outcome, output_tokens: int = 0, max_tokens: int = 0
) -> dict:
    body: dict = {"request_id": request_id, "engine_id": engine_id, "outcome": outcome}
    if output_tokens and max_tokens:
        body["output_tokens"] = output_tokens
        body["max_tokens"] = max_tokens
    return body


def report_from_json(body: Any) -> tuple[str, str, Outcome, int, int]:
    """``POST /report``: the request, its engine, how it ended and (optional, 0: unknown) its
    answer's length and the cap its request stated."""
    if not isinstance(body, dict):
        raise WireError("body must be a JSON object", "body")
    outcome = body.get("outcome")
    if outcome not in OUTCOMES:
        raise WireError(f"outcome must be one of {', '.join(sorted(OUTCOMES))}", "outcome")
    counts = []
    for name in ("output_tokens", "max_tokens"):
        v = body.get(name, 0)
        if type(v) is not int or not 0 <= v <= MAX_REPORTED_TOKENS:
            raise WireError(f"{name} must be an integer from 0 to {MAX_REPORTED_TOKENS}", name)
        counts.append(v)
    return (
        _str(body, "request_id") or "",
        _str(body, "engine_id") or "",
        cast(Outcome, outcome),
        counts[0],
        counts[1],
    )


MAX_REPORTED_TOKENS = 100_000_000  # more is a wrong field, not a long answer


MAX_TTFT_MS = 86_400_000.0  # a day: a larger TTFT is a wrong unit, not a slow engine


def first_token_to_json(request_id: str, engine_id: str, ttft_ms: float) -> dict:
    return {"request_id": request_id, "engine_id": engine_id, "ttft_ms": ttft_ms}


def first_token_from_json(body: Any) -> tuple[str, str, float]:
    """``POST /first_token``: the request, its engine and the TTFT the gateway saw (ms)."""
    if not isinstance(body, dict):
        raise WireError("body must be a JSON object", "body")
    ttft = body.get("ttft_ms")
    if isinstance(ttft, bool) or not isinstance(ttft, (int, float)) or not 0 <= ttft <= MAX_TTFT_MS:
        raise WireError(f"ttft_ms must be a number of ms in [0, {MAX_TTFT_MS:.0f}]", "ttft_ms")
    return _str(body, "request_id") or "", _str(body, "engine_id") or "", float(ttft)


def engine_to_json(e: EngineInfo) -> dict:
    return {
        "engine_id": e.engine_id,
        "url": e.url,
        "models": list(e.models),
        "alive": e.alive,
        "draining": e.draining,
        "profile": e.profile,
        "static": e.static,
        "role": e.role,
    }


def engine_from_json(d: Any) -> EngineInfo:
    if not isinstance(d, dict):
        raise WireError("engine must be a JSON object", "engines")
    try:
        return EngineInfo(
            engine_id=str(d["engine_id"]),
            url=str(d["url"]),
            models=tuple(str(m) for m in d.get("models", ())),
            alive=bool(d["alive"]),
            draining=bool(d.get("draining", False)),
            profile=str(d.get("profile", "mistral-7b-a6000")),
            static=bool(d.get("static", False)),
            role=str(d.get("role", "both")),
        )
    except (KeyError, TypeError) as exc:
        raise WireError(f"malformed engine: {exc}", "engines") from None
