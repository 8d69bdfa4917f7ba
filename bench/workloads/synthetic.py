"""Synthetic workload families after Preble's evaluation (arXiv 2407.00023, section 5), seeded.

Each family reproduces the prefix-sharing shape of one of Preble's workloads; lengths are
lognormal around medians close to Preble's Table 1 (approximate: the shapes matter here, not the
exact datasets):

* ``tool_use`` (ToolBench): a pool of tool prompts (~1.6k tokens each) picked with Zipf
  popularity, then a unique question (~160 tokens); short answers (~40 tokens).
* ``long_doc_qa`` (LooGLE): a pool of long documents (8k-24k tokens), several questions each;
  answers ~16 tokens.
* ``programming`` (APPS): one long shared system prompt with few-shot examples (~2k tokens),
  then a unique problem (~400 tokens); answers ~300 tokens.
* ``multi_turn_chat``: sessions of several turns; each turn resends the whole history (shared
  system prompt, earlier user and assistant messages) plus a new user message.
* ``chat_sessions`` (not in Preble): the same sessions as conversations go, each turn waiting
  for the answer before it (which the engine caches), closed-loop within a session.
* ``zipf_doc_qa`` (not in Preble): document QA over a large library with Zipf popularity, every
  prompt opening with the same short instruction (shorter than one KV block), mixed with unique
  chat requests: more distinct documents than one engine caches, so placement decides hit rates.

Arrivals are open-loop (but for ``chat_sessions``' later turns): Poisson by default, Gamma with
coefficient of variation ``cv`` for bursts.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

from bench.workloads.request import (
    DEFAULT_MODEL,
    Endpoint,
    Request,
    Segment,
    Turn,
    content_seed,
    tokens_for_bytes,
)
from kvgate.slo import SLO_CLASSES, Slo

BPT = 4  # bytes per token (kvgate's token rule)


def arrivals(rng: random.Random, rate: float, duration: float, cv: float = 1.0) -> list[float]:
    """Open-loop arrival times in ``[0, duration)`` at ``rate`` per second.

    ``cv == 1`` is a Poisson process; other values draw Gamma inter-arrival times with that
    coefficient of variation (bursty when above 1).
    """
    if not rate > 0 or not duration > 0:
        return []
    if not cv > 0:
        raise ValueError("cv must be positive")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate) if cv == 1.0 else rng.gammavariate(shape, scale)
        if t >= duration:
            return out
        out.append(t)


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal draw around ``median``, clipped to ``[lo, hi]``."""
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


class Zipf:
    """Ranks ``0..n-1`` with probability proportional to ``1 / (rank + 1) ** s``."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1:
            raise ValueError("Zipf needs n >= 1")
        self.cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))

    def sample(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self.cum, rng.random() * self.cum[-1]), len(self.cum) - 1)


def _seg(namespace: str, tokens: int, *parts: int | str) -> Segment:
    return Segment(content_seed(namespace, *parts), tokens * BPT)


def make_request(
    request_id: str,
    arrival: float,
    turns: tuple[Turn, ...],
    output_tokens: int,
    *,
    endpoint: Endpoint,
    kind: str,
    slo: Slo,
    model: str,
    session: str | None = None,
) -> Request:
    """A request whose input token count follows kvgate's token rule on its routing key."""
    probe = Request(request_id, arrival, turns, 1, 1, endpoint=endpoint)
    return Request(
        request_id=request_id,
        arrival=arrival,
        turns=turns,
        input_tokens=tokens_for_bytes(probe.key_len),
        output_tokens=max(1, output_tokens),
        slo=slo,
        model=model,
        session=session,
        endpoint=endpoint,
        kind=kind,
    )


