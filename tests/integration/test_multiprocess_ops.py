"""``facegate serve --workers 2`` as an operator sees it: one /metrics for the whole server, and nothing left
behind (shared memory, socket folders) or lost (acknowledged gallery writes) by a kill -9."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

#: requests sent through the front-ends before the scrape
N = 40
#: kill -9 rounds of the crash test (the 100-round, 4-front-end version: benchmarks/kill9_soak.py)
KILLS = 1


def _run_folders(pid: int) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"facegate-*-{pid}-*"))


def _named_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "facegate"))}


def _shm_mappings(pids: list[int]) -> list[str]:
    """Mappings of files under /dev/shm (named segments) in the processes ``pids``."""
    out = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        out += [line for line in maps.splitlines() if "/dev/shm/" in line]
    return out


@pytest.mark.slow
@pytest.mark.lfw
def test_metrics_of_any_front_end_count_every_request(fg: SimpleNamespace, lfw_root: Path, tmp_path: Path) -> None:
    server = fg.ServeProcess(tmp_path, workers=2)
    try:
        server.wait_ready()
        assert httpx.post(server.url + "/api/galleries", json={"name": "staff-secret"}).status_code == 201
        photo = fg.lfw_image(lfw_root, "Tony_Blair").read_bytes()  # enrolled through one front-end...
        r = httpx.post(server.url + "/api/galleries/staff-secret/subjects/s1", files={"images": ("a.jpg", photo)})
        assert r.status_code in (200, 201), r.text
        deadline = time.monotonic() + 10  # the engine's index follows the store's change feed (a poll a second)
        while time.monotonic() < deadline:
            text = httpx.get(server.url + "/metrics").text
            if fg.parse_metric(text, "facegate_gallery_subjects") == 1:
                break
            time.sleep(0.2)
        for _ in range(N):  # a new connection each: the acceptor spreads them over both front-ends
            assert httpx.get(server.url + "/healthz", headers={"connection": "close"}).status_code == 200
        seen: dict[str, float] = {}
        for _ in range(8):
            text = httpx.get(server.url + "/metrics", headers={"connection": "close"}).text
            pid = next(line for line in text.splitlines() if line.startswith("facegate_process_info{"))
            seen[pid] = fg.parse_metric(text, "facegate_requests_total", {"route": "GET /healthz", "status": "200"})
            assert fg.parse_metric(text, "facegate_requests_total", {"route": "POST /api/galleries"}) == 1
            assert "staff-secret" not in text  # gallery names are not labels unless the setting allows it
            assert fg.parse_metric(text, "facegate_gallery_subjects") == 1  # ...counted by every front-end
    finally:
        server.close()
    assert len(seen) == 2, seen  # both front-ends answered a scrape...
    assert set(seen.values()) == {float(N)}, seen  # ...and each counted all N requests


@pytest.mark.slow
@pytest.mark.lfw
def test_kill_9_leaves_no_shared_memory_or_folders_and_loses_no_acknowledged_write(
    fg: SimpleNamespace, lfw_root: Path, tmp_path: Path
) -> None:
    photo = fg.lfw_image(lfw_root, "Tony_Blair").read_bytes()
    shm_before = _named_shm()
    acked: list[str] = []
    killed: list[int] = []
    for round_ in range(KILLS + 1):
        server = fg.ServeProcess(tmp_path, workers=2)
        try:
            server.wait_ready()
            for pid in killed:  # the start removed what the killed runs left behind
                assert _run_folders(pid) == [], _run_folders(pid)
            assert _shm_mappings(server.pids()) == []  # the transport maps no named segment at all
            if round_ == 0:
                assert httpx.post(server.url + "/api/galleries", json={"name": "g"}).status_code == 201
            with httpx.Client(base_url=server.url, timeout=30) as c:
                listed = c.get("/api/galleries/g/subjects", params={"limit": 10_000}).json()
            assert {s["subject_id"] for s in listed["subjects"]} >= set(acked)  # every acknowledged write is there
            if round_ == KILLS:
                server.proc.terminate()  # a clean stop this time
                server.proc.wait(30)
                break
            stop = threading.Event()

            def write(round_: int = round_, url: str = server.url, stop: threading.Event = stop) -> None:
                with httpx.Client(base_url=url, timeout=30) as c:
                    for i in range(1000):
                        if stop.is_set():
                            return
                        sid = f"r{round_}-{threading.get_ident()}-{i}"
                        try:
                            r = c.post(f"/api/galleries/g/subjects/{sid}", files={"images": ("a.jpg", photo)})
                        except httpx.TransportError:
                            return  # killed mid-request: not acknowledged
                        if r.status_code in (200, 201):
                            acked.append(sid)

            writers = [threading.Thread(target=write) for _ in range(2)]
            for t in writers:
                t.start()
            n0 = len(acked)
            deadline = time.monotonic() + 20
            while len(acked) < n0 + 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.kill_group()  # every process of the server, mid-write
            stop.set()
            for t in writers:
                t.join(30)
            killed.append(server.proc.pid)
            assert _run_folders(server.proc.pid), "expected the killed run's folders to be left behind"
            assert _named_shm() - shm_before == set()  # nothing in /dev/shm outlived the processes
        finally:
            rc = server.close()
    assert rc == 0
    stopped = server.proc.pid
    assert len(acked) >= 3 * KILLS
    assert _run_folders(stopped) == []  # a clean stop removes its own folders
