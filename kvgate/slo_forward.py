"""A request's SLO, carried from the gateway to a vLLM engine in a field vLLM passes through.

vLLM's OpenAI server copies the body field ``vllm_xargs`` (a flat object of strings and numbers)
into ``SamplingParams.extra_args``, which its scheduler sees on every request. The gateway
(``--forward-slo``) writes the SLO it parsed (:mod:`kvgate.slo`: headers, body ``slo``, or the
default class) there, with the gateway's request id so the engine's events name the request as
the router does; kvgate's scheduler plug-in (:mod:`kvgate.vllm`) reads it back. One home for the
format, both directions::

    "vllm_xargs": {"kvgate_slo_class": "chat", "kvgate_ttft_ms": 250.0,
                   "kvgate_tpot_ms": 100.0, "kvgate_request_id": "..."}

Modes: ``vllm`` writes ``vllm_xargs`` (and drops the body field ``slo``, which vLLM does not
know); ``vllm-priority`` also sets vLLM's ``priority`` to the TTFT SLO in whole milliseconds (for
engines run with ``--scheduling-policy priority``: a tighter TTFT is served first). A priority
the client set itself is kept. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from kvgate.slo import SLO_CLASSES, Slo, SloError, parse_slo

XARG_CLASS = "kvgate_slo_class"
XARG_TTFT = "kvgate_ttft_ms"
XARG_TPOT = "kvgate_tpot_ms"
XARG_REQUEST_ID = "kvgate_request_id"

ForwardMode = Literal["none", "vllm", "vllm-priority"]
FORWARD_MODES: tuple[ForwardMode, ...] = ("none", "vllm", "vllm-priority")


def slo_priority(slo: Slo) -> int:
    """vLLM's priority for a request (lower is served first): its TTFT SLO in whole ms."""
    return max(0, math.ceil(slo.ttft_ms))


def forward_body(body: Mapping[str, Any], slo: Slo, request_id: str, mode: ForwardMode) -> dict:
    """The body to send a vLLM engine: ``body`` with the SLO in ``vllm_xargs`` (see the module
    docstring). The client's own ``vllm_xargs`` are kept; kvgate's keys overwrite theirs."""
    if mode not in FORWARD_MODES:
        raise ValueError(f"forward mode must be one of {', '.join(FORWARD_MODES)}, got {mode!r}")
    out = dict(body)
    if mode == "none":
        return out
    out.pop("slo", None)
    xargs = out.get("vllm_xargs")
    merged = dict(xargs) if isinstance(xargs, Mapping) else {}
    merged[XARG_CLASS] = slo.name
    merged[XARG_TTFT] = slo.ttft_ms
    merged[XARG_TPOT] = slo.tpot_ms
    merged[XARG_REQUEST_ID] = request_id
    out["vllm_xargs"] = merged
    if mode == "vllm-priority" and out.get("priority") in (None, 0):
        out["priority"] = slo_priority(slo)
    return out


def slo_from_xargs(xargs: Mapping[str, Any] | None, default: Slo) -> tuple[Slo, str | None]:
    """The SLO and gateway request id ``forward_body`` wrote: a known class gives the base
    numbers, ``kvgate_ttft_ms``/``kvgate_tpot_ms`` override them, anything unset is
    ``default``'s. Raises :class:`kvgate.slo.SloError` for values that are not an SLO."""
    if not xargs:
        return default, None
    rid = xargs.get(XARG_REQUEST_ID)
    name = xargs.get(XARG_CLASS)
    known = isinstance(name, str) and name.strip().lower() in SLO_CLASSES
    numbers = {
        field: xargs[key]
        for field, key in (("ttft_ms", XARG_TTFT), ("tpot_ms", XARG_TPOT))
        if key in xargs
    }
    if name is not None and not known and not numbers:
        raise SloError(f"{XARG_CLASS} must be one of {', '.join(SLO_CLASSES)}", XARG_CLASS)
    base = SLO_CLASSES[name.strip().lower()] if known else default  # type: ignore[union-attr]
    slo = parse_slo({}, {"slo": numbers}, base)[0] if numbers else base
    if numbers and isinstance(name, str) and name.strip():
        slo = Slo(slo.ttft_ms, slo.tpot_ms, name.strip()[:64])
    return slo, rid if isinstance(rid, str) and rid else None
