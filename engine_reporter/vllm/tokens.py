"""Token ids to the exact prompt bytes, from a model folder's ``tokenizer.json``. Pure, offline.

In a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, Mistral-Nemo, ...) every vocabulary entry is
a fixed byte string written in a printable alphabet (each byte 0-255 has one character), so the
bytes of a token sequence are the concatenation of its tokens' bytes: no tokenizer run, no text
decoding, and a block boundary inside a multi-byte character still gives the exact bytes. Added
tokens (``<s>``, ``<|im_start|>``, ...) are written as plain text and map to their UTF-8 text.

Special tokens and the routing key (the rule that makes gateway keys and bridged blocks agree).
The gateway keys a completion on its prompt as sent, and a chat on the model's chat template
rendering (:func:`kvgate.openai_request.chat_key`, the file vLLM renders too). vLLM adds the
tokenizer's leading tokens (:attr:`TokenBytes.leading_ids`: the post-processor's ``<s> $A``
template, else the ``bos_token``) to completion prompts, and tokenizes chat renderings without
adding any, so a template that writes ``{{ bos_token }}`` yields the same leading BOS from text.
So, at the very start of a prompt (a block with no parent), the leading tokens map to:

* their text, when the chat template writes them and the tokens after them spell the
  template's fixed opening (:attr:`TokenBytes.chat_opening`, e.g. ``<|start_header_id|>``):
  this is a chat prompt, whose key starts with the BOS text;
* no bytes otherwise: a completion prompt, whose key never contained them.

Every other special token maps to its text, as it appears in a rendered template. The one
prompt this gets wrong is a completion whose text starts with the template's opening but not
with the BOS text (a chat rendered by the client, without its BOS): it routes on load alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from kvgate.openai_request import ChatTemplate, RequestError

# Conversations rendered to find a template's fixed opening; the probes mark where content starts.
_PROBE = "\x00kvgate-probe-"
_PROBE_CHATS = (
    [{"role": "user", "content": _PROBE + "1"}],
    [{"role": "system", "content": _PROBE + "2"}, {"role": "user", "content": _PROBE + "3"}],
    [{"role": "user", "content": _PROBE + "4"}, {"role": "assistant", "content": _PROBE + "5"},
     {"role": "user", "content": _PROBE + "6"}],
)  # fmt: skip


class TokenizerError(ValueError):
    """A tokenizer the bridge cannot map to bytes exactly (the text says why)."""


class UnknownTokenError(ValueError):
    """A token id outside the tokenizer's vocabulary."""


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: one printable character per byte value, character -> byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the characters from
    U+0100 upwards, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _has_byte_level(component: Any) -> bool:
    if not isinstance(component, Mapping):
        return False
    if component.get("type") == "ByteLevel":
        return True
    inner = component.get("pretokenizers") or component.get("decoders") or []
    return any(_has_byte_level(c) for c in inner)


