"""The overload client's open loop (benchmarks/overload_client.py) against a scripted asyncio server: every
request is sent at its scheduled time whatever the answers, and each answer is counted by its kind."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from overload_client import Phase, encode, open_loop

CONNECTIONS = [0]


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """200 JSON, 503 JSON naming a bound, plain text, then the same with ``Connection: close``, in turn; the
    second connection drops its second request unanswered (a kept-alive connection the server closed)."""
    i = 0
    CONNECTIONS[0] += 1
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(n)
            if CONNECTIONS[0] == 2 and i == 1:
                break
            kind = i % 4
            i += 1
            if kind == 0:
                status, body = b"200 OK", b'{"ok": true}'
            elif kind == 1:
                status, body = b"503 Service Unavailable", json.dumps({"error": {"detail": {"limit": 7}}}).encode()
            else:
                status, body = b"500 Internal Server Error", b"Internal Server Error"
            close = b"Connection: close\r\n" if kind == 3 else b""
            head = b"HTTP/1.1 " + status + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + close
            writer.write(head + b"\r\n" + body)
            if close:
                break
    except asyncio.IncompleteReadError:
        pass
    writer.close()


def test_open_loop_sends_at_its_rate_and_counts_each_answer() -> None:
    async def main() -> Phase:
        server = await asyncio.start_server(_answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            return await open_loop(url, encode(url, "/api/compare", [("img1", ("a.jpg", b"x" * 5000, "image/jpeg"))]),
                                   rate=400, seconds=1.0)  # fmt: skip
        finally:
            server.close()
            await server.wait_closed()

    phase = asyncio.run(main())
    d = phase.to_dict()
    assert 395 <= d["sent"] <= 405
    assert d["ok"] + d["shed_503"] + sum(d["other"].values()) == d["sent"]
    assert d["other"] == {"500": d["non_json"]} and d["non_json"] > 0  # the dropped request was retried
    assert d["ok"] > 0 and d["shed_503"] > 0 and set(phase.bounds) == {7}
    assert d["client_max_lag_s"] < 0.5
    # one 1-second phase is one 5-second window of scheduled time, and nothing comes after it
    assert len(phase.shed_due) == d["shed_503"] and all(0.0 <= t < 1.1 for t in phase.shed_due)
    assert d["shed_p99_from_send_by_5s"] == [d["shed_p99_from_send_s"]] and d["shed_p99_from_send_after_5s"] is None
