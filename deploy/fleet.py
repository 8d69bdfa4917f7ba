"""``kvgate up``: the distributed topology (Redis, router, gateways, engines) as local processes.

The same shape as ``deploy/compose`` and ``deploy/k8s``, on one machine: every component is a
separate ``python -m kvgate ...`` process on a free loopback port, talking through a real Redis.
It is the quickest way to see the remote-router deployment work end to end, and the harness the
deploy tests use.

Functional core / I/O shell: :func:`plan_fleet` turns a :class:`FleetConfig` and a supply of
ports into the exact command lines (pure, tested on its own, and reused by the tests that check
the manifests against the real CLI); :class:`Fleet` starts them, waits until each answers,
prints where everything is, and on Ctrl-C, SIGTERM or ``--duration`` stops them in reverse
order: SIGTERM to each process group, a bounded wait, then SIGKILL, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvgate.cli_support import redis_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# Functional core: what to run
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What ``kvgate up`` starts; built once from the command line."""

    engines: int = 4
    gateways: int = 2
    model: str = "kvgate-sim"
    profile: str | None = None  # engine cost profile name; None = the engine's default
    policy: str | None = None  # router policy; None = the router's default
    prefix: str = "kvgate:"  # broker key prefix: a unique one keeps fleets on one Redis apart
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One component: the ``kvgate`` arguments that start it and where it answers."""

    name: str  # unique: "router", "gateway-0", "engine-3"
    role: str  # "router" | "gateway" | "engine"
    argv: tuple[str, ...]  # after ``kvgate``: ("engine", "--port", "4100", ...)
    url: str
    ready_path: str = "/health"
    # Ready when GET ready_path answers 2xx and, if set, its JSON field ``name`` is >= ``value``.
    ready_at_least: tuple[str, int] | None = None


def plan_fleet(config: FleetConfig, broker_url: str, ports: Iterator[int]) -> list[ProcessSpec]:
    """The processes of a fleet, in start order (engines, router, gateways); pure.

    Engines come first so that the router's first read of the streams already finds their
    snapshots and heartbeats; gateways come last because they need the router's URL.
    """
    if config.engines < 1 or config.gateways < 1:
        raise ValueError("a fleet needs at least one engine and one gateway")
    specs: list[ProcessSpec] = []
    for i in range(config.engines):
        port = next(ports)
        url = f"http://{LOOPBACK}:{port}"
        argv = [
            "engine",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--engine-id",
            f"engine-{i}",
            "--url-advertised",
            url,
            "--model",
            config.model,
            "--broker",
            broker_url,
            "--broker-prefix",
            config.prefix,
        ]
        if config.profile:
            argv += ["--profile", config.profile]
        specs.append(ProcessSpec(f"engine-{i}", "engine", (*argv, *config.engine_args), url))

    router_port = next(ports)
    router_url = f"http://{LOOPBACK}:{router_port}"
    argv = [
        "router",
        "--host",
        LOOPBACK,
        "--port",
        str(router_port),
        "--broker",
        broker_url,
        "--broker-prefix",
        config.prefix,
    ]
    if config.policy:
        argv += ["--policy", config.policy]
    # Up once caught up with the broker and knowing an engine (engines start first).
    specs.append(
        ProcessSpec(
            "router", "router", (*argv, *config.router_args), router_url, ready_path="/ready"
        )
    )

    for i in range(config.gateways):
        port = next(ports)
        url = f"http://{LOOPBACK}:{port}"
        argv = ["gateway", "--host", LOOPBACK, "--port", str(port), "--router-url", router_url]
        specs.append(
            ProcessSpec(
                f"gateway-{i}",
                "gateway",
                (*argv, *config.gateway_args),
                url,
                # Up means every engine is usable through this gateway, so that the first
                # request a user (or a test) sends is routed among all of them.
                ready_path="/ready",
                ready_at_least=("usable_engines", config.engines),
            )
        )
    return specs


def free_ports() -> Iterator[int]:
    """Free loopback ports, none repeated (the OS may hand a just-closed port back at once)."""
    seen: set[int] = set()
    while True:
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in seen:
            seen.add(port)
            yield port


# --------------------------------------------------------------------------------------------
# I/O shell: Redis, processes, readiness, shutdown
# --------------------------------------------------------------------------------------------


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True if a Redis server at ``url`` answers PING (any auth or db in the URL is honoured)."""
    import redis  # the fleet shell is the only part of deploy that talks to Redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class PrivateRedis:
    """A redis-server of the fleet's own on a free loopback port, without persistence."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://{LOOPBACK}:{port}/0"
        self.dir = tempfile.mkdtemp(prefix="kvgate-up-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> PrivateRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FleetError(
                "no Redis answers on 127.0.0.1:6379 and redis-server is not installed: "
                "install it (apt-get install redis-server) or pass --redis-url"
            )
        argv = [binary, "--port", str(self.port), "--bind", LOOPBACK, "--save", ""]
        argv += ["--appendonly", "no", "--dir", self.dir]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while not redis_answers(self.url, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(1.0)
                raise FleetError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self, grace_s: float) -> None:
        if self.proc is not None:
            _stop_group(self.proc, grace_s)
        shutil.rmtree(self.dir, ignore_errors=True)


class FleetError(RuntimeError):
    """The fleet could not start; the message says which part and why."""


def _die_with_parent() -> None:
    """In the child (Linux): get SIGTERM if ``kvgate up`` itself dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM the process group, wait at most ``grace_s``, then SIGKILL whatever is left."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while something it started lingers: the group is killed either way.
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)


