"""Fit a cost profile from measured timings (``kvgate engine fit-profile``).

Input: JSON Lines, one measurement per line, of two kinds (extra keys are ignored)::

    {"new_tokens": 2048, "context_tokens": 0, "prefill_ms": 231.5}
    {"batch": 32, "mean_context": 1500, "step_ms": 27.1}

(``ms`` may stand for either time). A prefill row is one prefill of ``new_tokens`` after
``context_tokens`` cached tokens on an otherwise idle engine, e.g. the TTFT of a lone request to a
real vLLM; a decode row is one decode step with ``batch`` running requests of mean context
``mean_context``, e.g. the inter-token gap while exactly that many requests stream.

Model fit by least squares (:func:`engine.costs.least_squares`):

* prefill: ``p0 + p1 n + p2 n^2 + a_c c + a_nc n c`` (``--prefill-degree 1`` drops ``n^2``),
  written as one segment from 0 tokens, an attention term applied whenever ``n c > 0``, and
  efficiency 1;
* decode: SCORPIO's ``a B L + b B + c L + d``, every coefficient >= 0 (a step never shortens
  with more requests or more context).

Capacity fields (KV blocks, block size, token rule, limits) come from a base profile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from engine.costs import least_squares, nonnegative_least_squares
from kvgate.cost_model import CostProfile, PrefillSegment, ProfileError


class FitError(ValueError):
    """The measurements cannot determine a profile (too few, malformed, degenerate)."""


@dataclass(frozen=True, slots=True)
class Samples:
    prefill: list[tuple[float, float, float]]  # (new_tokens, context_tokens, ms)
    decode: list[tuple[float, float, float]]  # (batch, mean_context, ms)


def _num(row: dict, *names: str) -> float | None:
    for name in names:
        v = row.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise FitError(f"{name} must be a finite number, got {v!r}")
            return float(v)
    return None


def read_samples(lines: Iterable[bytes | str]) -> Samples:
    """Parse the JSONL format of the module docstring; FitError names the bad line."""
    prefill: list[tuple[float, float, float]] = []
    decode: list[tuple[float, float, float]] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            if not isinstance(row, dict):
                raise FitError("each line must be a JSON object")
            if "new_tokens" in row:
                n = _num(row, "new_tokens")
                c = _num(row, "context_tokens") or 0.0
                ms = _num(row, "prefill_ms", "ms")
                if n is None or ms is None or n <= 0 or c < 0 or ms < 0:
                    raise FitError("a prefill row needs new_tokens > 0 and prefill_ms >= 0")
                prefill.append((n, c, ms))
            elif "batch" in row:
                b = _num(row, "batch")
                ctx = _num(row, "mean_context")
                ms = _num(row, "step_ms", "ms")
                if b is None or ctx is None or ms is None or b <= 0 or ctx < 0 or ms < 0:
                    raise FitError("a decode row needs batch > 0, mean_context and step_ms")
                decode.append((b, ctx, ms))
            else:
                raise FitError("a row needs new_tokens (prefill) or batch (decode)")
        except orjson.JSONDecodeError as exc:
            raise FitError(f"line {no}: invalid JSON: {exc}") from None
        except FitError as exc:
            raise FitError(f"line {no}: {exc}") from None
    return Samples(prefill, decode)


def _rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def fit_profile(
    samples: Samples, name: str, base: CostProfile, *, prefill_degree: int = 2
) -> tuple[CostProfile, dict[str, float]]:
    """The fitted profile and its fit quality (RMS error in ms per kind)."""
    if prefill_degree not in (1, 2):
        raise FitError("prefill degree must be 1 or 2")
    has_context = any(c > 0 for _, c, _ in samples.prefill)
    n_prefill = prefill_degree + 1 + (2 if has_context else 0)
    if len(samples.prefill) < n_prefill:
        raise FitError(f"need at least {n_prefill} prefill rows, got {len(samples.prefill)}")
    if len(samples.decode) < 4:
        raise FitError(f"need at least 4 decode rows, got {len(samples.decode)}")

    def prefill_row(n: float, c: float) -> list[float]:
        row = [1.0, n] + ([n * n] if prefill_degree == 2 else [])
        return row + ([c, n * c] if has_context else [])

    try:
        pc = least_squares(
            [prefill_row(n, c) for n, c, _ in samples.prefill],
            [ms for _, _, ms in samples.prefill],
        )
        dc = nonnegative_least_squares(  # (a step never shortens with more of either)
            [(b * ctx, b, ctx, 1.0) for b, ctx, _ in samples.decode],
            [ms for _, _, ms in samples.decode],
        )
    except ValueError as exc:
        raise FitError(f"the measurements do not determine the model: {exc}") from None
    seg = tuple(pc[: prefill_degree + 1])
    attn_c, attn_nc = (pc[-2], pc[-1]) if has_context else (0.0, 0.0)
    try:  # (the profile refuses a prefill curve that turns down within its checked range)
        profile = CostProfile(
            name=name,
            description=(
                f"Fit by kvgate engine fit-profile from {len(samples.prefill)} prefill and "
                f"{len(samples.decode)} decode measurements; capacity from {base.name}."
            ),
            segments=(PrefillSegment(0, seg),),
            attn_threshold=0.0,
            attn_n=0.0,
            attn_c=attn_c,
            attn_nc=attn_nc,
            efficiency=1.0,
            decode_a=dc[0],
            decode_b=dc[1],
            decode_c=dc[2],
            decode_d=dc[3],
            kv_blocks=base.kv_blocks,
            block_tokens=base.block_tokens,
            bytes_per_token=base.bytes_per_token,
            max_batch_tokens=base.max_batch_tokens,
            max_running=base.max_running,
        )
    except ProfileError as exc:
        raise FitError(
            f"the fitted prefill curve is not usable ({exc}); try --prefill-degree 1"
        ) from None
    quality = {
        "prefill_rms_ms": _rms([profile.prefill_ms(n, c) - ms for n, c, ms in samples.prefill]),
        "decode_rms_ms": _rms([profile.decode_step_ms(b, x) - ms for b, x, ms in samples.decode]),
    }
    return profile, quality
