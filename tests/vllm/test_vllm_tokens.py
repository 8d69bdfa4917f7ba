"""Token ids to exact bytes from the model folder, checked against the real tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from engine_reporter.vllm.tokens import (
    TokenBytes,
    TokenizerError,
    UnknownTokenError,
    byte_level_alphabet,
    chat_opening,
)
from kvgate.openai_request import ChatTemplate

tokenizers = pytest.importorskip("tokenizers")


def test_alphabet_is_a_bijection_over_bytes() -> None:
    table = byte_level_alphabet()
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n")


def test_bytes_round_trip_through_the_real_tokenizer(
    model_dir: Path, token_bytes: TokenBytes
) -> None:
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(7)
    alphabet = "abc xyz\n\t<>|/ é日本🙂" + "".join(chr(c) for c in range(0x20, 0x7F))
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120)))
        ids = tok.encode(text, add_special_tokens=True).ids
        assert token_bytes.sequence_bytes(ids) == text.encode(), text
        # Any split into blocks gives the same bytes (even inside a multi-byte character).
        cut = rng.randint(1, len(ids))
        head = token_bytes.block_bytes(ids[:cut], at_start=True)
        tail = token_bytes.block_bytes(ids[cut:], at_start=False)
        assert head + tail == text.encode()


def test_leading_bos_only_at_the_start(token_bytes: TokenBytes) -> None:
    assert token_bytes.leading_ids == (0,) and token_bytes.bos_token == "<s>"
    assert token_bytes.special_ids == {0, 1, 2}
    assert token_bytes.block_bytes([0, 72], at_start=True) == token_bytes.token_bytes(72)
    assert token_bytes.block_bytes([0, 72], at_start=False) == b"<s>" + token_bytes.token_bytes(72)
    # Only one leading BOS is the tokenizer's; a second is text the prompt contained.
    assert token_bytes.block_bytes([0, 0, 72], at_start=True).startswith(b"<s>")
    assert token_bytes.block_bytes([1], at_start=True) == b"</s>"


def test_unknown_token_ids_raise(token_bytes: TokenBytes) -> None:
    with pytest.raises(UnknownTokenError):
        token_bytes.block_bytes([5, 99999], at_start=False)
    with pytest.raises(UnknownTokenError):
        token_bytes.block_bytes([5, -1], at_start=False)


def test_post_processor_prefix_wins_over_bos(model_dir: Path) -> None:
    tok = orjson.loads((model_dir / "tokenizer.json").read_bytes())
    tok["post_processor"] = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel"},
            {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": "<pad>", "type_id": 0}},
                    {"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "special_tokens": {
                    "<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                    "<pad>": {"id": "<pad>", "ids": [2], "tokens": ["<pad>"]},
                },
            },
        ],
    }
    tb = TokenBytes.from_json(tok, {"bos_token": "<s>"})
    assert tb.leading_ids == (2, 0)
    assert tb.block_bytes([2, 0, 72], at_start=True) == tb.token_bytes(72)
    assert tb.block_bytes([0, 72], at_start=True) == b"<s>" + tb.token_bytes(72)


def test_no_post_processor_falls_back_to_the_bos_token(model_dir: Path) -> None:
    tok = orjson.loads((model_dir / "tokenizer.json").read_bytes())
    tok["post_processor"] = None
    assert TokenBytes.from_json(tok, {"bos_token": {"content": "<s>"}}).leading_ids == (0,)
    assert TokenBytes.from_json(tok, {}).leading_ids == ()


def test_non_byte_level_tokenizers_are_refused(model_dir: Path, tmp_path: Path) -> None:
    tok = orjson.loads((model_dir / "tokenizer.json").read_bytes())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    tok["decoder"] = {"type": "Metaspace", "replacement": "▁"}
    with pytest.raises(TokenizerError, match="byte-level"):
        TokenBytes.from_json(tok)
    tok["model"]["type"] = "Unigram"
    with pytest.raises(TokenizerError, match="BPE"):
        TokenBytes.from_json(tok)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        TokenBytes.from_model_dir(tmp_path)


def test_chat_opening_of_templates() -> None:
    tiny = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    assert chat_opening(ChatTemplate(tiny, bos_token="<s>")) == b""  # writes no BOS
    llama3 = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    assert chat_opening(ChatTemplate(llama3, bos_token="<|begin_of_text|>")) == (
        b"<|start_header_id|>"
    )
    mistral = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}[INST] {{ m['content'] }} [/INST]"
        "{% endfor %}"
    )
    assert chat_opening(ChatTemplate(mistral, bos_token="<s>")) == b"[INST] "
    assert chat_opening(ChatTemplate(llama3, bos_token="")) == b""


def test_tiny_model_has_no_chat_opening(token_bytes: TokenBytes) -> None:
    assert token_bytes.chat_opening == b""
