"""Stopping background tasks within a bound, even when a cancellation gets lost.

``task.cancel()`` only asks: the code the task is in may not pass the CancelledError on. On
Python 3.11, ``asyncio.wait_for`` returns its inner result instead of raising when the cancel
lands just after the inner awaitable finished (CPython gh-86296, gone with 3.12's rewrite), and
redis-py wraps the socket write of every command in ``asyncio.wait_for``. A task cancelled while
it talks to Redis can then carry on as if nothing happened, and an ``await task`` after
``cancel()`` waits for ever for a loop that never ends. So background loops also check a stop
flag, and whoever stops them waits with :func:`stop_tasks`: bounded, cancelling again a task
that is still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("kvgate.aio")

RECANCEL_S = 0.5  # a task still running this long after cancel() is cancelled again


async def stop_tasks(
    tasks: Iterable[asyncio.Task | None],
    timeout_s: float,
    *,
    what: str = "background task",
    recancel_s: float = RECANCEL_S,
) -> set[asyncio.Task]:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end, cancelling again every
    ``recancel_s`` those still running (a cancellation some library swallowed). Returns the tasks
    still running at the deadline (logged); their exceptions are retrieved, never raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    todo = {t for t in tasks if t is not None}
    pending = {t for t in todo if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
    for t in todo - pending:
        if not t.cancelled():
            t.exception()  # retrieved: a failure at shutdown is not worth a warning
    if pending:
        log.warning(
            "%s still running %.1f s after cancel(): %s",
            what,
            timeout_s,
            ", ".join(sorted(t.get_name() for t in pending)),
        )
    return pending
