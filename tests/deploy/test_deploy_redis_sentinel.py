"""The Kubernetes Redis set's start scripts, run for real on loopback addresses.

Each "pod" gets its own loopback IP (127.0.x.1-3, the same ports), so the scripts run exactly as
in the StatefulSet: a brand-new set elects the seed, the sentinels agree, a killed master fails
over, and the old master restarting rejoins as a replica of the new one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

SCRIPTS = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "redis"
PORT, SENTINEL_PORT = 6390, 26390
pytestmark = pytest.mark.redis


class RedisSet:
    """Three members (redis + sentinel each) started by the deploy scripts."""

    def __init__(self, tmp: Path, subnet: int) -> None:
        self.tmp = tmp
        self.hosts = [f"127.0.{subnet}.{i}" for i in (1, 2, 3)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, host: str, **extra: str) -> dict[str, str]:
        data = self.tmp / host
        data.mkdir(exist_ok=True)
        return {
            **os.environ,
            "SELF_HOST": host,
            "REDIS_PEERS": " ".join(self.hosts),
            "REDIS_PORT": str(PORT),
            "SENTINEL_PORT": str(SENTINEL_PORT),
            "DATA_DIR": str(data),
            "BIND": host,
            **extra,
        }

    def start(self, script: str, host: str, **extra: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{script}-{host}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            ["sh", str(SCRIPTS / script)],
            env=self.env(host, **extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def start_redis(self, host: str) -> subprocess.Popen[bytes]:
        proc = self.start("redis-start.sh", host, CONF_DIR=str(self.tmp / host / "redis"))
        wait_for(lambda: client(host, PORT).ping(), f"redis {host}")
        return proc

    def start_sentinel(self, host: str) -> None:
        self.start(
            "sentinel-start.sh",
            host,
            CONF_DIR=str(self.tmp / host / "sentinel"),
            DOWN_AFTER_MS="1000",
            FAILOVER_TIMEOUT_MS="3000",
            WAIT_S="20",
        )

    def master(self, via: str) -> str | None:
        try:
            answer = client(via, SENTINEL_PORT).sentinel_get_master_addr_by_name("kvgate")
        except (redis.RedisError, OSError):
            return None
        return answer[0] if answer else None

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def client(host: str, port: int) -> redis.Redis:
    return redis.Redis(host=host, port=port, socket_timeout=1, decode_responses=True)


def wait_for(check, what: str, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
            if value:
                return value
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def redis_set(tmp_path: Path) -> Iterator[RedisSet]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("redis-server and redis-cli are needed (apt-get install redis-server)")
    subnet = 100 + os.getpid() % 100  # parallel runs on one machine use different addresses
    rs = RedisSet(tmp_path, subnet)
    yield rs
    rs.stop()


def test_sentinel_set_bootstraps_fails_over_and_rejoins(redis_set: RedisSet) -> None:
    seed, second, third = redis_set.hosts
    old_master = redis_set.start_redis(seed)
    for host in (second, third):
        redis_set.start_redis(host)
    for host in redis_set.hosts:
        redis_set.start_sentinel(host)

    # A new set: the seed is master, the others replicate it, every sentinel agrees.
    for host in redis_set.hosts:
        assert wait_for(lambda h=host: redis_set.master(h), f"sentinel {host}") == seed
    info = client(seed, PORT).info("replication")
    assert info["role"] == "master"
    wait_for(lambda: client(seed, PORT).info("replication")["connected_slaves"] == 2, "replicas")
    wait_for(
        lambda: len(client(second, SENTINEL_PORT).sentinel_sentinels("kvgate")) == 2,
        "sentinels discovering each other",
    )
    client(seed, PORT).set("kvgate-deploy-test", "kept")
    assert client(seed, PORT).wait(2, 5000) == 2  # replicated before the master dies

    # The master dies: the sentinels promote a replica that has the data.
    os.killpg(old_master.pid, signal.SIGKILL)
    old_master.wait(5)
    new_master = wait_for(
        lambda: (m := redis_set.master(second)) != seed and m, "failover", timeout_s=30
    )
    assert new_master in (second, third)
    wait_for(lambda: client(new_master, PORT).info("replication")["role"] == "master", "promote")
    assert client(new_master, PORT).get("kvgate-deploy-test") == "kept"

    # The old master's pod restarts: it asks the sentinels and comes back as a replica.
    redis_set.start_redis(seed)
    info = wait_for(
        lambda: (i := client(seed, PORT).info("replication"))["role"] == "slave" and i, "rejoin"
    )
    assert info["master_host"] == new_master
