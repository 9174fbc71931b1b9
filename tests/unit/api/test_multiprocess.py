"""facegate.api.multiprocess: the balanced-accept supervisor (front-end processes that fail at start-up)."""

from __future__ import annotations

import socket
import sys

import pytest

from facegate.api.multiprocess import MAX_QUICK_EXITS, listen, serve_balanced
from facegate.config import Settings
from facegate.errors import ServerError


def exit_at_once(control_path: str) -> None:
    """A front-end entry point that fails at start-up (run in a spawned process)."""
    sys.exit(3)


def test_front_ends_that_keep_failing_at_start_up_stop_the_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError, match=f"{MAX_QUICK_EXITS} front-end processes in a row") as info:
        serve_balanced(Settings(), 2, target=exit_at_once, sock=listen("127.0.0.1", port))
    assert info.value.detail == {"exit_code": 3}
    with socket.socket() as s:  # the port was closed on the way out
        s.bind(("127.0.0.1", port))
