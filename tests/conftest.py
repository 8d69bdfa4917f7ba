"""Shared fixtures: a real Redis (found or started), private Redis servers, unique key prefixes;
the root logger as each test found it."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The repository root, so that a test folder named like a package (tests/broker, tests/gateway)
# is never mistaken for that package: a regular package on sys.path wins over such a folder.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from redis_server import RedisProcess, shared_redis_url, unique_prefix


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that runs a command's ``main`` configures the root logger (``setup_logging``: its
    level, its handlers); later tests' ``caplog`` then saw nothing below that level (a router
    CLI test at ``--log-level error`` hid a consumer's warnings from a broker test). Its level is
    put back, and a handler the test installed is taken off."""
    root = logging.getLogger()
    level, before = root.level, set(root.handlers)
    yield
    root.setLevel(level)
    for handler in root.handlers[:]:  # (pytest's own capture handlers come and go by phase)
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server; tests that use it never skip."""
    url, proc = shared_redis_url()
    yield url
    if proc is not None:
        proc.cleanup()


@pytest.fixture
def redis_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test (or earlier run) uses."""
    return unique_prefix(request.node.name[:40])


@pytest.fixture
def private_redis() -> Iterator[RedisProcess]:
    """A redis-server of this test's own, which the test may stop and restart."""
    proc = RedisProcess().start()
    yield proc
    proc.cleanup()
