"""The one cost model: how long an engine takes to prefill and decode, and how tokens map to bytes.

Used alike by the router (Preble's P and L terms), kvgate's simulated engine (how long to sleep)
and the simulator. Profiles are data: JSON files in ``kvgate/profiles/``, one per engine type,
fit from measurements (``kvgate engine fit-profile``).

Prefill time for ``n`` new tokens after ``c`` cached tokens of context, in ms (Preble's shape)::

    base(n)  = polynomial of the first segment whose min_tokens <= n
    attn(n,c) = a_n n + a_c c + a_nc n c      when n c > attn_threshold, else 0
    prefill(n, c) = (base(n) + attn(n, c)) / efficiency

Default profile (Preble, Mistral-7B on A6000): segments ``n >= 165: 0.10842571 n + 4.2098``,
else 22; attention term ``1.13e-3 n + 1.75e-3 c + 2.19e-6 n c`` when ``n c > 1024^2``;
efficiency 0.9. Preble's released fit has a third piece, ``-118 + 1.25 n - 2.56e-3 n^2`` for
``192 <= n < 384`` (its linear one starting at 384), which falls from 33 ms at 200 tokens to 0
at 381: a fit artefact (a prefill never gets faster with more tokens) that let the simulated
engine run such batches for free and the router predict them free. kvgate extends the linear
piece down to where it meets the 22-ms floor instead, and rejects any profile whose prefill
time falls as tokens grow.

A prompt prefilled in chunks of at most ``K`` new tokens (chunked prefill: vLLM's token budget a
step, FlowPrefill's 8K chunks) runs each chunk with the earlier ones as its context, so it costs
the chunks' sum, ``prompt_prefill(n, c, K) = sum_i prefill(k_i, c + k_1 + ... + k_{i-1})``: the
same as ``prefill(n, c)`` up to ``K`` tokens, about 1.1x it at 16K tokens in 8K chunks, 1.6x at
64K and 2.3x at 128K on the default profile (``CostProfile.prompt_prefill_ms``).

Decode step time for a batch of ``B`` requests with mean context ``L`` tokens, in ms (SCORPIO's
``EstTPOT``)::

    decode_step(B, L) = a B L + b B + c L + d

The default decode fit is derived from memory traffic, not measured here: Mistral-7B in fp16 reads
~14.5 GB of weights per step on an A6000 (768 GB/s): d = 19 ms; its KV cache is 128 KiB per token
(32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes): a = 1.7e-4 ms per token of context per
request; b = 0.08 ms of per-sequence work; c = 0. Replace it with a fit from a real engine.

Speed variants: ``NAME@xK`` names profile ``NAME`` with every time multiplied by ``K`` (``@x2``:
an engine twice as slow, ``@x0.5`` twice as fast), e.g. for a heterogeneous simulated fleet;
``K`` from ``MIN_SPEED_FACTOR`` (0.01) to ``MAX_SPEED_FACTOR`` (100).

Every number of a profile is finite and a one-token prefill takes time: profiles also come off
the wire (an engine's heartbeat), and one priced free takes every request.

Token rule (shared with the router): a request's token count is ``ceil(len(key_bytes) /
bytes_per_token)``, at least 1; kvgate's engine caches blocks of ``block_tokens`` tokens, i.e.
``block_bytes = block_tokens x bytes_per_token`` bytes of the key.
"""

from __future__ import annotations

import importlib.resources
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from pathlib import Path

import orjson

from broker.events import MAX_PROFILE_CHARS

# (from the package, not ``__file__``: a compiled build's ``__file__`` is the build's relative
# source path)
PROFILE_DIR = Path(str(importlib.resources.files("kvgate"))) / "profiles"
DEFAULT_PROFILE = "mistral-7b-a6000"


MONOTONE_CHECK_TOKENS = 131_072  # prefill curves are checked to grow up to here
# NAME@xK: the speed factors a profile variant may have (an engine 100x off its profile is
# another engine type; 1e-300 made one engine look free and take every request)
MIN_SPEED_FACTOR = 0.01
MAX_SPEED_FACTOR = 100.0
# what no engine's profile holds: a profile comes off the wire too (inline JSON in a heartbeat),
# and finite but absurd figures (a block of 1e308 tokens, a decode step of 1e308 ms) overflowed
# the router's arithmetic and failed every decision of the fleet
MAX_COEFFICIENT = 1e9  # any time coefficient's magnitude (ms and ms per token)
EFFICIENCY_RANGE = (1e-6, 1e6)
PROFILE_INT_LIMITS = {
    "kv_blocks": 1 << 40,
    "block_tokens": 1 << 16,
    "bytes_per_token": 64,
    "max_batch_tokens": 1 << 30,
    "max_running": 1 << 30,
}


class ProfileError(ValueError):
    """A cost profile that is missing or malformed."""


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """``sum(coef[i] * n**i)`` ms for ``n >= min_tokens`` (until the next segment's minimum)."""

    min_tokens: int
    coef: tuple[float, ...]


