"""``kvgate gateway --workers N``: N gateway processes behind one port, and their supervisor.

One Python process tops out at one core; a production Python gateway runs several. Each worker
is a whole gateway (its own HTTP server, upstream pool, health checks and routing service);
the parent only supervises.

The shared port (SO_REUSEPORT): the parent binds a socket with SO_REUSEPORT and never listens on
it. That reserves the port (it resolves ``--port 0`` and keeps the port owned while a worker
restarts: no other program can take it, and Linux only lets sockets of the same user join the
group) without receiving connections, since the kernel hands connections only to listening
sockets. Each worker then listens on its own SO_REUSEPORT socket on that port and the kernel
spreads new connections over the workers by a hash of the connection. A single listening socket
inherited by every worker was the alternative; it was not chosen because every worker's event
loop wakes on each new connection and the first one awake accepts a whole burst (libuv and
asyncio accept in a loop), so keep-alive clients that connect at once pile up on one worker.
The cost of SO_REUSEPORT: connections still in a worker's accept queue when it dies are reset
(Linux >= 5.14 migrates them with ``net.ipv4.tcp_migrate_req=1``); a graceful stop closes a
worker's listener first and lets it finish what it has accepted.

Routing state: workers do not share memory. With the embedded router each worker consumes the
same engine events from a shared broker, so N > 1 needs ``redis://`` (or a remote router,
``--router-url``); ``memory://`` would give every worker a private, partial view and is refused.
What a worker decides itself (the in-flight load it routed, its speculative "this prefix is now
cached there" entries) stays in that worker until the engines' events bring it to everyone.

The supervisor forwards SIGTERM/SIGINT to the workers (each drains like a single gateway),
restarts a worker that dies unexpectedly (non-zero exit or killed) with exponential backoff,
gives up (and stops everything, exit 1) after ``max_fast_failures`` consecutive failures of one
worker slot that each lived less than ``fast_failure_s``, and exits when every worker has stopped.
A worker that exits 0 was told to stop (by a signal someone sent it) and is not restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.cli_support import listening

log = logging.getLogger("kvgate.gateway.workers")

WORKER_ENV = "KVGATE_WORKER"  # the worker's slot index, set in each worker process
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def resolve_workers(requested: int) -> int:
    """``0`` means one worker per CPU this process may run on."""
    if requested < 0:
        raise ValueError(f"--workers must be >= 0, not {requested}")
    if requested > 0:
        return requested
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def multi_worker_error(workers: int, router_url: str | None, broker_url: str) -> str | None:
    """Why these options cannot run ``workers`` processes, or None when they can."""
    if workers <= 1:
        return None
    if not hasattr(socket, "SO_REUSEPORT"):
        return "--workers > 1 needs SO_REUSEPORT, which this platform lacks"
    if not router_url and broker_url.startswith("memory:"):
        return (
            f"--workers {workers} with the in-process memory:// broker: each worker would route "
            "on its own partial view of the engines. Use a shared broker "
            "(--broker-url redis://...) or a remote router (--router-url), or --workers 1"
        )
    return None


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (never listen) a SO_REUSEPORT socket on host:port: the port is ours, connections
    go only to the workers' listening sockets. ``port`` 0 picks a free one."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


# ---- the restart policy (pure) ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    fast_failure_s: float = 10.0  # a worker that dies younger than this failed "fast"
    max_fast_failures: int = 5  # consecutive fast failures of one slot before giving up
    backoff_s: float = 0.5  # delay before the first restart, doubled per fast failure
    max_backoff_s: float = 10.0


@dataclass(slots=True)
class RestartTracker:
    """Consecutive fast failures per worker slot; a worker that lived long resets its count."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    fast_failures: dict[int, int] = field(default_factory=dict)

    def failed(self, slot: int, lived_s: float) -> float | None:
        """The delay before restarting ``slot``, or None to give up."""
        p = self.policy
        count = self.fast_failures.get(slot, 0) + 1 if lived_s < p.fast_failure_s else 1
        self.fast_failures[slot] = count
        if lived_s < p.fast_failure_s and count >= p.max_fast_failures:
            return None
        return min(p.backoff_s * 2 ** (count - 1), p.max_backoff_s)


# ---- the supervisor --------------------------------------------------------------------------


@dataclass(slots=True)
class _Worker:
    slot: int
    process: multiprocessing.process.BaseProcess
    started: float


WorkerMain = Callable[[argparse.Namespace, int, int], int]


