"""facegate.api.acceptor: least-connections hand-off of accepted sockets to front-end processes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from facegate.api.acceptor import CLOSED, HAND, Acceptor, FrontEndServer, front_end_order


def test_front_end_order_least_open_then_round_robin() -> None:
    assert front_end_order([3, 1, 2], start=0) == [1, 2, 0]
    assert front_end_order([1, 1, 1], start=0) == [0, 1, 2]
    assert front_end_order([1, 1, 1], start=2) == [2, 0, 1]
    assert front_end_order([0, 5, 0], start=1) == [2, 0, 1]  # equals at or after ``start``, wrapping
    assert front_end_order([4], start=3) == [0]


def _wait(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture()
def acceptor(tmp_path: Path) -> Iterator[Acceptor]:
    listener = socket.create_server(("127.0.0.1", 0))
    a = Acceptor(listener, str(tmp_path / "accept.sock"))
    a.start()
    yield a
    a.stop()


def _fake_front_end(a: Acceptor) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(a._control.getsockname())
    s.settimeout(5)
    return s


def _take(front_end: socket.socket) -> socket.socket:
    msg, fds, _, _ = socket.recv_fds(front_end, 16, 4)
    assert msg == HAND and len(fds) == 1
    return socket.socket(fileno=fds[0])


def _peek(s: socket.socket) -> bytes:
    try:
        return s.recv(4, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def test_connections_spread_evenly_and_follow_closes(acceptor: Acceptor) -> None:
    port = acceptor.listener.getsockname()[1]
    fronts = [_fake_front_end(acceptor) for _ in range(3)]
    _wait(lambda: len(acceptor._open) == 3)
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(9)]
    held = {i: [_take(f) for _ in range(3)] for i, f in enumerate(fronts)}  # 3 each, or recv times out
    _wait(lambda: acceptor._open == [3, 3, 3])
    # the handed socket is the client's connection: bytes go through
    clients[0].sendall(b"ping")
    time.sleep(0.05)
    assert sorted(_peek(s) for socks in held.values() for s in socks) == [b""] * 8 + [b"ping"]
    # front-end 1 reports two of its connections closed: the next two connections go to it
    fronts[1].send(CLOSED)
    fronts[1].send(CLOSED)
    _wait(lambda: acceptor._open == [3, 1, 3])
    clients += [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    held[1] += [_take(fronts[1]) for _ in range(2)]
    _wait(lambda: acceptor._open == [3, 3, 3])
    _wait(lambda: acceptor.handed == 11)
    # a front-end that goes away drops out; the others take the new connections
    fronts[0].close()
    _wait(lambda: len(acceptor._open) == 2)
    clients += [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    held[1].append(_take(fronts[1]))
    held[2].append(_take(fronts[2]))
    for s in [*clients, *(s for socks in held.values() for s in socks), *fronts[1:]]:
        s.close()


def test_connections_wait_for_the_first_front_end(acceptor: Acceptor) -> None:
    client = socket.create_connection(("127.0.0.1", acceptor.listener.getsockname()[1]))  # in the backlog
    time.sleep(0.1)
    assert acceptor.handed == 0
    front = _fake_front_end(acceptor)
    _take(front).close()
    _wait(lambda: acceptor.handed == 1)  # counted just after the hand-off
    client.close()
    front.close()


async def _pid_app(scope: dict, receive: Callable, send: Callable) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_front_end_server_serves_handed_connections_and_reports_closes(acceptor: Acceptor) -> None:
    config = uvicorn.Config(_pid_app, lifespan="off", log_config=None, access_log=False, loop="asyncio")
    server = FrontEndServer(config, acceptor._control.getsockname())
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        _wait(lambda: len(acceptor._open) == 1)
        url = f"http://127.0.0.1:{acceptor.listener.getsockname()[1]}/"
        with httpx.Client() as c:
            assert [c.get(url).text for _ in range(3)] == ["ok"] * 3  # one kept-alive connection
            _wait(lambda: acceptor._open == [1])
        assert httpx.get(url).text == "ok"  # a second connection, closed by the client
        _wait(lambda: acceptor._open == [0])  # both reported closed
        _wait(lambda: acceptor.handed == 2)
    finally:
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive()


def test_stop_ends_the_thread_and_closes_the_port(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    a = Acceptor(listener, str(tmp_path / "accept.sock"))
    a.start()
    assert a.alive
    a.stop()
    assert not a.alive
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