def http_ready(url: str, at_least: tuple[str, int] | None = None, timeout_s: float = 1.0) -> bool:
    """True if GET ``url`` answers 2xx (and its JSON field ``at_least[0]`` >= ``at_least[1]``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            if not 200 <= resp.status < 300:
                return False
            if at_least is None:
                return True
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    name, minimum = at_least
    value = body.get(name) if isinstance(body, dict) else None
    return isinstance(value, int | float) and value >= minimum


@dataclass
class Running:
    """A started component."""

    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    exit_reported: bool = False


@dataclass
class Fleet:
    """Starts, watches and stops one fleet. Use :meth:`start`, then :meth:`wait`, then
    :meth:`stop` (always, in a ``finally``)."""

    config: FleetConfig
    redis_url: str | None = None  # None: 127.0.0.1:6379 if it answers, else a private server
    log_dir: Path | None = None
    ready_timeout_s: float = 60.0
    grace_s: float = 10.0
    out: TextIO = field(default_factory=lambda: sys.stdout)
    running: list[Running] = field(default_factory=list)
    broker_url: str = ""
    private_redis: PrivateRedis | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        """Redis, then every component in plan order, each waited for before the next role."""
        ports = free_ports()
        self.broker_url = self._redis(ports)
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="kvgate-up-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        specs = plan_fleet(self.config, self.broker_url, ports)
        for role in ("engine", "router", "gateway"):
            group = [s for s in specs if s.role == role]
            for spec in group:
                self.running.append(self._spawn(spec))
            self._wait_ready([r for r in self.running if r.spec.role == role])

    def _redis(self, ports: Iterator[int]) -> str:
        if self.redis_url:
            if not redis_answers(self.redis_url):
                raise FleetError(f"no Redis answers at {self.redis_url}")
            return self.redis_url
        if redis_answers(DEFAULT_REDIS_URL, 0.5):
            return DEFAULT_REDIS_URL
        self.private_redis = PrivateRedis(next(ports)).start(self.ready_timeout_s)
        return self.private_redis.url

    def _spawn(self, spec: ProcessSpec) -> Running:
        assert self.log_dir is not None
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvgate", *spec.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our own group: Ctrl-C reaches only us, we stop them
                preexec_fn=_die_with_parent,
            )
        return Running(spec, proc, log_path)

    def _wait_ready(self, group: list[Running]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(group)
        while pending:
            if self._stop.is_set():
                raise FleetError("interrupted while starting")
            for r in list(pending):
                if r.proc.poll() is not None:
                    raise FleetError(
                        f"{r.spec.name} exited with status {r.proc.returncode} while starting; "
                        f"last lines of {r.log_path}:\n{tail(r.log_path)}"
                    )
                if http_ready(r.spec.url + r.spec.ready_path, r.spec.ready_at_least, 0.5):
                    pending.remove(r)
            if pending and time.monotonic() > deadline:
                names = ", ".join(r.spec.name for r in pending)
                raise FleetError(
                    f"not ready after {self.ready_timeout_s:.0f} s: {names}; "
                    f"last lines of {pending[0].log_path}:\n{tail(pending[0].log_path)}"
                )
            if pending:
                time.sleep(0.1)

    def status(self) -> dict[str, Any]:
        """Where everything is, as printed and as written to ``--status-file``."""
        return {
            "redis": self.broker_url,
            "private_redis": self.private_redis is not None,
            "prefix": self.config.prefix,
            "log_dir": str(self.log_dir),
            "processes": [
                {
                    "name": r.spec.name,
                    "role": r.spec.role,
                    "url": r.spec.url,
                    "pid": r.proc.pid,
                    "log": str(r.log_path),
                    "command": ["kvgate", *r.spec.argv],
                }
                for r in self.running
            ],
        }

    def print_status(self) -> None:
        rows = [("redis", self.broker_url + ("  (private)" if self.private_redis else ""), "")]
        rows += [(r.spec.name, r.spec.url, str(r.proc.pid)) for r in self.running]
        width = max(len(name) for name, _, _ in rows)
        print("kvgate fleet is up:", file=self.out)
        for name, url, pid in rows:
            print(f"  {name:<{width}}  {url:<32} {('pid ' + pid) if pid else ''}", file=self.out)
        gateways = [r.spec.url for r in self.running if r.spec.role == "gateway"]
        print(f"  logs: {self.log_dir}", file=self.out)
        print(f"  try:  OPENAI_BASE_URL={gateways[0]}/v1 (any gateway works)", file=self.out)
        print("  Ctrl-C stops everything.", file=self.out)
        self.out.flush()

    def request_stop(self) -> None:
        """Ask :meth:`wait` to return (safe from a signal handler or another thread)."""
        self._stop.set()

    def wait(self, duration_s: float | None) -> None:
        """Until a stop request, the duration, or every component having exited; a component
        that exits is reported once (the others keep serving, as they would in production)."""
        deadline = None if not duration_s else time.monotonic() + duration_s
        while not self._stop.wait(0.2):
            if deadline is not None and time.monotonic() >= deadline:
                return
            for r in self.running:
                if not r.exit_reported and r.proc.poll() is not None:
                    r.exit_reported = True
                    print(
                        f"kvgate up: {r.spec.name} exited with status {r.proc.returncode} "
                        f"(log: {r.log_path})",
                        file=self.out,
                        flush=True,
                    )
            if self.running and all(r.exit_reported for r in self.running):
                return
            redis_proc = self.private_redis.proc if self.private_redis else None
            if redis_proc is not None and redis_proc.poll() is not None:
                print("kvgate up: the private redis-server exited", file=self.out, flush=True)
                return

    def stop(self) -> None:
        """Gateways first (they drain open streams), then the router, the engines, Redis."""
        for r in reversed(self.running):
            _stop_group(r.proc, self.grace_s)
        if self.private_redis is not None:
            self.private_redis.stop(self.grace_s)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument("--gateways", type=int, default=2, help="gateways (default 2)")
    parser.add_argument(
        "--redis-url",
        type=redis_url,
        default=None,
        help="Redis to use; default: 127.0.0.1:6379 if it answers, else a private redis-server",
    )
    parser.add_argument(
        "--broker-prefix",
        "--prefix",
        default=None,
        help="broker key prefix (default: a fresh 'kvgate-up:<pid>:' so fleets sharing one "
        "Redis stay apart)",
    )
    parser.add_argument("--model", default="kvgate-sim", help="model name the engines serve")
    parser.add_argument("--profile", default=None, help="engine cost profile (engine default)")
    parser.add_argument("--policy", default=None, help="router policy (router default)")
    for role in ("engine", "router", "gateway"):
        parser.add_argument(
            f"--{role}-arg",
            dest=f"{role}_args",
            action="append",
            default=[],
            metavar="ARGS",
            help=f"extra arguments for every {role} (shell-quoted; repeatable)",
        )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds (default: Ctrl-C)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="component logs (default: tmp)")
    parser.add_argument(
        "--status-file", type=Path, default=None, help="write the fleet's addresses as JSON here"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=60.0, help="seconds each component may take to start"
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds each component may take to stop"
    )


def _split(chunks: Iterable[str]) -> tuple[str, ...]:
    return tuple(arg for chunk in chunks for arg in shlex.split(chunk))


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    return FleetConfig(
        engines=args.engines,
        gateways=args.gateways,
        model=args.model,
        profile=args.profile,
        policy=args.policy,
        prefix=args.broker_prefix or f"kvgate-up:{os.getpid()}:",
        engine_args=_split(args.engine_args),
        router_args=_split(args.router_args),
        gateway_args=_split(args.gateway_args),
    )


def _install_signal_handlers(fleet: Fleet) -> Callable[[], None]:
    """SIGINT/SIGTERM ask the fleet to stop; returns a function restoring the old handlers."""

    def handler(signum: int, frame: object) -> None:
        fleet.request_stop()

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, previous)

    return restore


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        plan_fleet(config, "redis://check", iter(range(1, 1 << 16)))  # reject bad counts early
    except ValueError as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 2
    fleet = Fleet(
        config,
        redis_url=args.redis_url,
        log_dir=args.log_dir,
        ready_timeout_s=args.ready_timeout,
        grace_s=args.grace,
    )
    restore = _install_signal_handlers(fleet)
    try:
        fleet.start()
        fleet.print_status()
        if args.status_file is not None:
            tmp = args.status_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(fleet.status(), indent=2))
            tmp.replace(args.status_file)  # readers never see half a file
        fleet.wait(args.duration)
        return 0
    except FleetError as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("kvgate up: stopping", file=sys.stderr, flush=True)
        fleet.stop()
        restore()
