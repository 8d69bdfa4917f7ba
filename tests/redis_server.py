"""Finding or starting a real Redis for tests (never skipped silently).

Order: ``REDIS_URL`` if set; else a server answering on 127.0.0.1:6379; else a private
``redis-server`` on a free loopback port (installed with apt-get if missing). Tests that stop and
restart Redis always get a private server of their own (:class:`RedisProcess`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def system_binary(name: str, debian_package: str) -> str:
    """Path of a system tool the tests need, installed with apt-get when missing (never skipped)."""
    path = shutil.which(name)
    if path:
        return path
    subprocess.run(
        "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
        + debian_package,
        shell=True,
        check=False,
        timeout=900,
    )
    path = shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} (Debian package {debian_package}) could not be installed")
    return path


def redis_server_binary() -> str:
    return system_binary("redis-server", "redis-server")


class RedisProcess:
    """A private redis-server on a loopback port, which a test may stop and start again."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _answers("127.0.0.1", self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def shared_redis_url() -> tuple[str, RedisProcess | None]:
    """The Redis URL the test session uses, and the process if this session started it."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url, None
    if _answers("127.0.0.1", 6379):
        return "redis://127.0.0.1:6379/0", None
    proc = RedisProcess().start()
    return proc.url, proc


def unique_prefix(tag: str) -> str:
    return f"kvgate-test:{tag}:{os.getpid()}:{time.monotonic_ns()}:"