def _worker_entry(
    main: WorkerMain, args: argparse.Namespace, slot: int, port: int, reserved_fd: int
) -> None:
    """First code in a forked worker: default signal handling (its event loop installs its own),
    die with the parent, then run the gateway."""
    for sig in (*_STOP_SIGNALS, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    with contextlib.suppress(OSError):
        os.close(reserved_fd)
    _die_with_parent()
    os.environ[WORKER_ENV] = str(slot)
    sys.exit(main(args, slot, port))


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the supervisor dies (even by SIGKILL), so a worker is
    never left serving on its own; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Starts ``workers`` gateway processes on one port and keeps them running (see the module
    docstring). ``main(args, slot, port) -> exit code`` is what a worker runs."""

    def __init__(
        self,
        args: argparse.Namespace,
        workers: int,
        main: WorkerMain,
        *,
        policy: RestartPolicy | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.args = args
        self.count = workers
        self.main = main
        self.tracker = RestartTracker(policy or RestartPolicy())
        self.drain_timeout_s = drain_timeout_s
        self.ctx = multiprocessing.get_context("fork")  # the parent runs no loop nor threads
        self.workers: dict[int, _Worker] = {}
        self.restart_at: dict[int, float] = {}
        self.stop_signal: int | None = None
        self.stop_deadline = float("inf")
        self.exit_code = 0
        self.gave_up = False

    def _spawn(self, slot: int, port: int, reserved_fd: int) -> None:
        p = self.ctx.Process(
            target=_worker_entry,
            args=(self.main, self.args, slot, port, reserved_fd),
            name=f"kvgate-gateway-{slot}",
        )
        p.start()
        self.workers[slot] = _Worker(slot, p, time.monotonic())
        log.info("worker %d started", slot, extra={"worker": slot, "pid": p.pid})

    def _begin_stop(self, sig: int) -> None:
        """Forward the stop signal; a second one kills whoever is left."""
        self.restart_at.clear()
        if self.stop_signal is None:
            self.stop_signal = sig
            self.stop_deadline = time.monotonic() + self.drain_timeout_s + 5.0
            log.info("stopping %d workers (%s)", len(self.workers), signal.Signals(sig).name)
            self._signal_all(sig)
        else:
            log.warning("second stop signal: killing the workers")
            self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for w in self.workers.values():
            if w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, sig)

    def _reap(self, w: _Worker) -> None:
        code = w.process.exitcode
        assert code is not None
        del self.workers[w.slot]
        w.process.join()
        w.process.close()
        lived = time.monotonic() - w.started
        stopping = self.stop_signal is not None
        clean = code == 0 or (stopping and code in (-signal.SIGTERM, -signal.SIGINT))
        if clean:
            log.info("worker %d exited (%s)", w.slot, code, extra={"worker": w.slot})
            return
        if stopping:
            log.warning("worker %d exited with %s while stopping", w.slot, code)
            self.exit_code = self.exit_code or 1
            return
        delay = self.tracker.failed(w.slot, lived)
        if delay is None:
            log.error(
                "worker %d died %d times in a row within %.0f s of starting (last: %s); "
                "giving up and stopping the gateway",
                w.slot,
                self.tracker.policy.max_fast_failures,
                self.tracker.policy.fast_failure_s,
                code,
            )
            self.gave_up = True
            self.exit_code = 1
            self._begin_stop(signal.SIGTERM)
            return
        log.warning(
            "worker %d died (%s) after %.1f s; restarting in %.1f s",
            w.slot,
            code,
            lived,
            delay,
            extra={"worker": w.slot},
        )
        self.restart_at[w.slot] = time.monotonic() + delay

    def run(self, host: str, port: int) -> int:
        """Reserve the port, start the workers, supervise until they have all stopped."""
        with listening(host, port):
            reserved = reserve_port(host, port)
        port = reserved.getsockname()[1]
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        pending: list[int] = []
        previous = {s: signal.signal(s, lambda n, _f: pending.append(n)) for s in _STOP_SIGNALS}
        previous_wakeup = signal.set_wakeup_fd(wake_w)
        try:
            for slot in range(self.count):
                self._spawn(slot, port, reserved.fileno())
            log.info(
                "gateway supervisor: %d workers on %s:%d",
                self.count,
                host,
                port,
                extra={"url": f"http://{host}:{port}", "workers": self.count},
            )
            while self.workers or self.restart_at:
                now = time.monotonic()
                timeout = 1.0
                if self.restart_at:
                    timeout = max(0.0, min(timeout, min(self.restart_at.values()) - now))
                sentinels = [w.process.sentinel for w in self.workers.values()]
                multiprocessing.connection.wait([*sentinels, wake_r], timeout)
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
                while pending:
                    self._begin_stop(pending.pop(0))
                for w in list(self.workers.values()):
                    if w.process.exitcode is not None:
                        self._reap(w)
                now = time.monotonic()
                if self.stop_signal is not None and now > self.stop_deadline and self.workers:
                    log.warning("workers still running after the drain timeout: killing them")
                    self._signal_all(signal.SIGKILL)
                    self.stop_deadline = float("inf")
                for slot, at in list(self.restart_at.items()):
                    if at <= now:
                        del self.restart_at[slot]
                        self._spawn(slot, port, reserved.fileno())
        finally:
            if self.workers:  # an exception in the supervisor: leave no worker behind
                self._signal_all(signal.SIGKILL)
                for w in self.workers.values():
                    w.process.join(5)
            signal.set_wakeup_fd(previous_wakeup)
            for s, h in previous.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
            reserved.close()
        log.info("gateway supervisor: all workers stopped", extra={"exit_code": self.exit_code})
        return self.exit_code
