"""A small live-vs-sim smoke test: the same requests through a loopback stack and the simulator.

Round robin makes the routing independent of timing, so engines, cached tokens and token counts
must agree exactly; the live engine sleeps the modeled time, so a live TTFT is never shorter
than the simulated one (no upper timing bound is asserted: the machine may be busy).
"""

from __future__ import annotations

from bench.fidelity import FidelitySpec, relative_error, run_live, run_sim
from bench.sim.runner import SimConfig
from bench.sim.world import LinkConfig
from bench.workloads.request import Request, Segment, Turn
from kvgate.slo import Slo


def _requests() -> list[Request]:
    shared = Segment(7, 2048)
    out = []
    for i in range(8):
        turns = (Turn("", (shared, Segment(100 + i, 1024 + 64 * i))),)
        n_bytes = 2048 + 1024 + 64 * i
        out.append(
            Request(
                f"f{i}",
                0.3 * i,
                turns,
                input_tokens=n_bytes // 4,
                output_tokens=4,
                slo=Slo(30_000.0, 5_000.0),
            )
        )
    return out


async def test_live_and_simulated_runs_agree_on_a_small_slice() -> None:
    reqs = _requests()
    spec = FidelitySpec(
        policy="round_robin",
        sim=SimConfig(engines=2, link=LinkConfig(heartbeat_s=0.2)),
        progress=False,
        request_timeout_s=30,
        drain_timeout_s=30,
    )
    sim = run_sim(reqs, spec)
    live = await run_live(reqs, spec)
    s = sim["summary"]
    assert s["ok"] == live["ok"] == len(reqs)
    assert s["per_engine_requests"] == live["per_engine_requests"] == {"e00": 4, "e01": 4}
    assert s["prefix_hit_rate"] == live["prefix_hit_rate"] and s["prefix_hit_rate"] > 0
    assert s["ttft_ms"]["p50"] <= live["ttft_ms"]["p50"] * 1.02
    assert relative_error(110.0, 100.0) == 0.1 and relative_error(None, 1.0) is None


def test_common_ttft_compares_the_same_requests() -> None:
    from bench.fidelity import common_ttft
    from bench.metrics import RequestRecord

    def rec(rid: str, ttft: float | None, status: int = 200, engine: str = "a") -> RequestRecord:
        return RequestRecord(rid, "k", 0.0, 10, 2, 1e6, 1e6, status=status, engine=engine,
                             ttft_s=ttft)  # fmt: skip

    live = [rec("x", 1.0), rec("y", 2.0), rec("z", None, 429)]
    sim = [rec("x", 1.1), rec("y", 2.2, engine="b"), rec("z", 9.0)]
    out = common_ttft(live, sim)
    assert out["requests"] == 2  # z failed live: left out of both sides
    assert out["live"]["p50"] == 1500.0 and out["sim"]["p50"] == 1650.0
    assert out["error"]["ttft_p50"] == 0.1
    assert out["same_engine_share"] == 0.6667  # x and z went to the same engine both ways
