"""Prefill/decode disaggregation: the decode half of a pair, and the two phases' records.

A fleet may mix roles (``broker.events.ROLES``, announced in heartbeats). The policy picks
where a prompt is computed among the engines that prefill (``prefill`` and ``both``), with the
same cache-aware cost as in a colocated fleet; for a prefill-only engine E2's estimate leaves
out the decode batch (the request does not decode there) and adds the KV's move to the
decode engine (``router.policies.feasibility.estimate``). When the chosen engine only
prefills, :func:`choose_decode` picks the engine that decodes: the one whose decode step,
with this request added, leaves the most TPOT headroom and that has room for its KV. A
``both`` engine runs whole requests, and decodes for a prefill engine only when no
decode-only engine can (its prefill work would share its steps).

The two phases are two in-flight records: the prefill one under the request's id on the
prefill engine (one output token), the decode one under :func:`decode_id` on the decode
engine (one token to compute, the prompt credited as cached: its KV arrives). The gateway
sends the decode request with that id, so each engine's events release its own record. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.api import RouteRequest
from router.policies.base import EngineView
from router.policies.feasibility import (
    TPOT_HEADROOM,
    TPOT_SAFETY,
    step_budget_tpot_ms,
    virtual_batch,
)

DECODE_SUFFIX = ":decode"


def decode_id(request_id: str) -> str:
    """The decode phase's request id (its record in the router, its id on the decode engine)."""
    return request_id + DECODE_SUFFIX


def prefill_phase(req: RouteRequest) -> RouteRequest:
    """What the prefill engine is asked: the prompt, one output token."""
    return RouteRequest(
        req.request_id, req.model, req.key, req.input_tokens, 1, req.slo, req.session, req.exclude
    )


def decode_phase(req: RouteRequest) -> RouteRequest:
    """What the decode engine is asked: the whole generation, its prompt's KV moved in."""
    return RouteRequest(
        decode_id(req.request_id),
        req.model,
        req.key,
        req.input_tokens,
        req.max_tokens,
        req.slo,
        req.session,
        req.exclude,
    )


def decode_score(ev: EngineView, req: RouteRequest, key_len: int) -> tuple:
    """Order of decode candidates, best first: room for the KV, a TPOT within the SLO with
    this request in the batch, decode-only before colocated, then the predicted step (decode
    load), fewer in flight, registration order."""
    prof = ev.profile
    tokens = prof.prompt_tokens(req.input_tokens, key_len)
    mine = tokens + req.max_tokens / 2
    # SCORPIO's admission over the virtual batch with it, at the tightest TPOT SLO there
    t_min = min(req.slo.tpot_ms, step_budget_tpot_ms(ev))
    batch = virtual_batch(ev, t_min) + t_min / req.slo.tpot_ms
    ctx = (ev.open_ctx_tokens + mine) / (ev.inflight + 1)
    step = prof.decode_step_ms(batch, ctx) * ev.decode_scale
    if ev.role != "decode":  # its own prefill work takes turns with its decode steps
        step += ev.queued_prefill_ms / max(req.max_tokens, 1)
    headroom = TPOT_HEADROOM * t_min - step * TPOT_SAFETY
    need = ev.kv_key_bytes(tokens + req.max_tokens)
    return (ev.free_bytes < need, headroom < 0, ev.role != "decode", step, ev.inflight, ev.position)


def choose_decode(
    views: Iterable[EngineView], req: RouteRequest, key_len: int
) -> EngineView | None:
    """The decode engine for ``req`` among ``views`` (those that decode: ``decode`` or
    ``both``; others are skipped), or None when there is none."""
    best: EngineView | None = None
    best_key: tuple | None = None
    for ev in views:
        if ev.role == "prefill":
            continue
        k = decode_score(ev, req, key_len)
        if best_key is None or k < best_key:
            best, best_key = ev, k
    return best
