"""EngineCore in a prefill/decode-disaggregated fleet: its role in heartbeats, a prompt's KV
received from a prefill engine, the move reported in its first token."""

from __future__ import annotations

from dataclasses import replace

from engine_testkit import linear_profile, req, run_until

from broker.events import BlockStored, FirstToken
from engine.core import EngineCore


def test_role_is_announced_in_heartbeats() -> None:
    c = EngineCore("d", linear_profile(), role="decode")
    assert c.heartbeat("http://d", ("m",)).role == "decode"
    assert EngineCore("b", linear_profile()).heartbeat("http://b", ("m",)).role == "both"


def test_received_kv_is_cached_and_the_move_is_reported() -> None:
    c = EngineCore("d", linear_profile(), role="decode")
    key = b"k" * 640  # 160 tokens, 10 blocks of 64 bytes
    assert c.receive_kv(key, 0.0)
    stored = [e for e in c.drain_events() if isinstance(e, BlockStored)]
    assert sum(len(e.hashes) for e in stored) == 10  # announced: routers see the prompt there
    r = replace(req("A", 160, out=3, key=key), kv_transfer_ms=12.5, kv_transfer_tokens=160)
    c.submit(r, 0.0)
    outs = run_until(c, 100.0)
    usage = outs[-1].usage
    assert usage is not None and usage.cached_tokens == 159  # only the last token computed
    first = [e for e in c.drain_events() if isinstance(e, FirstToken)]
    assert (first[0].kv_transfer_ms, first[0].kv_transfer_tokens) == (12.5, 160)
    # a cache too small for the prompt: nothing is received, the request computes it all
    tiny = EngineCore("t", replace(linear_profile(), kv_blocks=4))
    assert not tiny.receive_kv(key, 0.0)