def tool_use(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    n_tools: int = 200,
    zipf_s: float = 1.1,
    tool_tokens: float = 1600,
    question_tokens: float = 160,
    output_tokens: float = 40,
    cv: float = 1.0,
    slo: Slo = SLO_CLASSES["relaxed"],
    model: str = DEFAULT_MODEL,
) -> list[Request]:
    """ToolBench-like: shared tool prompts with Zipf popularity, unique questions."""
    rng = random.Random(f"tool_use:{seed}")
    sizes = [lognormal_int(rng, tool_tokens, 0.4, 300, 8000) for _ in range(n_tools)]
    zipf = Zipf(n_tools, zipf_s)
    out = []
    for i, t in enumerate(arrivals(rng, rate, duration, cv)):
        tool = zipf.sample(rng)
        turns = (
            Turn("system", (_seg("tool", sizes[tool], seed, tool),)),
            Turn(
                "user",
                (_seg("tool-q", lognormal_int(rng, question_tokens, 0.5, 8, 2000), seed, i),),
            ),
        )
        out_tokens = lognormal_int(rng, output_tokens, 0.6, 1, 1000)
        out.append(
            make_request(
                f"tool-{seed}-{i}",
                t,
                turns,
                out_tokens,
                endpoint="chat",
                kind="tool_use",
                slo=slo,
                model=model,
            )
        )
    return out


def long_doc_qa(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    n_docs: int = 40,
    zipf_s: float = 0.6,
    doc_tokens: tuple[int, int] = (8000, 24000),
    question_tokens: float = 60,
    output_tokens: float = 16,
    cv: float = 1.0,
    slo: Slo = SLO_CLASSES["relaxed"],
    model: str = DEFAULT_MODEL,
) -> list[Request]:
    """LooGLE-like: long shared documents, many short questions about each."""
    rng = random.Random(f"long_doc_qa:{seed}")
    sizes = [rng.randint(*doc_tokens) for _ in range(n_docs)]
    zipf = Zipf(n_docs, zipf_s)
    out = []
    for i, t in enumerate(arrivals(rng, rate, duration, cv)):
        doc = zipf.sample(rng)
        q = lognormal_int(rng, question_tokens, 0.4, 8, 1000)
        turns = (Turn("", (_seg("doc", sizes[doc], seed, doc), _seg("doc-q", q, seed, i))),)
        out_tokens = lognormal_int(rng, output_tokens, 0.6, 1, 500)
        out.append(
            make_request(
                f"doc-{seed}-{i}",
                t,
                turns,
                out_tokens,
                endpoint="completions",
                kind="long_doc_qa",
                slo=slo,
                model=model,
            )
        )
    return out


def programming(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    n_system_prompts: int = 1,
    system_tokens: int = 2000,
    problem_tokens: float = 400,
    output_tokens: float = 300,
    cv: float = 1.0,
    slo: Slo = SLO_CLASSES["relaxed"],
    model: str = DEFAULT_MODEL,
) -> list[Request]:
    """APPS-like: a long shared system prompt (few-shot examples), unique problems."""
    rng = random.Random(f"programming:{seed}")
    out = []
    for i, t in enumerate(arrivals(rng, rate, duration, cv)):
        sp = rng.randrange(n_system_prompts)
        turns = (
            Turn("system", (_seg("code-sys", system_tokens, seed, sp),)),
            Turn(
                "user",
                (_seg("code-q", lognormal_int(rng, problem_tokens, 0.5, 20, 4000), seed, i),),
            ),
        )
        out_tokens = lognormal_int(rng, output_tokens, 0.5, 1, 2000)
        out.append(
            make_request(
                f"code-{seed}-{i}",
                t,
                turns,
                out_tokens,
                endpoint="chat",
                kind="programming",
                slo=slo,
                model=model,
            )
        )
    return out