def segments_ms(segments: tuple[PrefillSegment, ...], n: float) -> float:
    """The polynomial of the first segment whose ``min_tokens <= n``, at ``n`` new tokens (no
    context, before efficiency; may be negative: :meth:`CostProfile.prefill_ms` clamps)."""
    base = 0.0
    for seg in segments:
        if n >= seg.min_tokens:
            p = 1.0
            for k in seg.coef:
                base += k * p
                p *= n
            break
    return base


@lru_cache(maxsize=256)  # (bounded: a curve may come off the wire, inline in a profile)
def first_fall(segments: tuple[PrefillSegment, ...]) -> tuple[int, float, int, float] | None:
    """Where a prefill curve falls as tokens grow: ``(n1, base at n1, n2, base at n2)`` with
    ``n1 < n2`` and a lower base at ``n2``, or None. Checked at every token count to 1,024 and
    at each segment's boundary, then every 16 tokens to ``MONOTONE_CHECK_TOKENS`` (once per
    distinct curve: speed variants and refits share it)."""
    points = set(range(1, 1025)) | set(range(1024, MONOTONE_CHECK_TOKENS + 1, 16))
    for seg in segments:
        if seg.min_tokens > 0:
            points |= {seg.min_tokens - 1, seg.min_tokens}
    prev_n, prev = 0, 0.0
    for n in sorted(points):
        cur = max(segments_ms(segments, n), 0.0)
        if cur < prev - 1e-9 * max(prev, 1.0):
            return prev_n, prev, n, cur
        prev_n, prev = n, cur
    return None