def _template_prefix(processor: Any) -> list[int] | None:
    """Ids a post-processor puts before the text of a single sequence (None: no template)."""
    if not isinstance(processor, Mapping):
        return None
    kind = processor.get("type")
    if kind == "Sequence":
        for inner in processor.get("processors") or []:
            found = _template_prefix(inner)
            if found is not None:
                return found
        return None
    if kind == "TemplateProcessing":
        special = processor.get("special_tokens") or {}
        out: list[int] = []
        for piece in processor.get("single") or []:
            if "Sequence" in piece:
                return out
            token = piece.get("SpecialToken", {}).get("id")
            spec = special.get(token) or {}
            out.extend(int(i) for i in spec.get("ids") or [])
        return out
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls = processor.get("cls")
        return [int(cls[1])] if isinstance(cls, list) and len(cls) == 2 else []
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True, slots=True)
class TokenBytes:
    """Maps token ids to bytes for one tokenizer (see the module docstring for the BOS rule)."""

    table: tuple[bytes, ...]
    leading_ids: tuple[int, ...]
    special_ids: frozenset[int]
    bos_token: str | None = None
    normalized: bool = False
    chat_opening: bytes = b""  # what a chat prompt spells after a BOS its template writes

    @classmethod
    def from_model_dir(cls, path: str | Path) -> TokenBytes:
        """Load ``tokenizer.json`` (and ``tokenizer_config.json`` when present) from a folder."""
        folder = Path(path)
        tok_path = folder / "tokenizer.json"
        if not tok_path.exists():
            raise TokenizerError(f"{folder}: no tokenizer.json (a fast tokenizer is needed)")
        config: dict = {}
        if (folder / "tokenizer_config.json").exists():
            config = orjson.loads((folder / "tokenizer_config.json").read_bytes())
        tokens = cls.from_json(orjson.loads(tok_path.read_bytes()), config)
        try:
            template = ChatTemplate.from_model_dir(folder)
        except ValueError:
            return tokens  # no chat template: every prompt is keyed as sent
        return replace(tokens, chat_opening=chat_opening(template))

    @classmethod
    def from_json(
        cls, tok: Mapping[str, Any], config: Mapping[str, Any] | None = None
    ) -> TokenBytes:
        """Build from parsed ``tokenizer.json`` and ``tokenizer_config.json`` contents."""
        config = config or {}
        model = tok.get("model") or {}
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), Mapping):
            raise TokenizerError(f"not a BPE tokenizer (model type {model.get('type')!r})")
        if not (_has_byte_level(tok.get("pre_tokenizer")) or _has_byte_level(tok.get("decoder"))):
            raise TokenizerError(
                "not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer or decoder): its "
                "tokens do not map to fixed bytes"
            )
        alphabet = byte_level_alphabet()
        by_id: dict[int, bytes] = {}
        for text, tid in model["vocab"].items():
            try:
                by_id[int(tid)] = bytes(alphabet[ch] for ch in text)
            except KeyError:
                # Not in the byte alphabet: a token written as plain text.
                by_id[int(tid)] = text.encode()
        special_ids: set[int] = set()
        ids_by_text: dict[str, int] = {}
        for added in tok.get("added_tokens") or []:
            tid = int(added["id"])
            by_id[tid] = str(added["content"]).encode()
            ids_by_text[str(added["content"])] = tid
            if added.get("special"):
                special_ids.add(tid)
        size = max(by_id) + 1 if by_id else 0
        table = tuple(by_id.get(i, b"") for i in range(size))
        missing = [i for i in range(size) if i not in by_id]
        if missing:
            raise TokenizerError(f"token ids without an entry: {missing[:5]}")

        bos = _token_text(config.get("bos_token"))
        leading = _template_prefix(tok.get("post_processor"))
        if not leading and bos is not None and bos in ids_by_text:
            leading = [ids_by_text[bos]]
        return cls(
            table=table,
            leading_ids=tuple(leading or ()),
            special_ids=frozenset(special_ids),
            bos_token=bos,
            normalized=tok.get("normalizer") is not None,
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The fixed bytes of one token."""
        if not 0 <= token_id < len(self.table):
            raise UnknownTokenError(f"token id {token_id} outside the vocabulary")
        return self.table[token_id]

    def block_bytes(self, token_ids: Sequence[int], *, at_start: bool) -> bytes:
        """Bytes one cached block covers; ``at_start``: it is the first block of a prompt."""
        n = len(self.leading_ids)
        if at_start and n and tuple(token_ids[:n]) == self.leading_ids:
            rest = self._join(token_ids[n:])
            opening = self.chat_opening
            if opening and rest and (rest.startswith(opening) or opening.startswith(rest)):
                return self._join(token_ids[:n]) + rest  # a chat prompt: its key has the BOS
            return rest
        return self._join(token_ids)

    def _join(self, token_ids: Sequence[int]) -> bytes:
        table = self.table
        try:
            if token_ids and min(token_ids) < 0:
                raise IndexError
            return b"".join([table[t] for t in token_ids])
        except IndexError:
            bad = next(t for t in token_ids if not 0 <= t < len(table))
            raise UnknownTokenError(f"token id {bad} outside the vocabulary") from None

    def sequence_bytes(self, token_ids: Iterable[int]) -> bytes:
        """Bytes of a whole prompt's token ids (for tests and tools)."""
        return self.block_bytes(list(token_ids), at_start=True)


def chat_opening(template: ChatTemplate) -> bytes:
    """The bytes every chat rendering spells right after the BOS text the template writes
    (empty when the template writes no BOS, or its renderings share nothing after it)."""
    bos = template.bos_token
    if not bos:
        return b""
    heads: list[str] = []
    for messages in _PROBE_CHATS:
        try:
            text = template.render(messages)
        except RequestError:
            continue  # e.g. a template that refuses a system message
        if not text.startswith(bos):
            return b""
        cut = text.find(_PROBE)
        heads.append(text[len(bos) : cut if cut >= 0 else len(text)])
    if not heads:
        return b""
    common = heads[0]
    for head in heads[1:]:
        k = 0
        while k < min(len(common), len(head)) and common[k] == head[k]:
            k += 1
        common = common[:k]
    return common.encode()
