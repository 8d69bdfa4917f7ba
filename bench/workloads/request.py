"""The one request record every workload produces and every consumer (replay, simulator) reads.

A prompt is never stored as text: it is a sequence of :class:`Segment` (a content seed and a
length in bytes), rendered on demand into deterministic ASCII text. Two prompts that start with
the same segments start with the same bytes; different seeds give different bytes. This keeps an
hour of Mooncake (about 580 MB of prompt text) to a few MB in memory while the router still sees
real byte-level prefixes.

Routing keys come from :mod:`kvgate.openai_request` (the functions the gateway and the engine
use), so a simulated request and the same request replayed over HTTP have byte-identical keys.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from kvgate.openai_request import canonical_chat_bytes
from kvgate.slo import HEADER_TPOT, HEADER_TTFT, SLO_CLASSES, Slo

Endpoint = Literal["completions", "chat"]
DEFAULT_MODEL = "kvgate-sim"
BYTES_PER_TOKEN = 4  # kvgate's token rule (kvgate.cost_model): ceil(bytes / 4) tokens

# 64 printable characters (letters, digits, space, full stop): each random byte picks one, so
# the text is valid ASCII and JSON-safe, and every byte of a segment carries 6 bits of its seed.
_ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ."
_TO_TEXT = bytes(_ALPHABET[b % 64] for b in range(256))


def content_seed(namespace: str, *parts: int | str) -> int:
    """A 63-bit seed for a piece of content named by ``namespace`` and ``parts``.

    Namespaces keep workloads apart: Mooncake block 7 and tool prompt 7 are different text.
    """
    # (one part, the common case, without the join: a Qwen-Bailian trace names millions of
    # 16-token blocks)
    name = (
        f"{namespace}:{parts[0]}" if len(parts) == 1 else f"{namespace}:{':'.join(map(str, parts))}"
    )
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest()) >> 1


def segment_bytes(seed: int, n_bytes: int) -> bytes:
    """``n_bytes`` of ASCII text determined by ``seed``; a shorter length gives a prefix of it."""
    if n_bytes <= 0:
        return b""
    raw = hashlib.shake_128(seed.to_bytes(8, "little")).digest(n_bytes)
    return raw.translate(_TO_TEXT)


@dataclass(frozen=True, slots=True)
class Segment:
    """``n_bytes`` of the text named by ``seed`` (see :func:`segment_bytes`)."""

    seed: int
    n_bytes: int

    def render(self) -> bytes:
        return segment_bytes(self.seed, self.n_bytes)


@dataclass(frozen=True, slots=True)
class Turn:
    """One chat message (``role``) or, for a completion, the whole prompt (role ``""``)."""

    role: str
    segments: tuple[Segment, ...]

    def render(self) -> bytes:
        return b"".join(s.render() for s in self.segments)

    @property
    def n_bytes(self) -> int:
        return sum(s.n_bytes for s in self.segments)


def _chat_wrapper_bytes(role: str) -> int:
    """Bytes the canonical chat rendering adds around one message's text."""
    return len(b"<|" + role.encode() + b"|>\n") + 1


