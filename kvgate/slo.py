"""Per-request latency objectives: named classes, and parsing them from headers or the body.

A request states its SLO with headers (``x-kvgate-slo-class``, ``x-kvgate-ttft-ms``,
``x-kvgate-tpot-ms``) or a body field ``"slo": {"class": ..., "ttft_ms": ..., "tpot_ms": ...}``.
Explicit numbers override the class's; headers override the body; anything left unset comes
from the configured default class. Invalid values raise :class:`SloError` (a 400 upstream).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

HEADER_CLASS = "x-kvgate-slo-class"
HEADER_TTFT = "x-kvgate-ttft-ms"
HEADER_TPOT = "x-kvgate-tpot-ms"
SLO_HEADERS = (HEADER_CLASS, HEADER_TTFT, HEADER_TPOT)
MAX_SLO_MS = 3_600_000.0  # one hour: anything above is a typo, not an objective


class SloError(ValueError):
    """An SLO value that is not a valid objective; the message names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Slo:
    """Time to first token and time per output token objectives, in milliseconds."""

    ttft_ms: float
    tpot_ms: float
    name: str = "custom"


# FlowPrefill's QwenTrace task SLOs (TTFT, TBT) and SCORPIO's default tiers (TTFT, TPOT).
SLO_CLASSES: dict[str, Slo] = {
    "chat": Slo(250.0, 100.0, "chat"),
    "image": Slo(500.0, 100.0, "image"),
    "search": Slo(4000.0, 200.0, "search"),
    "file": Slo(6000.0, 200.0, "file"),
    "tier1": Slo(500.0, 50.0, "tier1"),
    "tier2": Slo(3000.0, 30.0, "tier2"),
    "tier3": Slo(15000.0, 50.0, "tier3"),
    "relaxed": Slo(60000.0, 1000.0, "relaxed"),
}
DEFAULT_SLO_CLASS = "relaxed"


# A number of milliseconds as text: ASCII digits, an optional fraction and exponent. Not what
# float() takes, which also reads "1_000", other scripts' digits, "nan" and "inf".
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _number(value: object, param: str) -> float:
    if isinstance(value, bool):
        raise SloError(f"{param} must be a number of milliseconds", param)
    if isinstance(value, str):
        text = value.strip(" \t")
        if _DECIMAL.fullmatch(text) is None:
            msg = f"{param} must be a number of milliseconds, got {value!r}"
            raise SloError(msg, param)
        value = float(text)
    if not isinstance(value, (int, float)):
        raise SloError(f"{param} must be a number of milliseconds", param)
    value = float(value)
    if not math.isfinite(value) or value <= 0 or value > MAX_SLO_MS:
        raise SloError(f"{param} must be in (0, {MAX_SLO_MS:.0f}] ms, got {value}", param)
    return value


def _class(name: object, param: str) -> Slo:
    if not isinstance(name, str) or name.strip().lower() not in SLO_CLASSES:
        known = ", ".join(SLO_CLASSES)
        raise SloError(f"{param} must be one of {known}; got {name!r}", param)
    return SLO_CLASSES[name.strip().lower()]


def parse_slo(
    headers: Mapping[str, str], body: Mapping | None, default: Slo | None = None
) -> tuple[Slo, bool]:
    """The request's SLO and whether the client stated any part of it.

    ``headers`` must be case-insensitive (aiohttp's are) or lower-cased.
    """
    base = default or SLO_CLASSES[DEFAULT_SLO_CLASS]
    ttft: float | None = None
    tpot: float | None = None
    name: str | None = None
    stated = False
    raw = body.get("slo") if isinstance(body, Mapping) else None
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise SloError("slo must be an object with class, ttft_ms or tpot_ms", "slo")
        unknown = set(raw) - {"class", "ttft_ms", "tpot_ms"}
        if unknown:
            raise SloError(f"unknown slo fields: {', '.join(sorted(map(str, unknown)))}", "slo")
        if "class" in raw:
            base = _class(raw["class"], "slo.class")
            name = base.name
        if "ttft_ms" in raw:
            ttft = _number(raw["ttft_ms"], "slo.ttft_ms")
        if "tpot_ms" in raw:
            tpot = _number(raw["tpot_ms"], "slo.tpot_ms")
        stated = True
    if (v := headers.get(HEADER_CLASS)) is not None:
        base = _class(v, HEADER_CLASS)
        name = base.name
        stated = True
    if (v := headers.get(HEADER_TTFT)) is not None:
        ttft = _number(v, HEADER_TTFT)
        stated = True
    if (v := headers.get(HEADER_TPOT)) is not None:
        tpot = _number(v, HEADER_TPOT)
        stated = True
    if ttft is not None or tpot is not None:
        name = name or "custom"
    return (
        Slo(
            ttft if ttft is not None else base.ttft_ms,
            tpot if tpot is not None else base.tpot_ms,
            name or base.name,
        ),
        stated,
    )
