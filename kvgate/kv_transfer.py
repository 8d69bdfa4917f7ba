"""The two-phase request of prefill/decode disaggregation, as vLLM's KV connectors define it.

vLLM (``vllm/distributed/kv_transfer/kv_connector/v1/nixl``) reads ``kv_transfer_params`` in
the request body: a prefill request carries ``do_remote_decode: true`` (compute the prompt,
keep its blocks for a remote reader, answer after one token); its answer carries the params
the decode engine needs (``do_remote_prefill: true``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``remote_block_ids``, and more), and
the decode request is the client's own request plus those params. Connectors that share KV by
other means (vLLM's ``ExampleConnector``, a shared directory) answer no params: then the
decode request goes without. This module builds both bodies (the gateway) and checks the
decode side's params (kvgate's engine and the test's strict fake). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.openai_request import KV_TRANSFER_PARAM, RequestError

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the prefill engine gets it: one token, unary, and asking the
    engine to keep the prompt's KV for a remote decode."""
    out = dict(body)
    out[KV_TRANSFER_PARAM] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's request as the decode engine gets it: unchanged, plus the prefill
    engine's params (none: a connector that moves the KV by other means)."""
    out = dict(body)
    if params is None:
        out.pop(KV_TRANSFER_PARAM, None)
    else:
        out[KV_TRANSFER_PARAM] = params
    return out


def returned_params(answer: object) -> dict[str, Any] | None:
    """The params a prefill engine's JSON answer hands on (None: it gave none)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get(KV_TRANSFER_PARAM)
    return params if isinstance(params, dict) else None


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """Where a decode engine finds a prompt's KV (the checked ``do_remote_prefill`` params)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple
    tokens: int | None = None


def remote_prefill(body: dict[str, Any]) -> RemoteKv | None:
    """The decode side's params, checked as vLLM's connector reads them (None: the request
    is an ordinary one); a :class:`RequestError` (400) names what is wrong."""
    params = body.get(KV_TRANSFER_PARAM)
    if params is None:
        return None
    if not isinstance(params, dict):
        raise RequestError(f"{KV_TRANSFER_PARAM} must be an object", param=KV_TRANSFER_PARAM)
    if not params.get("do_remote_prefill"):
        return None
    missing = [
        k
        for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        if params.get(k) is None
    ]
    if missing or "remote_block_ids" not in params:
        missing += [] if "remote_block_ids" in params else ["remote_block_ids"]
        raise RequestError(
            f"{KV_TRANSFER_PARAM} with do_remote_prefill needs {', '.join(missing)}",
            param=KV_TRANSFER_PARAM,
        )
    engine_id, request_id = params["remote_engine_id"], params["remote_request_id"]
    host, port = params["remote_host"], params["remote_port"]
    if not isinstance(engine_id, str) or not isinstance(request_id, str):
        raise RequestError(
            f"{KV_TRANSFER_PARAM}: remote engine and request ids must be strings",
            param=KV_TRANSFER_PARAM,
        )
    if not isinstance(host, str) or host not in LOOPBACK:
        raise RequestError(
            f"{KV_TRANSFER_PARAM}: remote_host must be a loopback address", param=KV_TRANSFER_PARAM
        )
    if type(port) is not int or not 0 < port < 65536:
        raise RequestError(
            f"{KV_TRANSFER_PARAM}: remote_port must be a port number", param=KV_TRANSFER_PARAM
        )
    blocks = params["remote_block_ids"]
    if not isinstance(blocks, list):
        raise RequestError(
            f"{KV_TRANSFER_PARAM}: remote_block_ids must be a list", param=KV_TRANSFER_PARAM
        )
    tokens = params.get("remote_num_tokens")
    if tokens is not None and (type(tokens) is not int or tokens < 0):
        raise RequestError(
            f"{KV_TRANSFER_PARAM}: remote_num_tokens must be a count", param=KV_TRANSFER_PARAM
        )
    return RemoteKv(engine_id, request_id, host, port, tuple(blocks), tokens)


def wants_remote_decode(body: dict[str, Any]) -> bool:
    """A prefill request of the two-phase flow (``do_remote_decode: true``)."""
    params = body.get(KV_TRANSFER_PARAM)
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def prefill_answer_params(
    engine_id: str, request_id: str, host: str, port: int, block_ids: list[int], tokens: int
) -> dict[str, Any]:
    """What a prefill engine answers (the fields vLLM's NIXL connector returns)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": tokens,
        "tp_size": 1,
    }
