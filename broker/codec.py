"""Wire format of events on a stream: envelopes to stream-entry fields and back, nothing else.

One stream entry carries a batch of consecutive events from one engine, so a busy engine makes
few, large XADDs. An entry has three binary-safe fields:

* ``v``: format version (``b"1"``);
* ``h``: orjson ``[engine_id, epoch, first_seq, records]``, a record per event:
  ``[kind, ts, *fields]``; a BlockStored record is ``["bs", ts, parent, hashes, lengths]``;
* ``b``: the raw bytes of every stored block in the entry, concatenated in record order, so
  block contents round-trip exactly whatever bytes they hold (not only UTF-8).

Sequence numbers in an entry are ``first_seq, first_seq + 1, ...``. Decoding checks every field and
raises :class:`CodecError` with a message naming what was wrong; it never returns a half-decoded
batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields

import orjson

from broker.events import (
    U64_MAX,
    AllCleared,
    Envelope,
    EventError,
    FirstToken,
    LoadHeartbeat,
    RequestEnqueued,
    RequestFinished,
    RequestPreempted,
    RequestRejected,
    RequestStarted,
    Snapshot,
    trusted_block_removed,
    trusted_block_stored,
    trusted_envelope,
    u64_tuple,
)

VERSION = b"1"
MAX_BLOB = 64 << 20  # one entry never carries more than 64 MiB of block bytes


class CodecError(ValueError):
    """A stream entry or snapshot that cannot be decoded; the message says why."""


def _record(env: Envelope, blob: list[bytes]) -> list:
    ev = env.event
    kind = ev.KIND
    if kind == "bs":
        blob.extend(ev.blocks)
        return [kind, env.ts, ev.parent_hash, list(ev.hashes), [len(b) for b in ev.blocks]]
    if kind == "br":
        return [kind, env.ts, list(ev.hashes)]
    if kind == "ac":
        return [kind, env.ts]
    if kind == "rq":
        return [
            kind,
            env.ts,
            ev.request_id,
            ev.key_bytes,
            ev.cached_bytes,
            ev.input_tokens,
            ev.max_tokens,
            ev.ttft_slo_ms,
            ev.tpot_slo_ms,
        ]
    if kind in ("st", "pe"):
        return [kind, env.ts, ev.request_id]
    if kind == "ft":
        if ev.prefill_ms is None and ev.kv_transfer_ms is None:
            return [kind, env.ts, ev.request_id, ev.ttft_ms]
        rec = [
            kind,
            env.ts,
            ev.request_id,
            ev.ttft_ms,
            ev.prefill_ms,
            ev.prefill_tokens,
            ev.context_tokens,
        ]
        if ev.kv_transfer_ms is not None:
            rec += (ev.kv_transfer_ms, ev.kv_transfer_tokens)
        return rec
    if kind == "fi":
        rec = [kind, env.ts, ev.request_id, ev.output_tokens, ev.ttft_ms, ev.tpot_ms]
        if ev.max_tokens is not None:
            rec.append(ev.max_tokens)
        return rec
    if kind == "rj":
        if not ev.cause and not ev.estimate_ms and not ev.estimate_tokens:
            return [kind, env.ts, ev.request_id, ev.reason]
        return [
            kind,
            env.ts,
            ev.request_id,
            ev.reason,
            ev.cause,
            ev.estimate_ms,
            ev.estimate_tokens,
        ]
    if kind == "hb":
        return [
            kind,
            env.ts,
            ev.waiting,
            ev.running,
            ev.queued_prefill_tokens,
            ev.kv_blocks_used,
            ev.kv_blocks_total,
            ev.vbs,
            ev.profile,
            ev.url,
            list(ev.models),
            *_heartbeat_tail(ev),
        ]
    raise CodecError(f"cannot encode event kind {kind!r}")


def _heartbeat_tail(ev: LoadHeartbeat) -> tuple:
    """A heartbeat's optional fields, as far as the last one not at its default (positional on
    the wire: each was added after the ones before it, and an older record decodes to the
    defaults of the fields it lacks)."""
    tail = [getattr(ev, f.name) for f in _HEARTBEAT_TAIL]
    n = len(tail)
    while n and tail[n - 1] == _HEARTBEAT_TAIL[n - 1].default:
        n -= 1
    return tuple(tail[:n])


# the fields after ``models``: optional, in the order they were added
_HEARTBEAT_FIELDS = fields(LoadHeartbeat)
_HEARTBEAT_TAIL = _HEARTBEAT_FIELDS[[f.name for f in _HEARTBEAT_FIELDS].index("models") + 1 :]


def encode_batch(envelopes: Sequence[Envelope]) -> dict[bytes, bytes]:
    """Encode consecutive envelopes of one engine and epoch as the fields of one stream entry."""
    if not envelopes:
        raise CodecError("empty batch")
    first = envelopes[0]
    blob: list[bytes] = []
    records = []
    for i, env in enumerate(envelopes):
        if env.engine_id != first.engine_id or env.epoch != first.epoch:
            raise CodecError("a batch holds events of one engine and epoch")
        if env.seq != first.seq + i:
            raise CodecError(f"batch seq not consecutive at {env.seq} (expected {first.seq + i})")
        records.append(_record(env, blob))
    header = orjson.dumps([first.engine_id, first.epoch, first.seq, records])
    return {b"v": VERSION, b"h": header, b"b": b"".join(blob)}


def _field(fields: Mapping, name: bytes) -> bytes:
    value = fields.get(name)
    if value is None:
        value = fields.get(name.decode())
    if value is None:
        raise CodecError(f"missing field {name.decode()!r}")
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes):
        raise CodecError(f"field {name.decode()!r} is not bytes")
    return value


_CLEARED = AllCleared()
_INF = float("inf")


def _block_slices(
    blob: bytes, offset: int, lengths: object, count: int
) -> tuple[tuple[bytes, ...], int]:
    """Cut ``count`` blocks of the given lengths out of ``blob`` from ``offset``; returns the
    blocks and the offset after them."""
    if not isinstance(lengths, list) or len(lengths) != count:
        raise CodecError("bs: one length per hash")
    end = len(blob)
    out = []
    for n in lengths:
        if type(n) is not int or n <= 0 or offset + n > end:
            raise CodecError(f"bs: block length {n!r} does not fit the blob")
        out.append(blob[offset : offset + n])
        offset += n
    return tuple(out), offset


def decode_batch(fields: Mapping) -> list[Envelope]:
    """Decode one stream entry's fields (bytes or str keys) into envelopes, or raise CodecError."""
    try:
        if _field(fields, b"v") != VERSION:
            raise CodecError(f"unknown format version {fields.get(b'v', fields.get('v'))!r}")
        head = orjson.loads(_field(fields, b"h"))
        blob = _field(fields, b"b")
        if not isinstance(head, list) or len(head) != 4:
            raise CodecError("header must be [engine_id, epoch, first_seq, records]")
        engine_id, epoch, first_seq, records = head
        if not isinstance(records, list) or not records:
            raise CodecError("records must be a non-empty list")
        # Validate the header once per entry, then build envelopes without re-checking it.
        Envelope(engine_id, epoch, first_seq, 0.0, _CLEARED)
        out: list[Envelope] = []
        offset = 0
        for i, rec in enumerate(records):
            if not isinstance(rec, list) or len(rec) < 2:
                raise CodecError(f"record {i} must be a list [kind, ts, ...]")
            kind, ts = rec[0], rec[1]
            if type(ts) is not float:
                if type(ts) is not int or ts < 0:
                    raise CodecError(f"record {i}: ts must be a non-negative number")
                ts = float(ts)
            elif not 0.0 <= ts < _INF:
                raise CodecError(f"record {i}: ts must be a finite non-negative number")
            ev, offset = _decode_record(kind, rec, blob, offset)
            out.append(trusted_envelope(engine_id, epoch, first_seq + i, ts, ev))
        if offset != len(blob):
            raise CodecError(f"{len(blob) - offset} trailing blob bytes")
        return out
    except CodecError:
        raise
    except (EventError, orjson.JSONDecodeError, TypeError, ValueError, IndexError) as exc:
        raise CodecError(str(exc) or type(exc).__name__) from exc