_GENERATION_PROMPT = len(b"<|assistant|>\n")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    ``input_tokens``/``output_tokens`` are what the trace states (sent to engines in the body
    field ``kvgate``); ``kind`` labels the family or SLO class for per-kind metrics.
    """

    request_id: str
    arrival: float
    turns: tuple[Turn, ...]
    input_tokens: int
    output_tokens: int
    slo: Slo = SLO_CLASSES["relaxed"]
    model: str = DEFAULT_MODEL
    session: str | None = None
    endpoint: Endpoint = "completions"
    kind: str = "default"
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    # a conversation's turn waits for the answer to the turn before it, ``after`` (its request
    # id): the simulator sends it that turn's gap in the workload after that answer ends (None:
    # at its arrival). ``reply`` is the answer this turn gets, as the next turn resends it (the
    # simulated model answers it, and the engine caches it as vLLM and SGLang cache output)
    after: str | None = None
    reply: Segment | None = None
    # the cap the client states (its max_tokens; None: exactly ``output_tokens``, as a trace
    # replay with ignore_eos states it). Clients usually state far more than the answer takes
    # (an SDK default, the model's limit): routers and schedulers see only this cap, and the
    # answer still ends at ``output_tokens``
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if not (math.isfinite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"{self.request_id}: arrival must be finite and >= 0")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"{self.request_id}: token counts must be >= 1")
        if self.max_tokens is not None and self.max_tokens < self.output_tokens:
            raise ValueError(f"{self.request_id}: max_tokens below the answer's output_tokens")
        if not self.turns:
            raise ValueError(f"{self.request_id}: a request needs a prompt")
        if self.endpoint == "completions" and len(self.turns) != 1:
            raise ValueError(f"{self.request_id}: a completion has exactly one prompt turn")

    # ------------------------------------------------------------------ content

    @property
    def key_len(self) -> int:
        """Length of :meth:`key` in bytes, without rendering it."""
        if self.endpoint == "completions":
            return self.turns[0].n_bytes
        return sum(t.n_bytes + _chat_wrapper_bytes(t.role) for t in self.turns) + _GENERATION_PROMPT

    def prompt_text(self) -> str:
        """The completion prompt (ASCII)."""
        return self.turns[0].render().decode("ascii")

    def messages(self) -> list[dict]:
        """The chat messages (OpenAI shape)."""
        return [{"role": t.role, "content": t.render().decode("ascii")} for t in self.turns]

    def key(self) -> bytes:
        """The routing key, exactly as the gateway and the engine derive it from the body."""
        if self.endpoint == "completions":
            return self.turns[0].render()
        return canonical_chat_bytes(self.messages())

    def answer_key(self) -> bytes:
        """What the answer (``reply``) adds to the key of the conversation's next turn: its text
        and the line end that closes an assistant message in the canonical rendering, after
        this key's closing ``<|assistant|>`` line (b"": no reply, or not a chat)."""
        if self.reply is None or self.endpoint != "chat":
            return b""
        return self.reply.render() + b"\n"

    # ------------------------------------------------------------------ wire

    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def body(
        self,
        *,
        model: str | None = None,
        stream: bool = True,
        hint: bool = True,
        ignore_eos: bool = True,
    ) -> dict:
        """The OpenAI request body.

        ``hint`` adds ``kvgate: {input_tokens, output_tokens}`` (kvgate engines honour it);
        ``ignore_eos`` asks vLLM/SGLang engines for exactly ``max_tokens`` tokens.
        """
        out: dict = {"model": model or self.model, "max_tokens": self.output_tokens}
        if self.endpoint == "completions":
            out["prompt"] = self.prompt_text()
        else:
            out["messages"] = self.messages()
        if stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        if self.session is not None:
            out["user"] = self.session
        if hint:
            out["kvgate"] = {
                "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
            }
        if ignore_eos:
            out["ignore_eos"] = True
        return out

    def headers(self) -> dict[str, str]:
        """SLO headers (kvgate.slo) and the session header."""
        out = {HEADER_TTFT: f"{self.slo.ttft_ms:g}", HEADER_TPOT: f"{self.slo.tpot_ms:g}"}
        if self.session is not None:
            out["x-kvgate-session"] = self.session
        return out

    @property
    def stated_tokens(self) -> int:
        """The answer's length as the client states it (max_tokens)."""
        return self.max_tokens or self.output_tokens

    def with_(self, **changes: object) -> Request:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return replace(self, **changes)


def tokens_for_bytes(n_bytes: int) -> int:
    """kvgate's token rule for a key of ``n_bytes`` (see kvgate.cost_model)."""
    return max(1, -(-n_bytes // BYTES_PER_TOKEN))
