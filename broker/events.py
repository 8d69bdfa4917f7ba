"""Every event kvgate's engines publish, in one place.

An engine (through ``engine_reporter``) publishes :class:`Envelope` objects: a header (engine id,
epoch, sequence number, engine wall time) around one payload event. Payloads are frozen, slotted
dataclasses that validate themselves when built, so a bad value is rejected where it is made, not
deep inside the router. The wire format lives in :mod:`broker.codec`; this module does no I/O.

Contract (DESIGN.md section 2):

* one stream per engine; ``seq`` increases by one per event within an ``epoch``; a new epoch
  starts on every engine start;
* a gap in ``seq``, a new epoch, or :class:`AllCleared` makes the router rebuild the engine;
* a stored block is announced as the bytes it covers, chained to its parent:
  ``hash = H(parent_hash, block_bytes)`` (see :mod:`engine_reporter.hashing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

U64_MAX = (1 << 64) - 1
# an engine's part in a prefill/decode disaggregated fleet (LoadHeartbeat.role)
ROLES: tuple[str, ...] = ("both", "prefill", "decode")
# the order an engine serves its prefill queue in (LoadHeartbeat.queue_order): ``deadline``,
# S-EDF (a request due sooner overtakes, one that can no longer make its deadline is rejected;
# kvgate's ``slo`` scheduler, in its engine and in vLLM), or ``arrival``, first come first
# served with nothing rejected for its SLO (vLLM's own scheduler; kvgate's ``fcfs``/``preble``)
QUEUE_ORDERS: tuple[str, ...] = ("deadline", "arrival")
# why an engine refused a request (RequestRejected.cause): unsaid (""), its TTFT SLO cannot be
# met even by its prefill alone (``ttft``), or its TPOT SLO even by one decode step of it alone
# (``tpot``); the engine's own time for that prefill or step is the event's ``estimate_ms``, for
# ``estimate_tokens`` (the uncached prompt tokens, or the request's mean context decoding)
REJECT_CAUSES: tuple[str, ...] = ("", "ttft", "tpot")


# a heartbeat's profile: a name, or a profile inline as JSON (kvgate.cost_model.announced_profile)
MAX_PROFILE_CHARS = 4096
# blocks one BlockStored or BlockRemoved names: 2M tokens in 16-token blocks, past any model's
# context (300,000 in one event took the router's event loop for 0.4 s)
MAX_BLOCKS_PER_EVENT = 1 << 17


class EventError(ValueError):
    """An event (or a field of one) that breaks the contract."""


def _check_u64(name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise EventError(f"{name} must be an unsigned 64-bit int, got {value!r}")


def _check_count(name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise EventError(f"{name} must be a non-negative int, got {value!r}")


MAX_TEXT_CHARS = 256  # an id (engine, request) or another short text field


def _check_text(name: str, value: object, *, max_len: int = MAX_TEXT_CHARS) -> None:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise EventError(f"{name} must be a non-empty string of at most {max_len} chars")


def _check_block_count(n: int) -> None:
    if n > MAX_BLOCKS_PER_EVENT:
        raise EventError(f"{n} blocks in one event: at most {MAX_BLOCKS_PER_EVENT}")


def _check_ms(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise EventError(f"{name} must be a finite non-negative number, got {value!r}")


# --------------------------------------------------------------------------- KV cache events


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A chain of newly cached blocks: ``blocks[i]`` hashes to ``hashes[i]``.

    ``parent_hash`` is the block before ``blocks[0]`` (None at the start of a prompt); each later
    block's parent is the one before it. Only newly stored blocks are announced.
    """

    KIND: ClassVar[str] = "bs"
    parent_hash: int | None
    hashes: tuple[int, ...]
    blocks: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.parent_hash is not None:
            _check_u64("parent_hash", self.parent_hash)
        if not isinstance(self.hashes, tuple) or not isinstance(self.blocks, tuple):
            raise EventError("hashes and blocks must be tuples")
        if not self.hashes or len(self.hashes) != len(self.blocks):
            raise EventError(
                f"need one block per hash, got {len(self.hashes)} hashes, {len(self.blocks)} blocks"
            )
        _check_block_count(len(self.hashes))
        for h in self.hashes:
            _check_u64("hash", h)
        for b in self.blocks:
            if not isinstance(b, bytes) or not b:
                raise EventError("each block must be non-empty bytes")


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted (by hash). Unknown hashes are ignored by receivers."""

    KIND: ClassVar[str] = "br"
    hashes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.hashes, tuple) or not self.hashes:
            raise EventError("hashes must be a non-empty tuple")
        _check_block_count(len(self.hashes))
        for h in self.hashes:
            _check_u64("hash", h)


def stored_events(
    parent_hash: int | None, hashes: list[int], blocks: list[bytes]
) -> list[BlockStored]:
    """A chain of new blocks as BlockStored events of at most ``MAX_BLOCKS_PER_EVENT`` each
    (each piece's parent the last block of the one before)."""
    out: list[BlockStored] = []
    for i in range(0, len(hashes), MAX_BLOCKS_PER_EVENT):
        j = i + MAX_BLOCKS_PER_EVENT
        out.append(BlockStored(parent_hash, tuple(hashes[i:j]), tuple(blocks[i:j])))
        parent_hash = hashes[min(j, len(hashes)) - 1]
    return out


def removed_events(hashes: list[int]) -> list[BlockRemoved]:
    """Evicted blocks as BlockRemoved events of at most ``MAX_BLOCKS_PER_EVENT`` each."""
    step = MAX_BLOCKS_PER_EVENT
    return [BlockRemoved(tuple(hashes[i : i + step])) for i in range(0, len(hashes), step)]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped its whole cache (reset, restart): receivers forget all its blocks."""

    KIND: ClassVar[str] = "ac"


# --------------------------------------------------------------------------- request lifecycle


@dataclass(frozen=True, slots=True)
class RequestEnqueued:
    """A request reached the engine's waiting queue.

    ``key_bytes`` is the routing key's length, ``cached_bytes`` how much of it the engine's prefix
    cache held on arrival; SLOs in milliseconds (None: the engine's default applies).
    """

    KIND: ClassVar[str] = "rq"
    request_id: str
    key_bytes: int
    cached_bytes: int
    input_tokens: int
    max_tokens: int
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        _check_text("request_id", self.request_id)
        for name in ("key_bytes", "cached_bytes", "input_tokens", "max_tokens"):
            _check_count(name, getattr(self, name))
        if self.cached_bytes > self.key_bytes:
            raise EventError("cached_bytes cannot exceed key_bytes")
        _check_ms("ttft_slo_ms", self.ttft_slo_ms, optional=True)
        _check_ms("tpot_slo_ms", self.tpot_slo_ms, optional=True)


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """The request's prefill began (it left the waiting queue)."""

    KIND: ClassVar[str] = "st"
    request_id: str

    def __post_init__(self) -> None:
        _check_text("request_id", self.request_id)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request produced its first output token ``ttft_ms`` after arrival.

    Optional (engines that know them; routers fit the engine's real prefill speed from them,
    :class:`kvgate.cost_model.SpeedFit`): ``prefill_ms``, the execution time of the prefill
    batches that computed this request's prompt (not the time it waited, nor decode steps in
    between); ``prefill_tokens``, the new tokens of those batches (its own and its batch
    mates'); ``context_tokens``, its cached tokens when its prefill began. On a decode engine
    that took the prompt's KV from a prefill engine: ``kv_transfer_ms``, how long moving
    ``kv_transfer_tokens`` tokens of KV took (routers fit the link's real speed from them)."""

    KIND: ClassVar[str] = "ft"
    request_id: str
    ttft_ms: float
    prefill_ms: float | None = None
    prefill_tokens: int | None = None
    context_tokens: int | None = None
    kv_transfer_ms: float | None = None
    kv_transfer_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_text("request_id", self.request_id)
        _check_ms("ttft_ms", self.ttft_ms)
        _check_ms("prefill_ms", self.prefill_ms, optional=True)
        _check_ms("kv_transfer_ms", self.kv_transfer_ms, optional=True)
        if self.kv_transfer_tokens is not None:
            _check_count("kv_transfer_tokens", self.kv_transfer_tokens)
        if self.prefill_tokens is not None:
            _check_count("prefill_tokens", self.prefill_tokens)
        if self.context_tokens is not None:
            _check_count("context_tokens", self.context_tokens)


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """The request completed; ``tpot_ms`` is its mean time per output token after the first,
    ``max_tokens`` the cap it was given (None: not reported), against which routers learn how
    long answers are (:class:`kvgate.cost_model.OutputFit`)."""

    KIND: ClassVar[str] = "fi"
    request_id: str
    output_tokens: int
    ttft_ms: float
    tpot_ms: float
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_text("request_id", self.request_id)
        _check_count("output_tokens", self.output_tokens)
        _check_ms("ttft_ms", self.ttft_ms)
        _check_ms("tpot_ms", self.tpot_ms)
        if self.max_tokens is not None:
            _check_count("max_tokens", self.max_tokens)


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """The engine refused the request (e.g. its SLO cannot be met); ``reason`` says why, for
    people. ``cause``, ``estimate_ms`` and ``estimate_tokens`` say it for the router
    (:data:`REJECT_CAUSES`): the engine's own time for the prefill of the request's
    ``estimate_tokens`` uncached prompt tokens alone (``ttft``), or for one decode step of it
    alone at a context of ``estimate_tokens`` (``tpot``). An engine that refuses every request
    it is sent serves none, so nothing else it reports shows how fast it is; without these, a
    router that was told it is faster than it is keeps sending it requests. (The event carries
    the tokens: the gateway's report of the refusal usually reaches the router first, and the
    router forgets the request then.)"""

    KIND: ClassVar[str] = "rj"
    request_id: str
    reason: str
    cause: str = ""
    estimate_ms: float = 0.0
    estimate_tokens: int = 0

    def __post_init__(self) -> None:
        _check_text("request_id", self.request_id)
        _check_text("reason", self.reason, max_len=1024)
        if self.cause not in REJECT_CAUSES:
            raise EventError(f"cause must be one of {REJECT_CAUSES}, got {self.cause!r}")
        _check_ms("estimate_ms", self.estimate_ms)
        _check_count("estimate_tokens", self.estimate_tokens)


@dataclass(frozen=True, slots=True)
class RequestPreempted:
    """A running request was paused (prefill preemption or decode eviction); it resumes later."""

    KIND: ClassVar[str] = "pe"
    request_id: str

    def __post_init__(self) -> None:
        _check_text("request_id", self.request_id)


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class LoadHeartbeat:
    """The engine's load, sent periodically; also how routers learn an engine's address.

    ``vbs`` is SCORPIO's virtual batch size (sum of TRP over running requests), ``profile`` the
    engine's cost profile (:mod:`kvgate.cost_model`): its name where a router can load it by
    that name, else the profile itself as JSON (:func:`kvgate.cost_model.announced_profile`);
    ``url`` its OpenAI base URL.
    Optional, over the decode steps since the previous heartbeat (None: none ran, or unknown):
    ``decode_step_ms`` their mean duration, ``decode_batch`` their mean batch size and
    ``decode_context`` the mean context of their requests, in tokens (routers fit the engine's
    real decode speed from them). ``role`` is what the engine is for in a prefill/decode
    disaggregated fleet (:data:`ROLES`): ``prefill`` engines compute prompts and hand the KV
    on, ``decode`` engines take a prompt's KV from a prefill engine and generate, ``both``
    (colocated, the default) run whole requests. Optional, over the prefill work since the
    previous heartbeat, the operators done so far by a step still running included:
    ``prefill_ms`` its execution time and ``prefill_plan_ms`` what the cost profile the engine
    names gives for the same work (routers fit the engine's real prefill speed from their
    ratio within a heartbeat of its starting work, where a first token can take seconds).
    ``queue_order`` is the order its prefill queue is served in (:data:`QUEUE_ORDERS`): what a
    request queues behind there, and whether late work is dropped or still runs.
    ``kv_blocks_held`` (optional) is the blocks its requests hold: their pinned cached prefixes
    and their reservations, without the cached blocks no request uses (which ``kv_blocks_used``
    counts on kvgate's engine; vLLM's KV usage is this figure). Routers correct their own count
    of the memory their requests hold to it (a request's wait for memory is read from that).
    ``decode_tokens`` (optional) is the tokens the decode steps gave since the previous heartbeat
    (a step gives one to each request it decodes). With it and ``prefill_plan_ms`` but no
    ``prefill_ms`` (an engine that times no step, a vLLM behind the bridge: ``decode_step_ms`` is
    then its mean inter-token latency, prefill mixed into the steps) the interval's prefill, as
    the profile prices it, is spread over its ``decode_tokens / decode_batch`` steps, and the
    interval still says how fast the engine runs. ``prefill_chunk_tokens`` (optional) is the
    most new tokens of one prompt the engine prefills in one piece (None: whole prompts, or not
    known): each piece attends to the ones before it, so routers price a long prompt's prefill
    piece by piece (:meth:`kvgate.cost_model.CostProfile.prompt_prefill_ms`).
    """

    KIND: ClassVar[str] = "hb"
    waiting: int
    running: int
    queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    vbs: float
    profile: str
    url: str
    models: tuple[str, ...]
    decode_step_ms: float | None = None
    decode_batch: float | None = None
    decode_context: float | None = None
    role: str = "both"
    prefill_ms: float | None = None
    prefill_plan_ms: float | None = None
    queue_order: str = "deadline"
    kv_blocks_held: int | None = None
    decode_tokens: int | None = None
    prefill_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EventError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.queue_order not in QUEUE_ORDERS:
            raise EventError(
                f"queue_order must be one of {', '.join(QUEUE_ORDERS)}, got {self.queue_order!r}"
            )
        for name in (
            "decode_step_ms",
            "decode_batch",
            "decode_context",
            "prefill_ms",
            "prefill_plan_ms",
        ):
            _check_ms(name, getattr(self, name), optional=True)
        for name in (
            "waiting",
            "running",
            "queued_prefill_tokens",
            "kv_blocks_used",
            "kv_blocks_total",
        ):
            _check_count(name, getattr(self, name))
        _check_ms("vbs", self.vbs)
        _check_text("profile", self.profile, max_len=MAX_PROFILE_CHARS)
        _check_text("url", self.url, max_len=2048)
        if not isinstance(self.models, tuple):
            raise EventError("models must be a tuple")
        for m in self.models:
            _check_text("model", m)
        if self.kv_blocks_held is not None:
            _check_count("kv_blocks_held", self.kv_blocks_held)
        if self.decode_tokens is not None:
            _check_count("decode_tokens", self.decode_tokens)
        if self.prefill_chunk_tokens is not None:
            _check_count("prefill_chunk_tokens", self.prefill_chunk_tokens)
            if self.prefill_chunk_tokens < 1:
                raise EventError("prefill_chunk_tokens must be at least 1")


Event = (
    BlockStored
    | BlockRemoved
    | AllCleared
    | RequestEnqueued
    | RequestStarted
    | FirstToken
    | RequestFinished
    | RequestRejected
    | RequestPreempted
    | LoadHeartbeat
)

EVENT_TYPES: tuple[type, ...] = (
    BlockStored,
    BlockRemoved,
    AllCleared,
    RequestEnqueued,
    RequestStarted,
    FirstToken,
    RequestFinished,
    RequestRejected,
    RequestPreempted,
    LoadHeartbeat,
)
KV_EVENT_TYPES: tuple[type, ...] = (BlockStored, BlockRemoved, AllCleared)
BY_KIND: dict[str, type] = {t.KIND: t for t in EVENT_TYPES}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Envelope:
    """One published event with its header: who sent it, in which epoch, in what order."""

    engine_id: str
    epoch: str
    seq: int
    ts: float
    event: Event

    def __post_init__(self) -> None:
        _check_text("engine_id", self.engine_id)
        _check_text("epoch", self.epoch, max_len=64)
        _check_count("seq", self.seq)
        _check_ms("ts", self.ts)
        if type(self.event) not in BY_KIND.values():
            raise EventError(f"not an event: {type(self.event).__name__}")


def u64_tuple(value: object, what: str) -> tuple[int, ...]:
    """A list of unsigned 64-bit ints as a tuple (a plain loop: CPython 3.11 runs it faster
    than set/min/max over the list)."""
    if not isinstance(value, (list, tuple)):
        raise EventError(f"{what} must be a list of unsigned 64-bit ints")
    t = tuple(value)
    for h in t:
        if type(h) is not int or not 0 <= h <= U64_MAX:
            raise EventError(f"{what} must be unsigned 64-bit ints, got {h!r}")
    return t


# Builders for values a codec has already validated: they skip ``__post_init__``, since the
# ingest path builds millions of these (about 3x cheaper than validating each one again).
_new = object.__new__
_set = object.__setattr__


def trusted_envelope(engine_id: str, epoch: str, seq: int, ts: float, event: Event) -> Envelope:
    obj = _new(Envelope)
    _set(obj, "engine_id", engine_id)
    _set(obj, "epoch", epoch)
    _set(obj, "seq", seq)
    _set(obj, "ts", ts)
    _set(obj, "event", event)
    return obj


def trusted_block_stored(
    parent_hash: int | None, hashes: tuple[int, ...], blocks: tuple[bytes, ...]
) -> BlockStored:
    obj = _new(BlockStored)
    _set(obj, "parent_hash", parent_hash)
    _set(obj, "hashes", hashes)
    _set(obj, "blocks", blocks)
    return obj


def trusted_block_removed(hashes: tuple[int, ...]) -> BlockRemoved:
    obj = _new(BlockRemoved)
    _set(obj, "hashes", hashes)
    return obj


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An engine's complete cache state, valid as of stream entry ``stream_id``.

    ``seq`` is the last sequence number folded in, so a reader replays entries after
    ``stream_id`` and expects ``seq + 1`` next. ``blocks`` are stored chains in parent-first order;
    applying them to an empty view rebuilds the engine's cache exactly.
    """

    engine_id: str
    epoch: str
    seq: int
    stream_id: str
    blocks: tuple[BlockStored, ...]
    heartbeat: LoadHeartbeat | None = None

    def __post_init__(self) -> None:
        _check_text("engine_id", self.engine_id)
        _check_text("epoch", self.epoch, max_len=64)
        if type(self.seq) is not int or self.seq < -1:
            raise EventError("seq must be an int >= -1")
        if not isinstance(self.stream_id, str):
            raise EventError("stream_id must be a string")
        if not isinstance(self.blocks, tuple) or not all(
            isinstance(b, BlockStored) for b in self.blocks
        ):
            raise EventError("blocks must be a tuple of BlockStored")