def _arity(rec: list, n: int, kind: str, optional: int = 0) -> None:
    """``rec`` has ``n`` items, or up to ``optional`` more (fields added later, in order)."""
    if not n <= len(rec) <= n + optional:
        want = f"{n}" if not optional else f"{n} to {n + optional}"
        raise CodecError(f"{kind} record needs {want} items, got {len(rec)}")


def _decode_record(kind: object, rec: list, blob: bytes, offset: int):
    if kind == "bs":
        _arity(rec, 5, "bs")
        parent = rec[2]
        if parent is not None and (type(parent) is not int or not 0 <= parent <= U64_MAX):
            raise CodecError(f"bs: parent_hash must be null or an unsigned 64-bit int: {parent!r}")
        hashes = u64_tuple(rec[3], "bs: hashes")
        if not hashes:
            raise CodecError("bs: at least one block")
        blocks, offset = _block_slices(blob, offset, rec[4], len(hashes))
        return trusted_block_stored(parent, hashes, blocks), offset
    if kind == "br":
        _arity(rec, 3, "br")
        hashes = u64_tuple(rec[2], "br: hashes")
        if not hashes:
            raise CodecError("br: at least one hash")
        return trusted_block_removed(hashes), offset
    if kind == "ac":
        _arity(rec, 2, "ac")
        return AllCleared(), offset
    if kind == "rq":
        _arity(rec, 9, "rq")
        return RequestEnqueued(*rec[2:]), offset
    if kind == "st":
        _arity(rec, 3, "st")
        return RequestStarted(rec[2]), offset
    if kind == "pe":
        _arity(rec, 3, "pe")
        return RequestPreempted(rec[2]), offset
    if kind == "ft":
        _arity(rec, 4, "ft", optional=5)
        return FirstToken(*rec[2:]), offset
    if kind == "fi":
        _arity(rec, 6, "fi", optional=1)
        return RequestFinished(*rec[2:]), offset
    if kind == "rj":
        _arity(rec, 4, "rj", optional=3)
        return RequestRejected(*rec[2:]), offset
    if kind == "hb":
        _arity(rec, 11, "hb", optional=len(_HEARTBEAT_TAIL))
        models = rec[10]
        if not isinstance(models, list):
            raise CodecError("hb: models must be a list")
        return LoadHeartbeat(*rec[2:10], tuple(models), *rec[11:]), offset
    raise CodecError(f"unknown event kind {kind!r}")


