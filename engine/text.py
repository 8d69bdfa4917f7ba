"""Deterministic output text for the simulated model (there are no weights).

Output token ``i`` of request ``r`` is one short word chosen by a stable hash of ``(r, i)``: a
space and three letters (consonant, vowel, consonant), i.e. exactly 4 bytes, which matches the
token rule ``bytes_per_token = 4`` of :mod:`kvgate.cost_model`. The same request id always gets
the same text, so responses are reproducible across runs and machines. The simulated model never
stops early: a response has exactly ``max_tokens`` (or the trace's ``output_tokens``) tokens and
its ``finish_reason`` is ``"length"``.
"""

from __future__ import annotations

import xxhash

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
VOCAB: tuple[str, ...] = tuple(
    f" {a}{v}{b}" for a in _CONSONANTS for v in _VOWELS for b in _CONSONANTS
)
TOKEN_BYTES = 4


def token_text(request_id: str, index: int) -> str:
    """The text of output token ``index`` (0-based) of ``request_id``."""
    h = xxhash.xxh3_64_intdigest(f"{request_id}\x00{index}".encode())
    return VOCAB[h % len(VOCAB)]


def tokens_text(request_id: str, start: int, count: int) -> str:
    """Output tokens ``start .. start + count - 1`` of ``request_id``, concatenated."""
    return "".join(token_text(request_id, i) for i in range(start, start + count))
