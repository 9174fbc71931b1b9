"""Graceful drain on SIGTERM/SIGINT: admitted requests finish, the rest get a JSON 503, the process exits 0.

Left alone, uvicorn cancels what still runs at its graceful-shutdown timeout with a plain-text 500 and re-raises
the signal (exit 143). From the signal on, a new request gets ``503 shutting_down`` (``Connection: close``); at
``drain_s`` the requests still running are cancelled and answered the same way. uvicorn's timeout is a little
longer, so it never cancels first, and :func:`exit_quietly_on_sigterm` turns its re-raise into a normal exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from types import FrameType
from typing import Any

from starlette.responses import JSONResponse

from facegate.api.errors import error_body

log = logging.getLogger(__name__)

#: What a request refused or cut short by the drain is answered with.
SHUTTING_DOWN = "shutting_down"
#: uvicorn's graceful-shutdown timeout is this much longer than the drain, so the drain answers first.
UVICORN_MARGIN_S = 1.0


class Drain:
    """One process's drain: the requests in flight, whether it is draining, and whether its time is up."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()  # the requests in flight (the serving middleware's)
        self.active = False  # no new request is admitted
        self.expired = False  # the requests still in flight were cancelled

    def begin(self, timeout_s: float, loop: asyncio.AbstractEventLoop) -> None:
        """Start draining: at ``timeout_s`` from now the requests still in flight are cut short (idempotent)."""
        if not self.active:
            self.active = True
            log.info("draining: %d request(s) in flight get %.1f s to finish", len(self.tasks), timeout_s)
            loop.call_later(timeout_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        tasks = list(self.tasks)
        if tasks:
            log.warning("drain timeout: answering %d unfinished request(s) with 503 %s", len(tasks), SHUTTING_DOWN)
        for task in tasks:
            task.cancel()


#: The drain of this process (one server per process).
DRAIN = Drain()


def watch_signals(timeout_s: float, loop: asyncio.AbstractEventLoop) -> None:
    """Make SIGTERM and SIGINT start :data:`DRAIN` before the handler already installed (uvicorn's) runs. Call it
    from the lifespan start-up; off the main thread (a server in a test's thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            loop.call_soon_threadsafe(DRAIN.begin, timeout_s, loop)
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)


def exit_quietly_on_sigterm() -> None:
    """Replace the default SIGTERM disposition (death by signal) with a no-op, so that the signal uvicorn
    re-raises after its graceful shutdown ends in a normal exit (status 0). Main thread only."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: None)


def shutting_down(message: str) -> JSONResponse:
    """The JSON 503 ``shutting_down``, with ``Connection: close`` and ``Retry-After: 1``."""
    return JSONResponse(error_body(SHUTTING_DOWN, message), 503, {"connection": "close", "retry-after": "1"})