@dataclass(frozen=True, slots=True)
class CostProfile:
    """How fast one type of engine is (see the module docstring for the formulas)."""

    name: str
    segments: tuple[PrefillSegment, ...]  # sorted by min_tokens, descending
    attn_threshold: float = 1024.0**2
    attn_n: float = 1.13e-3
    attn_c: float = 1.75e-3
    attn_nc: float = 2.19e-6
    efficiency: float = 0.9
    decode_a: float = 1.7e-4
    decode_b: float = 0.08
    decode_c: float = 0.0
    decode_d: float = 19.0
    kv_blocks: int = 14_000
    block_tokens: int = 16
    bytes_per_token: int = 4
    max_batch_tokens: int = 4096
    max_running: int = 256
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ProfileError("profile needs a name")
        if not self.segments:
            raise ProfileError(f"{self.name}: at least one prefill segment")
        if sorted(self.segments, key=lambda s: -s.min_tokens) != list(self.segments):
            raise ProfileError(f"{self.name}: segments must be sorted by min_tokens, descending")
        if self.segments[-1].min_tokens != 0:
            raise ProfileError(f"{self.name}: the last segment must start at 0 tokens")
        # Every number finite: a profile comes off the wire too (inline JSON in a heartbeat),
        # and an efficiency of inf (or a coefficient of -inf, or nan) made an engine's every
        # prefill free, so it took all the traffic.
        for value, what in (
            (self.efficiency, "efficiency"),
            (self.attn_threshold, "attention threshold"),
            *self._prefill_coefficients(),
        ):
            if not math.isfinite(value):
                raise ProfileError(f"{self.name}: {what} = {value!r}: must be a finite number")
        for value, what in (
            (self.efficiency, "efficiency"),
            (self.kv_blocks, "kv_blocks"),
            (self.block_tokens, "block_tokens"),
            (self.bytes_per_token, "bytes_per_token"),
            (self.max_batch_tokens, "max_batch_tokens"),
            (self.max_running, "max_running"),
        ):
            if not value > 0:
                raise ProfileError(f"{self.name}: {what} must be positive")
        self._check_plausible()
        self._check_prefill_grows()
        if not segments_ms(self.segments, 1) > 0:
            raise ProfileError(
                f"{self.name}: a one-token prefill takes {segments_ms(self.segments, 1)!r} ms: "
                "a prefill must take time (a curve below 0 is priced free at every length)"
            )
        self._check_decode_grows()

    def _prefill_coefficients(self) -> list[tuple[float, str]]:
        """The prefill curve's and the attention term's coefficients, each with its name."""
        return [
            (self.attn_n, "attention n"),
            (self.attn_c, "attention c"),
            (self.attn_nc, "attention nc"),
            *(
                (c, f"prefill coefficient {i} of segment {seg.min_tokens}")
                for seg in self.segments
                for i, c in enumerate(seg.coef)
            ),
        ]

    def _check_plausible(self) -> None:
        """Reject figures no engine has (``MAX_COEFFICIENT``, ``EFFICIENCY_RANGE``,
        ``PROFILE_INT_LIMITS``): finite, they still overflowed the router's arithmetic."""
        lo, hi = EFFICIENCY_RANGE
        if not lo <= self.efficiency <= hi:
            raise ProfileError(
                f"{self.name}: efficiency = {self.efficiency!r}: must be from {lo:g} to {hi:g}"
            )
        for value, what in (
            *self._prefill_coefficients(),
            (self.decode_a, "decode coefficient a"),
            (self.decode_b, "decode coefficient b"),
            (self.decode_c, "decode coefficient c"),
            (self.decode_d, "decode coefficient d"),
        ):
            if abs(value) > MAX_COEFFICIENT:
                raise ProfileError(
                    f"{self.name}: {what} = {value!r}: beyond {MAX_COEFFICIENT:g} (no engine's)"
                )
        for what, limit in PROFILE_INT_LIMITS.items():
            value = getattr(self, what)
            whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if not whole or value > limit:
                raise ProfileError(
                    f"{self.name}: {what} = {value!r}: must be a whole number up to {limit}"
                )

    def _check_prefill_grows(self) -> None:
        """Reject a prefill curve that falls as tokens grow (:func:`first_fall`): Preble's
        released fit did, to 0 ms near 383 tokens, and a simulated engine ran such batches for
        free while the router predicted them free."""
        fall = first_fall(self.segments)
        if fall is not None:
            n1, ms1, n2, ms2 = fall
            eff = self.efficiency
            raise ProfileError(
                f"{self.name}: prefill time falls as tokens grow ({ms1 / eff:.2f} ms at {n1} "
                f"tokens, {ms2 / eff:.2f} ms at {n2}): correct the segments or refit "
                "(kvgate engine fit-profile)"
            )

    def _check_decode_grows(self) -> None:
        """Reject a decode step that shortens as requests or context grow: every coefficient
        of ``a B L + b B + c L + d`` >= 0. ``vllm-cpu-tiny`` was fit with ``a`` < 0 on noisy
        steps: a request's share of a step (``a L + b``) fell below 0 past 410 tokens of
        context, the router priced long requests' decode below nothing, and on Mooncake's
        prompts every engine's cost fell outside the tie band and e2 had no engine to pick."""
        for value, what in (
            (self.decode_a, "a"),
            (self.decode_b, "b"),
            (self.decode_c, "c"),
            (self.decode_d, "d"),
        ):
            if not (value >= 0.0 and math.isfinite(value)):
                raise ProfileError(
                    f"{self.name}: decode coefficient {what} = {value!r}: every decode "
                    "coefficient must be a finite number >= 0 (a step never shortens with more "
                    "requests or more context); refit (kvgate engine fit-profile)"
                )

    # ------------------------------------------------------------------ prefill

    def prefill_ms(self, new_tokens: float, context_tokens: float = 0.0) -> float:
        """Time to prefill ``new_tokens`` after ``context_tokens`` already cached, in ms."""
        n = max(float(new_tokens), 0.0)
        if n <= 0:
            return 0.0
        c = max(float(context_tokens), 0.0)
        base = segments_ms(self.segments, n)
        if n * c > self.attn_threshold:
            base += self.attn_n * n + self.attn_c * c + self.attn_nc * n * c
        return max(base, 0.0) / self.efficiency

    def prompt_prefill_ms(
        self, new_tokens: float, context_tokens: float = 0.0, chunk_tokens: int = 0
    ) -> float:
        """Time to prefill one prompt's ``new_tokens`` after ``context_tokens`` cached, on an
        engine that prefills a prompt in pieces of at most ``chunk_tokens`` new tokens (0: in
        one): each piece attends to the context before it, the earlier pieces included, so a
        long prompt costs more chunked than :meth:`prefill_ms` of it in one piece (a 24k-token
        prompt in 8k pieces on the default profile: about 20% more)."""
        n = max(float(new_tokens), 0.0)
        if chunk_tokens <= 0 or n <= chunk_tokens:
            return self.prefill_ms(n, context_tokens)
        c = max(float(context_tokens), 0.0)
        k = float(chunk_tokens)
        whole = int(n // k)  # whole pieces, after contexts c, c + k, ..., c + (whole - 1) k
        # summed in closed form (a prompt of a million tokens in 16-token pieces costs no more
        # to price than one piece): each whole piece costs the same without attention, and
        # attends where k x its context passes the threshold, from the first such piece on
        over = (self.attn_threshold / k - c) / k  # the pieces up to this index do not attend
        first = 0 if over < 0.0 else min(math.floor(over) + 1, whole)
        attending = whole - first
        context_sum = attending * c + k * (first + whole - 1) * attending / 2.0
        base = whole * max(segments_ms(self.segments, k), 0.0)
        base += attending * self.attn_n * k + (self.attn_c + self.attn_nc * k) * context_sum
        rest = n - whole * k
        return base / self.efficiency + self.prefill_ms(rest, c + whole * k)

    def extra_prefill_ms(self, tokens: float, context_tokens: float = 0.0) -> float:
        """What ``tokens`` more (after ``context_tokens`` cached) add to a prefill that runs
        anyway, in ms: their share of a prefill long enough to be on the curve's last segment,
        and their attention to the context, without the fixed cost every prefill pays. The
        price of evicting them (Preble's M): the request that finds them evicted prefills them
        with its own part (on the default profile a 32-token block adds 3.9 ms to a long
        prefill, against 24 ms as a prefill alone)."""
        t = max(float(tokens), 0.0)
        if t <= 0:
            return 0.0
        start = self.segments[0].min_tokens  # (sorted by min_tokens, descending)
        base = segments_ms(self.segments, start + t) - segments_ms(self.segments, start)
        c = max(float(context_tokens), 0.0)
        if t * c > self.attn_threshold:
            base += self.attn_n * t + self.attn_nc * t * c
        return max(base, 0.0) / self.efficiency

    # ------------------------------------------------------------------ decode

    def decode_step_ms(self, batch: float, mean_context: float) -> float:
        """One decode step for ``batch`` requests of mean context ``mean_context`` tokens, in ms."""
        if batch <= 0:
            return 0.0
        return (
            self.decode_a * batch * mean_context
            + self.decode_b * batch
            + self.decode_c * mean_context
            + self.decode_d
        )

    def request_step_ms(self, context: float) -> float:
        """One request's part of a decode step at ``context`` tokens (``decode_step_ms`` less
        its fixed part, per request): what one more request adds to a step, and the size of
        its place in a batch."""
        return self.decode_a * context + self.decode_b

    def slowed(self, factor: float) -> CostProfile:
        """This profile with every prefill and decode time multiplied by ``factor`` (named
        ``NAME@xFACTOR``): the same engine type on hardware ``factor`` times slower."""
        if not MIN_SPEED_FACTOR <= factor <= MAX_SPEED_FACTOR:  # (also false for nan)
            raise ProfileError(
                f"{self.name}: a speed factor must be a positive number from "
                f"{MIN_SPEED_FACTOR:g} to {MAX_SPEED_FACTOR:g}, not {factor!r}"
            )
        if factor == 1:
            return self
        return replace(
            self,
            name=f"{self.name}@x{factor:g}",
            efficiency=self.efficiency / factor,
            decode_a=self.decode_a * factor,
            decode_b=self.decode_b * factor,
            decode_c=self.decode_c * factor,
            decode_d=self.decode_d * factor,
        )

    # ------------------------------------------------------------------ token rule

    @property
    def block_bytes(self) -> int:
        """Bytes of routing key covered by one KV block of kvgate's engine."""
        return self.block_tokens * self.bytes_per_token

    def tokens_for_bytes(self, n_bytes: int) -> int:
        """The documented token rule: ceil(bytes / bytes_per_token), at least 1 for a request."""
        return max(1, -(-int(n_bytes) // self.bytes_per_token))

    def kv_blocks_needed(self, key_bytes: int, input_tokens: int, output_tokens: int) -> int:
        """The KV blocks a request holds at its longest: its prompt and whole answer, and at
        least its key's whole blocks. More than ``kv_blocks`` and no engine of this profile can
        ever hold it (the live engine answers 400 before admission, its core refuses it, the
        router tells a shed of it apart)."""
        key_blocks = key_bytes // self.block_bytes
        return max(key_blocks, -(-(input_tokens + output_tokens) // self.block_tokens))

    def prompt_tokens(self, input_tokens: int, key_bytes: int) -> int:
        """A prompt's tokens on this engine: the count the request states, or the token rule on
        its key when that says more (a count of 0 or a stale one)."""
        return max(input_tokens, self.tokens_for_bytes(key_bytes))

    def cached_tokens_for_bytes(self, n_bytes: int) -> int:
        """Tokens covered by ``n_bytes`` of cached prefix (0 when nothing is cached)."""
        return int(n_bytes) // self.bytes_per_token

    # ------------------------------------------------------------------ data

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "prefill": {
                "segments": [
                    {"min_tokens": s.min_tokens, "coef": list(s.coef)} for s in self.segments
                ],
                "attn": {
                    "threshold": self.attn_threshold,
                    "n": self.attn_n,
                    "c": self.attn_c,
                    "nc": self.attn_nc,
                },
                "efficiency": self.efficiency,
            },
            "decode": {
                "a": self.decode_a,
                "b": self.decode_b,
                "c": self.decode_c,
                "d": self.decode_d,
            },
            "kv_blocks": self.kv_blocks,
            "block_tokens": self.block_tokens,
            "bytes_per_token": self.bytes_per_token,
            "max_batch_tokens": self.max_batch_tokens,
            "max_running": self.max_running,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        """Build from the JSON shape of :meth:`to_dict`; raises ProfileError with the reason."""
        try:
            pre = data["prefill"]
            attn = pre.get("attn", {})
            dec = data["decode"]
            segments = tuple(
                PrefillSegment(
                    _integer(s["min_tokens"], "min_tokens"),
                    tuple(_number(c, "prefill coefficient") for c in s["coef"]),
                )
                for s in pre["segments"]
            )
            return cls(
                name=str(data["name"]),
                description=str(data.get("description", "")),
                segments=tuple(sorted(segments, key=lambda s: -s.min_tokens)),
                attn_threshold=_number(attn.get("threshold", 1024.0**2), "attn.threshold"),
                attn_n=_number(attn.get("n", 0.0), "attn.n"),
                attn_c=_number(attn.get("c", 0.0), "attn.c"),
                attn_nc=_number(attn.get("nc", 0.0), "attn.nc"),
                efficiency=_number(pre.get("efficiency", 1.0), "efficiency"),
                decode_a=_number(dec["a"], "decode.a"),
                decode_b=_number(dec["b"], "decode.b"),
                decode_c=_number(dec["c"], "decode.c"),
                decode_d=_number(dec["d"], "decode.d"),
                kv_blocks=_integer(data["kv_blocks"], "kv_blocks"),
                block_tokens=_integer(data["block_tokens"], "block_tokens"),
                bytes_per_token=_integer(data.get("bytes_per_token", 4), "bytes_per_token"),
                max_batch_tokens=_integer(data.get("max_batch_tokens", 4096), "max_batch_tokens"),
                max_running=_integer(data.get("max_running", 256), "max_running"),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"malformed profile: {exc!r}") from exc


def _number(value: object, what: str) -> float:
    """A JSON number that is finite (float() took the strings "inf" and "nan", and bools)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{what} = {value!r}: must be a number")
    out = float(value)
    if not math.isfinite(out):
        raise ProfileError(f"{what} = {value!r}: must be a finite number")
    return out


def _integer(value: object, what: str) -> int:
    """A JSON integer (an integral float such as 4096.0 too)."""
    out = _number(value, what)
    if out != int(out):
        raise ProfileError(f"{what} = {value!r}: must be a whole number")
    return int(out)


def load_profile(name_or_path: str) -> CostProfile:
    """A profile by name (``kvgate/profiles/NAME.json``) or by path to a JSON file; either
    followed by ``@xK`` for that profile ``K`` times slower (see :meth:`CostProfile.slowed`);
    or the profile itself as JSON (what an engine announces when routers could not load it by
    its name: :func:`announced_profile`)."""
    if name_or_path.startswith("{"):
        return _inline_profile(name_or_path)
    variant = _speed_variant(name_or_path)
    if variant is not None:
        return load_profile(variant[0]).slowed(variant[1])
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    return _load_cached(str(path.resolve()))


def _speed_variant(spec: str) -> tuple[str, float] | None:
    """``NAME@xK`` as (NAME, K); None for a spec without a factor. ProfileError if K is not a
    number (its range is :meth:`CostProfile.slowed`'s to check)."""
    base, at, factor = spec.rpartition("@x")
    if not (at and base):
        return None
    try:
        return base, float(factor)
    except ValueError:
        raise ProfileError(f"{spec[:80]!r}: want NAME@xFACTOR, e.g. NAME@x2") from None


@cache
def _load_cached(path: str) -> CostProfile:
    try:
        data = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError as exc:
        known = ", ".join(sorted(builtin_profile_names()))
        raise ProfileError(f"no profile {path} (built-in: {known})") from exc
    except orjson.JSONDecodeError as exc:
        raise ProfileError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a JSON object")
    return CostProfile.from_dict(data)


def default_profile() -> CostProfile:
    return load_profile(DEFAULT_PROFILE)


@cache
def builtin_profile_names() -> frozenset[str]:
    """The names of the profiles shipped in ``kvgate/profiles/`` (read once)."""
    return frozenset(p.stem for p in PROFILE_DIR.glob("*.json"))


MAX_VARIANT_DEPTH = 4  # NAME@xK@xK...: how many speed factors a wire name may stack


def resolve_announced(spec: str, known: Mapping[str, CostProfile] | None = None) -> CostProfile:
    """The profile an engine's heartbeat names (``LoadHeartbeat.profile``), never read from a
    path: wire input named files on the router's host before (a directory, a name with a NUL,
    a FIFO that blocked the router for good). One of: inline JSON; a profile in ``known`` (what
    the router was given at startup: its default, its static engines', ``--engine-profile``),
    by its name or by the spec it was given as; a built-in name; ``NAME@xK`` of any of these.
    Anything else raises ProfileError."""
    if spec.startswith("{"):
        return _inline_profile(spec)
    return _resolve_named(spec, known or {}, 0)


def _resolve_named(spec: str, known: Mapping[str, CostProfile], depth: int) -> CostProfile:
    found = known.get(spec)
    if found is not None:
        return found
    variant = _speed_variant(spec)
    if variant is not None:
        if depth >= MAX_VARIANT_DEPTH:
            raise ProfileError(f"{spec[:80]!r}: more than {MAX_VARIANT_DEPTH} speed factors")
        return _resolve_named(variant[0], known, depth + 1).slowed(variant[1])
    if spec in builtin_profile_names():
        return load_profile(spec)
    raise ProfileError(
        f"unknown profile {spec[:80]!r}: not built in ({', '.join(sorted(builtin_profile_names()))}"
        "), not given to this router, not inline JSON"
    )


def announced_profile(profile: CostProfile) -> str:
    """How an engine names its profile to routers (``LoadHeartbeat.profile``): the name, where
    loading that name gives this very profile (a built-in, or ``NAME@xK`` of one); else the
    profile itself as compact JSON. A profile file only the engine's host has (fitted with
    ``kvgate engine fit-profile``) is otherwise unknown to a router elsewhere, which then
    predicted with the default profile: in the vLLM routing benchmark's replica, the tiny
    profile under a name no router knew cut e2's hit rate from 0.874 to 0.768."""
    try:
        if resolve_announced(profile.name) == profile:  # (what any router resolves alike)
            return profile.name
    except ProfileError:
        pass
    data = profile.to_dict()
    data.pop("description", None)
    text = orjson.dumps(data).decode()
    if len(text) > MAX_PROFILE_CHARS:
        raise ProfileError(f"{profile.name}: {len(text)} chars inline, over {MAX_PROFILE_CHARS}")
    return text


@lru_cache(maxsize=64)  # (bounded: the text comes off the wire)
def _inline_profile(text: str) -> CostProfile:
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProfileError(f"inline profile: invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError("inline profile: a profile is a JSON object")
    return CostProfile.from_dict(data)


MIN_PREFILL_SHARE = 0.05  # prefill's share of a saturated decoder's GPU (one operator a step)


def prefill_share(decode_step_ms: float, step_budget_ms: float) -> float:
    """The share of an engine's GPU time its prefill gets while a decode batch runs: every step
    is one decode iteration of ``decode_step_ms`` and then a prefill slice, the whole step cut
    to ``step_budget_ms`` (SCORPIO's TPOT guard), so a prefill takes ``1 / share`` times its
    lone time (at least :data:`MIN_PREFILL_SHARE`: a step runs at least one prefill operator).
    The router predicts TTFT with it and the engine's S-EDF judges slack with it."""
    if decode_step_ms <= 0 or not step_budget_ms > 0 or not math.isfinite(step_budget_ms):
        return 1.0
    share = 1.0 - decode_step_ms / step_budget_ms
    return share if share > MIN_PREFILL_SHARE else MIN_PREFILL_SHARE


LOG_CLIP = math.log(8.0)  # one sample says at most 8x slower or faster than the profile


class SpeedFit:
    """How much slower (> 1) or faster (< 1) than its cost profile an engine really runs, for
    prefill and for decode, fitted online from what it reports: the execution time of a
    request's prefill batches against the profile's time for the same tokens, the mean decode
    step against the profile's step for the same batch and context (engines that cannot say
    fall back on weaker evidence, such as the TTFT of a request that found the engine idle,
    with a weight below 1). A profile describes an engine *type*; the fit catches the engine
    that is not what its profile says (other hardware, a neighbour on the GPU, a wrong name).

    Each factor is a weighted mean of ``log(observed / predicted)`` (each sample clipped to 8x
    either way): a running mean while the evidence is young (total weight below
    ``1 / alpha``), then exponentially weighted with ``alpha``, so it converges in a few
    samples and then follows drift over about ``1 / alpha`` of them. Starts at 1 (the
    profile)."""

    __slots__ = ("_decode_log", "_decode_w", "_prefill_log", "_prefill_w", "alpha")

    def __init__(self, alpha: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._prefill_log = 0.0
        self._prefill_w = 0.0
        self._decode_log = 0.0
        self._decode_w = 0.0

    @property
    def prefill(self) -> float:
        """Multiply the profile's prefill times by this."""
        return math.exp(self._prefill_log)

    @property
    def prefill_log(self) -> float:
        """The log of :attr:`prefill`."""
        return self._prefill_log

    @property
    def decode(self) -> float:
        """Multiply the profile's decode step times by this."""
        return math.exp(self._decode_log)

    @property
    def decode_log(self) -> float:
        """The log of :attr:`decode`."""
        return self._decode_log

    @property
    def prefill_evidence(self) -> float:
        """Total weight of the prefill samples seen."""
        return self._prefill_w

    @property
    def decode_evidence(self) -> float:
        return self._decode_w

    def observe_prefill(self, predicted_ms: float, observed_ms: float, weight: float = 1.0) -> None:
        """The profile predicted ``predicted_ms`` for work the engine did in ``observed_ms``."""
        self._prefill_log, self._prefill_w = self._update(
            self._prefill_log, self._prefill_w, predicted_ms, observed_ms, weight
        )

    def observe_decode(self, predicted_ms: float, observed_ms: float, weight: float = 1.0) -> None:
        self._decode_log, self._decode_w = self._update(
            self._decode_log, self._decode_w, predicted_ms, observed_ms, weight
        )

    def set_prefill(self, log_factor: float, evidence: float) -> None:
        """Take the prefill factor (as its log) from a fit made elsewhere: for an engine that
        reports no prefill timings, the fleet-relative TTFT fit (:class:`TtftFit`)."""
        self._prefill_log = log_factor
        self._prefill_w = evidence

    def _update(
        self, log: float, evidence: float, predicted: float, observed: float, weight: float
    ) -> tuple[float, float]:
        sample = _log_ratio(predicted, observed, weight)
        if sample is None:
            return log, evidence  # nothing to learn (an idle step, a bad report)
        return _averaged(log, evidence, sample, min(weight, 1.0), self.alpha)


def _log_ratio(predicted: float, observed: float, weight: float) -> float | None:
    """``log(observed / predicted)`` clipped to ``LOG_CLIP`` either way, or None when the
    figures say nothing (not positive, not finite, no weight)."""
    if not (predicted > 0 and observed > 0 and weight > 0) or not (
        math.isfinite(predicted) and math.isfinite(observed)
    ):
        return None
    # (a difference of logs: the ratio of two positive floats can underflow to 0 or overflow)
    return min(max(math.log(observed) - math.log(predicted), -LOG_CLIP), LOG_CLIP)


def _averaged(
    value: float, evidence: float, sample: float, weight: float, alpha: float
) -> tuple[float, float]:
    """``value`` (a mean over ``evidence`` of weight so far) moved toward ``sample`` of
    ``weight`` (at most 1), and the evidence after it: a running mean while the evidence is
    young (below ``1 / alpha``), then exponentially weighted with ``alpha`` (the fits here
    converge in a few samples and then follow drift)."""
    evidence += weight
    return value + max(weight / evidence, alpha * weight) * (sample - value), evidence


class TtftFit:
    """What the TTFTs the gateway sees of one engine's answers say of its prefill speed, for an
    engine that reports no prefill timings (a plain vLLM behind the bridge): the mean of
    ``log(observed / predicted)`` and of its square (so its standard error), averaged as
    :class:`SpeedFit` does. ``predicted`` is the router's TTFT on the engine's profile alone
    (its fitted factor divided out), so the mean is the engine's factor plus what every
    engine's TTFT holds beside its prefill and the router does not model: the host's and the
    HTTP path's delays, the error of the queue it guessed. That common part is why a TTFT read
    on its own put every vllm-cpu engine at ~3x its profile (docs/router.md); compared across
    the fleet (:func:`slower_than`) it cancels, and what is left is how much slower one engine
    runs than another."""

    __slots__ = ("_log", "_sq", "_w", "alpha")

    def __init__(self, alpha: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._log = 0.0
        self._sq = 0.0
        self._w = 0.0

    @property
    def log(self) -> float:
        """The mean of ``log(observed / predicted)``."""
        return self._log

    @property
    def evidence(self) -> float:
        return self._w

    def observe(self, predicted_ms: float, observed_ms: float, weight: float = 1.0) -> bool:
        """A TTFT of ``observed_ms`` where the profile predicted ``predicted_ms``; False when
        there is nothing to learn (a bad figure)."""
        sample = _log_ratio(predicted_ms, observed_ms, weight)
        if sample is None:
            return False
        weight = min(weight, 1.0)
        self._sq, _ = _averaged(self._sq, self._w, sample * sample, weight, self.alpha)
        self._log, self._w = _averaged(self._log, self._w, sample, weight, self.alpha)
        return True

    @property
    def variance(self) -> float:
        """The samples' variance (0 before any)."""
        return max(self._sq - self._log * self._log, 0.0)

    def se2(self, floor: float = 0.0) -> float:
        """The squared standard error of :attr:`log`: the samples' variance (at least
        ``floor``: a few samples can agree by chance) over their number, at most ``1 / alpha``
        of them (the exponentially weighted mean's memory)."""
        if self._w <= 0:
            return math.inf
        return max(self.variance, floor) / min(self._w, 1.0 / self.alpha)


@dataclass(frozen=True, slots=True)
class TtftReference:
    """The fleet's fastest engines, as :class:`TtftFit` s read them: the mean log of those
    indistinguishable from the fastest (``log``, its squared standard error ``se2``), the
    fleet's pooled variance of a sample (``variance``, every engine's standard error's floor)
    and how many standard errors make a difference (``sd``)."""

    log: float
    se2: float
    variance: float
    sd: float


def ttft_reference(fits: Sequence[TtftFit], sd: float) -> TtftReference | None:
    """The reference the engines of ``fits`` are read against (None: none with evidence). Not
    the single fastest: of many identical engines one reads fastest by chance, and the rest
    would read slower than it by their noise (on 64 identical engines up to 1.8x). The engines
    within ``sd`` standard errors of the fastest are as fast as it, and their evidence-weighted
    mean is the reference; the variance of a sample is pooled over the fleet (an engine with two
    or three samples says little of its own). ``sd`` grows with the fleet, to ``sqrt(2 ln n)``
    of ``n`` engines (about the largest of ``n`` standard normal draws): of many engines some
    stray ``sd`` standard errors by chance alone."""
    fits = [f for f in fits if f.evidence > 0]
    if not fits:
        return None
    sd = max(sd, math.sqrt(2.0 * math.log(len(fits))))
    pooled = sum((f.variance * f.evidence for f in fits), 0.0) / sum(
        (f.evidence for f in fits), 0.0
    )
    fastest = min(fits, key=_fit_log)
    bound = fastest.se2(pooled)
    peers = [f for f in fits if f.log - fastest.log <= sd * math.sqrt(f.se2(pooled) + bound)]
    total = sum((f.evidence for f in peers), 0.0)
    log = sum((f.log * f.evidence for f in peers), 0.0) / total
    # the mean of the peers' means: its variance, each weighted by its evidence
    se2 = sum((f.se2(pooled) * f.evidence**2 for f in peers), 0.0) / total**2
    return TtftReference(log, se2, pooled, sd)


class FleetReference:
    """The reference a fleet's :class:`TtftFit` s are read against (:func:`ttft_reference`),
    kept current cheaply: a fleet-wide figure, re-read from every fitted engine once in as many
    readings as the fleet has engines; between times only the engine just read moves against
    the reference as it stands (an engine that reads faster than it reads as fast, at once)."""

    __slots__ = ("_reads", "ref", "sd")

    def __init__(self, sd: float) -> None:
        self.sd = sd
        self.ref: TtftReference | None = None
        self._reads = 0  # readings since the last re-read

    def due(self, engines: int) -> bool:
        """One more reading, of a fleet of ``engines``: whether the whole fleet is to be
        re-read now (:meth:`reread`)."""
        self._reads += 1
        return self.ref is None or self._reads >= engines

    def reread(self, fits: Sequence[TtftFit]) -> TtftReference | None:
        """The reference over ``fits`` (every fitted engine's), taken now."""
        self.ref = ttft_reference(fits, self.sd)
        self._reads = 0
        return self.ref


def _fit_log(fit: TtftFit) -> float:
    return fit.log


def slower_than(fit: TtftFit, ref: TtftReference) -> float:
    """How much slower (as a log factor, >= 0) the engine of ``fit`` runs than the reference
    engines, less ``ref.sd`` standard errors of the difference: on identical engines the means
    differ by their noise, and an engine read as slower takes fewer requests than it should."""
    gap = fit.log - ref.log
    if gap <= 0:
        return 0.0
    return max(gap - ref.sd * math.sqrt(fit.se2(ref.variance) + ref.se2), 0.0)


class OutputFit:
    """How long answers are against the ``max_tokens`` their requests state. Clients state a
    cap (an SDK default, the model's limit) and the answer ends at its EOS, often far below
    it; every estimate that takes the cap at its word (a request's decode time, its share of
    a decode batch, the KV it will hold) overstates it, and a router steering by them sends
    cached prompts away from their holders to spread decode work that never comes. Learned
    from finished requests, per power-of-two bucket of the stated cap (one client's cap and
    the answers under it go together; a trace replay that states each answer's length keeps a
    fraction of 1): the fraction of its cap an answer took, averaged as :class:`SpeedFit`
    averages (a running mean while young, then exponentially weighted with ``alpha``); the cap
    itself until an answer under it has ended. (With a prior of one answer at the whole cap,
    the slow start cost zipf_doc_qa 4 homo x1 3 points at a 4,096 cap: docs/BENCHMARKS.md.)"""

    __slots__ = ("_buckets", "alpha")

    def __init__(self, alpha: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._buckets: dict[int, list[float]] = {}  # bucket -> [fraction, evidence]

    @staticmethod
    def _bucket(stated: int) -> int:
        return max(stated, 1).bit_length()

    def fraction(self, stated: int) -> float:
        """The fraction of a ``stated`` cap an answer is expected to take (1 before any)."""
        b = self._buckets.get(self._bucket(stated))
        return b[0] if b is not None else 1.0

    def expected(self, stated: int) -> int:
        """The output tokens to plan for a request stating ``stated`` (at least 1; the cap
        itself while the fraction is 1, exactly: a fraction never passes 1)."""
        return max(1, round(stated * self.fraction(stated)))

    def observe(self, stated: int, output: int) -> None:
        """A request that stated ``stated`` ended after ``output`` tokens."""
        if stated < 1 or output < 1:
            return  # (nothing to learn: a rejected or unknown request)
        sample = min(output / stated, 1.0)
        key = self._bucket(stated)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = [1.0, 0.0]
        b[0], b[1] = _averaged(b[0], b[1], sample, 1.0, self.alpha)


DEFAULT_KV_BYTES_PER_TOKEN = 131_072  # Mistral-7B fp16: 32 layers x 2 (K, V) x 1024 x 2 bytes
DEFAULT_KV_LINK_GBPS = 100.0  # one 100 Gb/s NIC between a prefill and a decode engine


class KvLink:
    """Moving a prompt's KV from a prefill engine to a decode engine (prefill/decode
    disaggregation): ``tokens x kv_bytes_per_token / bandwidth``, configured per fleet (one
    model, one network), its factor fitted online from the transfer times decode engines
    report (:class:`SpeedFit`'s rule: a link is often not what its data sheet says)."""

    __slots__ = ("_fit", "bytes_per_token", "gbps")

    def __init__(
        self,
        bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN,
        gbps: float = DEFAULT_KV_LINK_GBPS,
    ) -> None:
        if not (bytes_per_token > 0 and gbps > 0):
            raise ValueError("KV bytes per token and link bandwidth must be positive")
        self.bytes_per_token = float(bytes_per_token)
        self.gbps = float(gbps)
        self._fit = SpeedFit()

    def nominal_ms(self, tokens: float) -> float:
        """The configured link's time for ``tokens`` tokens of KV."""
        return tokens * self.bytes_per_token * 8.0 / (self.gbps * 1e6)

    def transfer_ms(self, tokens: float) -> float:
        """The predicted time, corrected by the fit."""
        return self.nominal_ms(tokens) * self._fit.prefill

    @property
    def factor(self) -> float:
        """Observed / configured time (1: the link is as configured)."""
        return self._fit.prefill

    def observe(self, tokens: int, observed_ms: float) -> None:
        """A decode engine moved ``tokens`` tokens of KV in ``observed_ms``."""
        self._fit.observe_prefill(self.nominal_ms(tokens), observed_ms)
