"""vLLM's KV-cache event messages, decoded into plain values. Pure: no sockets, no clock.

Wire format (vLLM ``ZmqEventPublisher``): a ZMQ multipart message ``[topic, seq, payload]``
where ``seq`` is an 8-byte big-endian counter (restarting at 0 with every vLLM process) and
``payload`` is msgpack of ``KVEventBatch``. vLLM encodes its ``msgspec`` structs either as arrays
(``array_like=True``: fields in declaration order, trailing defaults omitted) or as maps, and has
changed this between releases, so both are accepted at both levels:

* batch: ``[ts, [events...], data_parallel_rank?]`` or ``{"ts", "events", "data_parallel_rank"}``;
* event (tagged by class name): ``{"type": "BlockStored", "block_hashes": ...}`` or
  ``["BlockStored", block_hashes, ...]``. Field order:

  - ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
    locality, ownership, session_id (the last three in recent releases);
  - ``BlockRemoved``: block_hashes, medium, group_idx;
  - ``AllBlocksCleared``: nothing.

Block hashes are integers (vLLM's default, the low 8 bytes of its hash) or bytes (the full hash);
both are kept as they come, as opaque dictionary keys.

A message that cannot be decoded raises :class:`WireError`; an event inside a good batch that is
malformed or of an unknown kind is skipped and counted in :attr:`VllmBatch.skipped`, so one odd
event never costs the rest of its batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

VllmHash = int | bytes

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class WireError(ValueError):
    """A message that is not a vLLM KV event message; the text says what was wrong."""


@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    """vLLM cached ``len(block_hashes)`` consecutive blocks of ``block_size`` tokens each."""

    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    """vLLM evicted these blocks from ``medium`` (None: the GPU)."""

    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmAllCleared:
    """vLLM dropped its whole prefix cache (``reset_prefix_cache``)."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllCleared


@dataclass(frozen=True, slots=True)
class VllmBatch:
    """One published batch; ``skipped`` counts events in it that could not be used."""

    ts: float
    events: tuple[VllmEvent, ...]
    dp_rank: int | None = None
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class VllmMessage:
    """One ZMQ message from vLLM's PUB socket or its replay socket."""

    topic: bytes
    seq: int
    batch: VllmBatch


def decode_seq(raw: bytes) -> int:
    """vLLM's 8-byte big-endian sequence number."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != 8:
        raise WireError("sequence number must be exactly 8 bytes")
    return int.from_bytes(raw, "big")


def decode_message(frames: Sequence[bytes]) -> VllmMessage:
    """``[topic, seq, payload]`` from the PUB socket."""
    if len(frames) != 3:
        raise WireError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return VllmMessage(bytes(topic), decode_seq(seq), decode_payload(payload))


def decode_replay_frames(frames: Sequence[bytes]) -> VllmMessage | None:
    """A reply from vLLM's replay (ROUTER) socket as a DEALER receives it: the empty delimiter,
    then ``[topic, seq, payload]`` (recent vLLM) or ``[seq, payload]`` (older). None is the
    end-of-replay marker (seq -1, empty payload)."""
    if len(frames) not in (3, 4) or frames[0]:
        raise WireError(f"expected replay frames ('', [topic,] seq, payload), got {len(frames)}")
    topic = bytes(frames[1]) if len(frames) == 4 else b""
    seq_raw, payload = frames[-2], frames[-1]
    if bytes(seq_raw) == END_OF_REPLAY and not payload:
        return None
    return VllmMessage(topic, decode_seq(seq_raw), decode_payload(payload))


def decode_payload(payload: bytes) -> VllmBatch:
    """msgpack bytes of one ``KVEventBatch``."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError) as exc:
        # (RecursionError: arrays nested thousands deep)
        raise WireError(f"payload is not msgpack: {exc!r}") from exc
    return batch_from_obj(obj)


def batch_from_obj(obj: Any) -> VllmBatch:
    """An already-decoded batch (msgpack or JSON of the same structure)."""
    if isinstance(obj, Mapping):
        fields = [obj.get(name) for name in BATCH_FIELDS]
    elif isinstance(obj, (list, tuple)) and 2 <= len(obj) <= 3:
        fields = [*obj, None][:3]
    else:
        raise WireError("batch must be [ts, events, dp_rank] or a map with ts and events")
    ts, raw_events, dp_rank = fields
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireError("batch ts must be a number")
    if not isinstance(raw_events, (list, tuple)):
        raise WireError("batch events must be an array")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise WireError("batch data_parallel_rank must be an integer")
    events: list[VllmEvent] = []
    skipped = 0
    for raw in raw_events:
        try:
            events.append(event_from_obj(raw))
        except WireError:
            skipped += 1
    return VllmBatch(float(ts), tuple(events), dp_rank, skipped)


def _fields(obj: Any) -> tuple[str, Mapping[str, Any]]:
    """(tag, fields by name) of a map- or array-encoded tagged struct."""
    if isinstance(obj, Mapping):
        tag = obj.get("type")
        if not isinstance(tag, str):
            raise WireError("event map needs a string 'type'")
        return tag, obj
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], str):
        tag = obj[0]
        names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
        if len(obj) - 1 > len(names):
            raise WireError(f"{tag}: {len(obj) - 1} fields, at most {len(names)} known")
        return tag, dict(zip(names, obj[1:], strict=False))
    raise WireError("event must be a tagged map or a tagged array")


def _hash(value: Any, what: str) -> VllmHash:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise WireError(f"{what} must be an integer or bytes")
    return value


def _hashes(value: Any) -> tuple[VllmHash, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise WireError("block_hashes must be a non-empty array")
    return tuple(_hash(h, "block hash") for h in value)


def _opt(value: Any, kind: type, what: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise WireError(f"{what} must be {kind.__name__} or null")
    return value


def event_from_obj(obj: Any) -> VllmEvent:
    """One decoded event; raises :class:`WireError` for a malformed or unknown one."""
    tag, f = _fields(obj)
    if tag == "BlockStored":
        hashes = _hashes(f.get("block_hashes"))
        parent = f.get("parent_block_hash")
        parent = None if parent is None else _hash(parent, "parent_block_hash")
        tokens = f.get("token_ids")
        if not isinstance(tokens, (list, tuple)) or not all(
            type(t) is int and t >= 0 for t in tokens
        ):
            raise WireError("token_ids must be an array of non-negative integers")
        size = f.get("block_size")
        if type(size) is not int or size <= 0:
            raise WireError("block_size must be a positive integer")
        if len(tokens) != size * len(hashes):
            raise WireError(f"{len(tokens)} token ids for {len(hashes)} blocks of {size} tokens")
        return VllmBlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=size,
            lora_id=_opt(f.get("lora_id"), int, "lora_id"),
            medium=_opt(f.get("medium"), str, "medium"),
            lora_name=_opt(f.get("lora_name"), str, "lora_name"),
            group_idx=_opt(f.get("group_idx"), int, "group_idx"),
            kv_cache_spec_kind=_opt(f.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
        )
    if tag == "BlockRemoved":
        return VllmBlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=_opt(f.get("medium"), str, "medium"),
            group_idx=_opt(f.get("group_idx"), int, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return VllmAllCleared()
    raise WireError(f"unknown event type {tag!r}")