def multi_turn_chat(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    mean_turns: float = 4.0,
    think_time_s: float = 10.0,
    system_tokens: int = 300,
    user_tokens: float = 120,
    output_tokens: float = 200,
    cv: float = 1.0,
    slo: Slo = SLO_CLASSES["relaxed"],
    model: str = DEFAULT_MODEL,
    wait_for_answer: bool = False,
) -> list[Request]:
    """Sessions whose every turn resends the history; ``rate`` counts requests, not sessions.

    Session starts are open-loop at ``rate / mean_turns``; a session's next turn comes an
    exponential think time after the previous one (not after its answer: open loop; a rate
    scale that compresses the think times sends most next turns before the answer they resend
    exists). With ``wait_for_answer`` (the ``chat_sessions`` workload) each turn names the one
    before it (``Request.after``) and its own answer (``Request.reply``): the simulator sends it
    the think time after that answer ends, and the engine caches the answer, as a user's next
    turn and a real engine's cache go.
    """
    rng = random.Random(f"multi_turn_chat:{seed}")
    out = []
    system = Turn("system", (_seg("chat-sys", system_tokens, seed),))
    for s, start in enumerate(arrivals(rng, rate / mean_turns, duration, cv)):
        n_turns = 1 + int(rng.expovariate(1.0 / max(mean_turns - 1, 1e-9)))
        history: tuple[Turn, ...] = (system,)
        t = start
        before: str | None = None
        for k in range(n_turns):
            if t >= duration:
                break
            user = Turn(
                "user", (_seg("chat-u", lognormal_int(rng, user_tokens, 0.6, 4, 4000), seed, s, k),)
            )
            answer = lognormal_int(rng, output_tokens, 0.6, 1, 2000)
            turns = (*history, user)
            reply = _seg("chat-a", answer, seed, s, k)
            req = make_request(
                f"chat-{seed}-{s}-{k}",
                t,
                turns,
                answer,
                endpoint="chat",
                kind="multi_turn_chat",
                slo=slo,
                model=model,
                session=f"s{seed}-{s}",
            )
            if wait_for_answer:
                req = req.with_(after=before, reply=reply)
            out.append(req)
            before = req.request_id
            history = (*turns, Turn("assistant", (reply,)))
            t += rng.expovariate(1.0 / think_time_s)
    out.sort(key=lambda r: r.arrival)
    return out


def chat_sessions(rate: float, duration: float, seed: int = 0, **kw: Any) -> list[Request]:
    """Conversations: multi_turn_chat's sessions, each turn sent when the answer before it ends.

    The same requests as :func:`multi_turn_chat` (``wait_for_answer``): each turn names the one
    before it and its own answer, which the engine caches as vLLM and SGLang cache output.
    """
    return multi_turn_chat(rate, duration, seed, wait_for_answer=True, **kw)


def zipf_doc_qa(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    n_docs: int = 300,
    zipf_s: float = 1.0,
    doc_tokens: float = 3000,
    question_tokens: float = 40,
    output_tokens: float = 120,
    chat_share: float = 0.3,
    cv: float = 1.0,
    slo: Slo = SLO_CLASSES["relaxed"],
    model: str = DEFAULT_MODEL,
) -> list[Request]:
    """Zipf-popular documents (lognormal sizes around ``doc_tokens``) behind one shared 3-token
    instruction, a unique question each; ``chat_share`` of the requests are unique chats."""
    rng = random.Random(f"zipf_doc_qa:{seed}")
    sizes = [lognormal_int(rng, doc_tokens, 0.6, 300, 16000) for _ in range(n_docs)]
    zipf = Zipf(n_docs, zipf_s)
    header = _seg("zdoc-header", 3, seed)  # shorter than a block: must never count as cached
    out = []
    for i, t in enumerate(arrivals(rng, rate, duration, cv)):
        if rng.random() < chat_share:
            segs = (_seg("zdoc-chat", lognormal_int(rng, 600, 0.8, 8, 6000), seed, i),)
            kind, n_out = "chat", lognormal_int(rng, 150, 0.7, 1, 1500)
        else:
            doc = zipf.sample(rng)
            q = lognormal_int(rng, question_tokens, 0.5, 4, 400)
            segs = (header, _seg("zdoc", sizes[doc], seed, doc), _seg("zdoc-q", q, seed, i))
            kind, n_out = "doc_qa", lognormal_int(rng, output_tokens, 0.6, 1, 1000)
        out.append(
            make_request(
                f"zdoc-{seed}-{i}",
                t,
                (Turn("", segs),),
                n_out,
                endpoint="completions",
                kind=kind,
                slo=slo,
                model=model,
            )
        )
    return out


