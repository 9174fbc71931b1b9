"""Balanced accept (docs/architecture.md): the supervisor's :class:`Acceptor` thread passes each accepted
descriptor (``SCM_RIGHTS`` over ``SOCK_SEQPACKET``, datagram ``b"c"``) to the :class:`FrontEndServer` with the
fewest open connections (ties round-robin), which reports each closed one (``b"x"``). With one shared listening
socket, whichever process wakes first would take the whole backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import socket
import threading
import time
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

HAND = b"c"
CLOSED = b"x"


def front_end_order(open_counts: list[int], start: int) -> list[int]:
    """Indices of the front-ends, fewest open connections first; ties from ``start`` on, round-robin."""
    n = len(open_counts)
    return sorted(range(n), key=lambda i: (open_counts[i], (i - start) % n))


class Acceptor:
    """Accepts on ``listener`` (which it closes) and hands each connection to the least busy front-end
    registered on the Unix socket ``control_path``."""

    def __init__(self, listener: socket.socket, control_path: str) -> None:
        self.listener = listener
        self.handed = 0
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control.bind(control_path)
        self._control.listen(64)
        self._front_ends: list[socket.socket] = []
        self._open: list[int] = []  # open connections per front-end, in registration order
        self._next = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="facegate-acceptor", daemon=True)

    def start(self) -> None:
        """Start the thread (connections wait in the backlog until a front-end registers)."""
        self.listener.setblocking(False)
        self._control.setblocking(False)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and close the sockets (front-ends see their control socket close)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")
        self._thread.join(5)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "stop")
        sel.register(self._control, selectors.EVENT_READ, "control")
        listening = False
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "stop":
                        return
                    if key.data == "control":
                        self._register(sel)
                    elif key.data == "listen":
                        self._accept_all()
                    else:
                        self._read_front_end(sel, key.fileobj)  # type: ignore[arg-type]
                if bool(self._front_ends) != listening:  # no front-end: connections wait in the backlog
                    listening = not listening
                    if listening:
                        sel.register(self.listener, selectors.EVENT_READ, "listen")
                    else:
                        sel.unregister(self.listener)
        except Exception:  # the server cannot accept any more: make that loud
            log.exception("the acceptor thread failed")
            raise
        finally:
            sel.close()
            for s in (self.listener, self._control, self._wake_r, self._wake_w, *self._front_ends):
                s.close()

    def _register(self, sel: selectors.BaseSelector) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = self._control.accept()
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ, "front-end")
            self._open.append(0)
            self._front_ends.append(conn)
            log.debug("acceptor: front-end %d registered", len(self._front_ends))

    def _read_front_end(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        i = self._front_ends.index(conn)
        while True:
            try:
                msg = conn.recv(16)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:  # the front-end process is gone
                sel.unregister(conn)
                del self._front_ends[i], self._open[i]
                conn.close()
                log.warning("acceptor: a front-end went away; %d left", len(self._front_ends))
                return
            self._open[i] = max(0, self._open[i] - msg.count(CLOSED))

    def _accept_all(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave the rest in the backlog, and do not spin on it
                log.error("acceptor: accept failed: %s", exc)
                time.sleep(0.05)
                return
            with client:
                if client.family in (socket.AF_INET, socket.AF_INET6):
                    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._hand(client)

    def _hand(self, client: socket.socket) -> None:
        """Pass ``client`` to a front-end (its descriptor is duplicated there; the caller closes ours)."""
        for i in front_end_order(self._open, self._next):
            try:
                socket.send_fds(self._front_ends[i], [HAND], [client.fileno()])
            except OSError as exc:  # full (the front-end is not reading) or gone: try the next one
                log.debug("acceptor: front-end %d refused a connection: %s", i, exc)
                continue
            self._open[i] += 1
            self._next = (i + 1) % len(self._front_ends)
            self.handed += 1
            return
        log.error("acceptor: no front-end took a connection; closing it")


class FrontEndServer(uvicorn.Server):
    """A uvicorn server that listens on nothing and serves the connections an :class:`Acceptor` hands it.
    Protocol objects are built as uvicorn builds them for its listeners, so shutdown and keep-alive behave the same."""

    def __init__(self, config: Any, control_path: str) -> None:
        super().__init__(config)
        self.control_path = control_path
        self._ctrl: socket.socket | None = None
        self._pending: set[asyncio.Task[Any]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the app's lifespan start-up; no listener of its own
        if self.should_exit:
            return
        ctrl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ctrl.connect(self.control_path)  # registered: connections come from now on
        ctrl.setblocking(False)
        self._ctrl = ctrl
        asyncio.get_running_loop().add_reader(ctrl.fileno(), self._on_control)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._ctrl is not None:
            asyncio.get_running_loop().remove_reader(self._ctrl.fileno())
            self._ctrl.close()
            self._ctrl = None
        await super().shutdown(sockets=sockets)

    def _protocol(self) -> asyncio.Protocol:
        proto = self.config.http_protocol_class(
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )
        lost = proto.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            try:
                lost(exc)
            finally:
                if self._ctrl is not None:  # tell the acceptor
                    with contextlib.suppress(OSError):
                        self._ctrl.send(CLOSED)

        proto.connection_lost = connection_lost
        return proto  # type: ignore[no-any-return]

    def _on_control(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._ctrl is not None
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._ctrl, 16, 8)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:  # the acceptor (the supervisor) is gone: stop serving
                log.info("the supervisor closed the control socket (it is stopping): shutting down")
                loop.remove_reader(self._ctrl.fileno())
                self.should_exit = True
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                task = loop.create_task(loop.connect_accepted_socket(self._protocol, sock))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
