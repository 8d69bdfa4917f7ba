"""Hand-checkable profiles and drivers for the engine's unit tests."""

from __future__ import annotations

from engine.core import EngineCore, EngineRequest, Output
from engine.scheduler.state import SchedulerConfig
from kvgate.cost_model import CostProfile, PrefillSegment
from kvgate.slo import Slo


def linear_profile(
    *, decode_b: float = 1.0, decode_d: float = 10.0, kv_blocks: int = 100_000, **kw: object
) -> CostProfile:
    """Prefill costs exactly 1 ms per new token; a decode step ``decode_b x B + decode_d`` ms."""
    return CostProfile(
        name="linear-test",
        segments=(PrefillSegment(0, (0.0, 1.0)),),
        attn_threshold=1e30,
        efficiency=1.0,
        decode_a=0.0,
        decode_b=decode_b,
        decode_c=0.0,
        decode_d=decode_d,
        kv_blocks=kv_blocks,
        block_tokens=16,
        bytes_per_token=4,
        **kw,  # type: ignore[arg-type]
    )


def req(
    rid: str,
    tokens: int,
    *,
    ttft_ms: float = 100_000.0,
    tpot_ms: float = 1_000.0,
    out: int = 1,
    at: float = 0.0,
    key: bytes | None = None,
) -> EngineRequest:
    """A request whose key is unique to it unless ``key`` is given."""
    k = key if key is not None else f"<{rid}>".encode() * (tokens * 4 // (len(rid) + 2) + 1)
    return EngineRequest(rid, k[: tokens * 4], tokens, out, Slo(ttft_ms, tpot_ms), at)


def core(policy: str = "slo", profile: CostProfile | None = None, **cfg: object) -> EngineCore:
    return EngineCore(
        "e-test", profile or linear_profile(), policy=policy, config=SchedulerConfig(**cfg)
    )  # type: ignore[arg-type]


def run_until(c: EngineCore, until: float, *, max_steps: int = 1_000_000) -> list[Output]:
    """Advance ``c`` event by event up to time ``until``; every output, in order."""
    outs: list[Output] = []
    for _ in range(max_steps):
        t = c.next_event_time()
        if t is None or t > until:
            return outs
        outs.extend(c.advance(t))
    raise AssertionError("engine did not settle")


def first_token_times(outs: list[Output]) -> dict[str, float]:
    return {o.request_id: o.times[0] for o in outs if o.first_token}