# --------------------------------------------------------------------------- snapshots


def encode_snapshot(snap: Snapshot) -> bytes:
    """Serialise a snapshot to one binary value (an 8-byte header length, header, block bytes)."""
    blob: list[bytes] = []
    chains = []
    for bs in snap.blocks:
        blob.extend(bs.blocks)
        chains.append([bs.parent_hash, list(bs.hashes), [len(b) for b in bs.blocks]])
    hb = None
    if snap.heartbeat is not None:
        env = Envelope(snap.engine_id, snap.epoch, 0, 0.0, snap.heartbeat)
        hb = _record(env, [])[2:]
    header = orjson.dumps([1, snap.engine_id, snap.epoch, snap.seq, snap.stream_id, chains, hb])
    return len(header).to_bytes(8, "big") + header + b"".join(blob)


def decode_snapshot(data: bytes) -> Snapshot:
    """Inverse of :func:`encode_snapshot`; raises CodecError on anything malformed."""
    try:
        if not isinstance(data, bytes) or len(data) < 8:
            raise CodecError("snapshot too short")
        n = int.from_bytes(data[:8], "big")
        if n > len(data) - 8:
            raise CodecError("snapshot header length out of range")
        head = orjson.loads(data[8 : 8 + n])
        blob = data[8 + n :]
        if not isinstance(head, list) or len(head) != 7 or head[0] != 1:
            raise CodecError("snapshot header must be [1, engine, epoch, seq, id, chains, hb]")
        _, engine_id, epoch, seq, stream_id, chains, hb = head
        if not isinstance(chains, list):
            raise CodecError("snapshot chains must be a list")
        blocks = []
        offset = 0
        for chain in chains:
            if not isinstance(chain, list) or len(chain) != 3:
                raise CodecError("snapshot chain must be [parent, hashes, lengths]")
            bs, offset = _decode_record("bs", ["bs", 0.0, *chain], blob, offset)
            blocks.append(bs)
        if offset != len(blob):
            raise CodecError("trailing snapshot bytes")
        heartbeat = None
        if hb is not None:
            heartbeat, _ = _decode_record("hb", ["hb", 0.0, *hb], b"", 0)
        return Snapshot(engine_id, epoch, seq, stream_id, tuple(blocks), heartbeat)
    except CodecError:
        raise
    except (EventError, orjson.JSONDecodeError, TypeError, ValueError, IndexError) as exc:
        raise CodecError(str(exc) or type(exc).__name__) from exc