def qwen_mix(
    rate: float,
    duration: float,
    seed: int = 0,
    *,
    chat_lengths: Sequence[tuple[int, int]] | None = None,
    weights: dict[str, float] | None = None,
    cv: float = 1.0,
    model: str = DEFAULT_MODEL,
) -> list[Request]:
    """A QwenTrace-style mix of chat / image / search / file tasks with FlowPrefill's SLOs.

    Defaults (assumptions, documented in docs/BENCHMARKS.md): 55% chat, 15% image, 20% search,
    10% file. Chat lengths are drawn from ``chat_lengths`` (the Azure conversation trace when
    given) behind one of 8 shared system prompts; image requests carry a unique ~1k-token image;
    search requests one of 4 shared instruction prompts plus 2k-6k unique retrieved tokens;
    file requests ask about one of 200 files (8k-32k tokens, Zipf popularity).
    """
    weights = weights or {"chat": 0.55, "image": 0.15, "search": 0.2, "file": 0.1}
    unknown = set(weights) - {"chat", "image", "search", "file"}
    if unknown:
        raise ValueError(f"unknown task kinds: {sorted(unknown)}")
    kinds = list(weights)
    cum = list(itertools.accumulate(weights[k] for k in kinds))
    rng = random.Random(f"qwen_mix:{seed}")
    file_sizes = [rng.randint(8000, 32000) for _ in range(200)]
    files = Zipf(200, 0.8)
    out = []
    for i, t in enumerate(arrivals(rng, rate, duration, cv)):
        kind = kinds[min(bisect.bisect_left(cum, rng.random() * cum[-1]), len(kinds) - 1)]
        if kind == "chat":
            if chat_lengths:
                n_in, n_out = chat_lengths[rng.randrange(len(chat_lengths))]
            else:
                n_in = lognormal_int(rng, 800, 0.9, 16, 8000)
                n_out = lognormal_int(rng, 150, 0.8, 1, 1500)
            sp = rng.randrange(8)
            sys_tokens = min(200, max(n_in // 2, 1))
            turns = (
                Turn("system", (_seg("qw-chat-sys", sys_tokens, seed, sp),)),
                Turn("user", (_seg("qw-chat", max(n_in - sys_tokens, 1), seed, i),)),
            )
        elif kind == "image":
            turns = (
                Turn("system", (_seg("qw-img-sys", 120, seed),)),
                Turn(
                    "user",
                    (
                        _seg("qw-img", lognormal_int(rng, 1000, 0.3, 256, 4000), seed, i),
                        _seg("qw-img-q", lognormal_int(rng, 40, 0.5, 4, 400), seed, i),
                    ),
                ),
            )
            n_out = lognormal_int(rng, 120, 0.6, 1, 1000)
        elif kind == "search":
            sp = rng.randrange(4)
            turns = (
                Turn("system", (_seg("qw-search-sys", 500, seed, sp),)),
                Turn(
                    "user",
                    (
                        _seg("qw-search", rng.randint(2000, 6000), seed, i),
                        _seg("qw-search-q", lognormal_int(rng, 30, 0.5, 4, 300), seed, i),
                    ),
                ),
            )
            n_out = lognormal_int(rng, 250, 0.5, 1, 1500)
        else:
            f = files.sample(rng)
            turns = (
                Turn(
                    "user",
                    (
                        _seg("qw-file", file_sizes[f], seed, f),
                        _seg("qw-file-q", lognormal_int(rng, 50, 0.5, 4, 400), seed, i),
                    ),
                ),
            )
            n_out = lognormal_int(rng, 300, 0.5, 1, 2000)
        out.append(
            make_request(
                f"qw-{seed}-{i}",
                t,
                turns,
                n_out,
                endpoint="chat",
                kind=kind,
                slo=SLO_CLASSES[kind],
                model=model,
            )
        )
    return out
