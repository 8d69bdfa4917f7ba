"""Gateway keys and bridge-reported blocks agree, for completions and for chat.

The vLLM side is reproduced as vLLM does it: the chat template rendered by a Hugging Face style
Jinja environment (independent of kvgate's ChatTemplate), the text tokenized by the model's
tokenizer (``tokenizers``, the library vLLM's fast tokenizer runs on) with special tokens added
for completions and not for chat, the token ids cut into ``block_size`` blocks and announced as
vLLM announces them. The bridge's blocks must then be a prefix of the gateway's routing key.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine_reporter.hashing import chain_hashes
from engine_reporter.vllm.tokens import TokenBytes, chat_opening
from engine_reporter.vllm.translate import Translator
from engine_reporter.vllm.wire import VllmBlockStored
from kvgate.openai_request import ChatTemplate, parse_request

tokenizers = pytest.importorskip("tokenizers")

BLOCK = 32
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant for routing research. " * 4},
    {"role": "user", "content": "Résumé of naïve café prices in 日本 and 中国, please. " * 3},
    {"role": "assistant", "content": "Sure: ☕ costs differ. " * 2},
    {"role": "user", "content": "And the tea? 🍵 " * 3},
]
PROMPT = (
    "System: you answer like a pirate, citing sources. User question: what is the weight of "
    "an unladen swallow, in grams, ± 5%? Ünïcödé text keeps multi-byte characters across "
    "block boundaries: 東京 大阪 京都 🚀🚀🚀. "
) * 3


def hf_render(source: str, messages: list, *, bos: str, eos: str) -> str:
    """What Hugging Face's apply_chat_template (used by vLLM) renders."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


def vllm_blocks(token_ids: list[int]) -> VllmBlockStored:
    """vLLM's announcement of a prompt's full blocks (hashes are opaque ids here)."""
    n = len(token_ids) // BLOCK
    return VllmBlockStored(
        block_hashes=tuple(range(1000, 1000 + n)),
        parent_block_hash=None,
        token_ids=tuple(token_ids[: n * BLOCK]),
        block_size=BLOCK,
        medium="GPU",
    )


def bridged_bytes(tokens: TokenBytes, token_ids: list[int]) -> tuple[bytes, list[bytes]]:
    events = Translator(tokens).apply(vllm_blocks(token_ids))
    assert len(events) == 1
    stored = events[0]
    # The hashes the bridge reports are kvgate's chain over exactly these bytes.
    assert list(stored.hashes) == chain_hashes(None, stored.blocks)
    return b"".join(stored.blocks), list(stored.blocks)


def assert_agree(key: bytes, covered: bytes, token_count: int) -> None:
    assert covered, "no full block was announced"
    assert key.startswith(covered), (covered[:80], key[:80])
    # Only the partial tail block is missing: the bridge covered all full blocks of the prompt.
    assert len(covered) >= len(key) * (token_count // BLOCK * BLOCK) / token_count * 0.8


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_completion_key_matches_bridged_blocks(tokenizer, token_bytes: TokenBytes) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids  # vLLM adds BOS
    assert ids[0] == 0
    covered, blocks = bridged_bytes(token_bytes, ids)
    key = parse_request("completions", {"model": "tiny", "prompt": PROMPT}, {}).key
    assert_agree(key, covered, len(ids))
    assert len(blocks) == len(ids) // BLOCK
    assert not covered.startswith(b"<s>")


def test_chat_key_matches_bridged_blocks(
    tokenizer, token_bytes: TokenBytes, model_dir: Path
) -> None:
    source = (model_dir / "chat_template.jinja").read_text()
    text = hf_render(source, MESSAGES, bos="<s>", eos="</s>")
    assert text.startswith("<|system|>You are") and text.endswith("\n<|assistant|>")
    ids = tokenizer.encode(text, add_special_tokens=False).ids  # vLLM: chat adds none
    covered, _ = bridged_bytes(token_bytes, ids)
    template = ChatTemplate.from_model_dir(model_dir)
    body = {"model": "tiny", "messages": MESSAGES}
    key = parse_request("chat", body, {}, template=template).key
    assert key == text.encode()
    assert_agree(key, covered, len(ids))


def test_chat_template_writing_bos_matches_too(tokenizer, token_bytes: TokenBytes) -> None:
    template = ChatTemplate(LLAMA3_STYLE, bos_token="<s>", eos_token="</s>")
    tokens = replace(token_bytes, chat_opening=chat_opening(template))
    assert tokens.chat_opening == b"<|"
    text = hf_render(LLAMA3_STYLE, MESSAGES, bos="<s>", eos="</s>")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[0] == 0 and 1 in ids  # BOS from the text, EOS tokens inside
    covered, _ = bridged_bytes(tokens, ids)
    key = parse_request("chat", {"model": "tiny", "messages": MESSAGES}, {}, template=template).key
    assert key == text.encode() and key.startswith(b"<s><|system|>")
    assert covered.startswith(b"<s>")  # the key has the BOS text the template wrote
    assert b"</s>" in covered  # special tokens inside the prompt keep their text
    assert_agree(key, covered, len(ids))

    # With the same model, completions still route on the prompt as sent, without BOS ...
    plain = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    covered, _ = bridged_bytes(tokens, plain)
    assert_agree(PROMPT.encode(), covered, len(plain))
    # ... and so does a chat the client rendered itself, BOS text included (vLLM then adds a
    # second BOS in front).
    ids = tokenizer.encode(text, add_special_tokens=True).ids
    assert ids[:2] == [0, 0]
    covered, _ = bridged_bytes(tokens, ids)
    key = parse_request("completions", {"model": "tiny", "prompt": text}, {}).key
    assert_agree(key, covered, len(ids))


def test_different_prompts_diverge(tokenizer, token_bytes: TokenBytes) -> None:
    a = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    b = tokenizer.encode(PROMPT.replace("pirate", "parrot"), add_special_tokens=True).ids
    cov_a, blocks_a = bridged_bytes(token_bytes, a)
    _, blocks_b = bridged_bytes(token_bytes, b)
    assert blocks_a[0] != blocks_b[0]
    key_b = PROMPT.replace("pirate", "parrot").encode()
    assert not key_b.startswith(cov_a)
