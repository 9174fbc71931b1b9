"""``facegate serve --workers 2 [--engines 2]``: engine processes and front-end processes, real models on the CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


@pytest.mark.lfw
@pytest.mark.parametrize("preprocess", ["off", "on"])
def test_two_front_ends_share_two_engines_and_one_gallery(
    lfw_root: Path, tmp_path: Path, preprocess: str, fg: SimpleNamespace
) -> None:
    """``preprocess`` = Settings.gpu_preprocess: "on" sends the photos' bytes to the engines' photo stage."""
    env = {"FACEGATE_LOG_LEVEL": "WARNING", "FACEGATE_GPU_PREPROCESS": preprocess}
    server = fg.ServeProcess(tmp_path, workers=2, engines=2, env=env)
    url, proc = server.url, server.proc

    def photo(name: str, i: int) -> bytes:
        return (lfw_root / "lfw-deepfunneled" / name / f"{name}_{i:04d}.jpg").read_bytes()

    try:
        server.wait_ready()
        with httpx.Client(base_url=url, timeout=60) as c:
            # the engine process plus two uvicorn front-ends (plus uvicorn's supervisor's helpers)
            ready = [c.get("/readyz") for _ in range(6)]
            assert all(r.status_code == 200 and r.json()["device"] == "cpu" for r in ready)
            same = c.post(
                "/api/compare",
                files={"img1": ("a.jpg", photo("Colin_Powell", 1)), "img2": ("b.jpg", photo("Colin_Powell", 2))},
            ).json()
            assert same["match"] is True and same["refused"] is False, same
            assert c.post("/api/galleries", json={"name": "staff"}).status_code == 201
            r = c.post("/api/galleries/staff/subjects/tony", files=[("images", ("t.jpg", photo("Tony_Blair", 1)))])
            assert r.status_code in (200, 201), r.text
            # whichever front-end answers, the search sees the enrolment made through the other one
            for _ in range(8):
                s = c.post("/api/galleries/staff/search", files={"image": ("q.jpg", photo("Tony_Blair", 2))}).json()
                assert [h["subject_id"] for h in s["hits"]] == ["tony"], s
            bad = c.post("/api/compare", files={"img1": ("a.jpg", b"junk"), "img2": ("b.jpg", photo("Tony_Blair", 1))})
            m = c.get("/metrics").text  # a front-end exports the engine processes' stage metrics, summed
            # 2 + 1 + 8 photos (or crops) + 1 from the bad compare's good photo
            # (with the photo stage, a search probe goes through photo_search: one engine trip)
            stages = ("photo", "photo_search") if preprocess == "on" else ("embed",)
            items = [
                ln for ln in m.splitlines() for st in stages if ln.startswith(f'facegate_items_total{{stage="{st}"}}')
            ]
            assert items and sum(float(x.split()[-1]) for x in items) >= 12, items
            detect = [ln for ln in m.splitlines() if ln.startswith('facegate_items_total{stage="detect"}')]
            n_detect = float(detect[0].split()[-1]) if detect else 0.0
            assert (n_detect >= 11) if preprocess == "off" else (n_detect == 0), detect  # photos skip "detect"
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "image_unreadable", bad.text
            # each front-end labels its scrape with its own process id, so a scraper can tell them apart; balanced
            # accept (the default) hands each new connection to the front-end with the fewest open ones: with
            # ``c``'s connection open, 7 more kept-alive connections split 4 + 4
            others = [httpx.Client(base_url=url, timeout=60) for _ in range(7)]
            try:
                pids = [_process_id(o.get("/metrics").text) for o in others] + [_process_id(c.get("/metrics").text)]
            finally:
                for o in others:
                    o.close()
            assert len(set(pids)) == 2 and all(p.isdigit() and int(p) != proc.pid for p in pids), pids
            assert sorted(Counter(pids).values()) == [4, 4], pids
            if preprocess == "off":  # a front-end that dies is replaced; the server keeps answering meanwhile
                os.kill(int(pids[0]), signal.SIGKILL)
                deadline = time.monotonic() + 60
                while True:
                    with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b:
                        now = {_process_id(a.get("/metrics").text), _process_id(b.get("/metrics").text)}
                    if len(now) == 2 and pids[0] not in now:
                        break
                    assert time.monotonic() < deadline, now
                    time.sleep(0.5)
        assert len(_children(proc.pid)) >= 4  # 2 engines + 2 front-ends (+ the resource tracker)
        # after compares, an enrolment and searches, still only the 2 engines have torch loaded
        spawned = [c for c in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(spawned) == 4 and sum(_loads_torch(c) for c in spawned) == 2, spawned
    finally:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        rc = server.close()
    assert rc == 0, server.log()[-3000:]
    assert _children(proc.pid) == []


def _process_id(metrics: str) -> str:
    """The front-end process id a ``/metrics`` answer is labelled with."""
    return next(ln.split('"')[1] for ln in metrics.splitlines() if ln.startswith("facegate_process_info{"))


def _loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's C++ library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[19])


def test_a_dead_engine_takes_the_server_down(tmp_path: Path, fg: SimpleNamespace) -> None:
    """The engine process is killed: the server stops its front-ends and exits non-zero with a JSON error.
    Neither the supervisor nor the front-ends load torch (``--device auto``: the plan resolves it without)."""
    server = fg.ServeProcess(tmp_path, workers=2, device="auto", env={"FACEGATE_LOG_LEVEL": "WARNING"})
    proc = server.proc
    try:
        server.wait_ready()
        spawned = [c for c in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        engine = min(spawned, key=_start_time)  # spawned first, before uvicorn's workers
        # only the engine loads torch: the front-ends decode, align, search and answer without it
        assert [c for c in spawned if _loads_torch(c)] == [engine], [(c, _loads_torch(c)) for c in spawned]
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert all(c.get("/readyz").status_code == 200 for _ in range(4))  # /readyz does not load it either
        assert [c for c in spawned if _loads_torch(c)] == [engine]
        assert not _loads_torch(proc.pid)  # nor the supervisor
        os.kill(engine, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        rc = server.close()
    assert rc != 0
    assert "the engine process died" in server.log()
    assert _children(proc.pid) == []


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: an orphan's new parent may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _spawned(pid: int) -> list[int]:
    return [c for c in _children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_the_engine_stops_when_the_supervisor_is_killed(tmp_path: Path, fg: SimpleNamespace) -> None:
    """kill -9 of the supervisor: its engine stops too, instead of holding the models (and a GPU) as an orphan."""
    server = fg.ServeProcess(tmp_path, workers=2)
    try:
        server.wait_ready()
        engine = min(_spawned(server.proc.pid), key=_start_time)
        os.kill(server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not _gone(engine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(engine), "the engine lives on without its supervisor"
    finally:
        server.close()


def test_sigterm_while_the_engines_start_stops_the_server(tmp_path: Path, fg: SimpleNamespace) -> None:
    """SIGTERM (a rollout, a scale-down) while the engines load: the server stops cleanly, it does not come up."""
    server = fg.ServeProcess(tmp_path, workers=2)
    try:
        deadline = time.monotonic() + 60
        while not _spawned(server.proc.pid) and time.monotonic() < deadline:  # an engine is starting
            time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log()[-2000:]
    finally:
        server.close()
    assert _children(server.proc.pid) == []


def test_a_port_in_use_fails_before_the_engines_load(tmp_path: Path, fg: SimpleNamespace) -> None:
    """The address is bound first: a port in use is a clear error at once, not after minutes of model loading,
    and the run leaves no folder behind."""
    import socket
    import tempfile

    with socket.create_server(("127.0.0.1", 0)) as taken:
        server = fg.ServeProcess(tmp_path, workers=2, port=taken.getsockname()[1])
        try:
            assert server.proc.wait(timeout=60) != 0
        finally:
            server.close()
    assert "cannot listen on 127.0.0.1" in server.log() and "server_error" in server.log()
    assert "engine ready" not in server.log()
    assert not list(Path(tempfile.gettempdir()).glob(f"facegate-*-{server.proc.pid}-*"))


def test_front_ends_on_a_non_loopback_bind_refuse_api_routes_once_no_key_is_left(
    fg: SimpleNamespace, tmp_path: Path
) -> None:
    """``FACEGATE_HOST=0.0.0.0`` (non-loopback, as api.security.is_loopback sees it) with one key, which is revoked
    while the multiprocess server runs: every front-end answers ``/api`` requests 401 from then on, never opens up;
    the probes stay open. (A client reaches the 0.0.0.0 bind on 127.0.0.1.)"""
    from facegate.service.keys import KeyStore

    token, record = KeyStore(tmp_path).create("only", ["read"])
    server = fg.ServeProcess(tmp_path, workers=2, env={"FACEGATE_HOST": "0.0.0.0", "FACEGATE_LOG_LEVEL": "WARNING"})
    clients: list[httpx.Client] = []
    try:
        server.wait_ready()
        # one connection per client: balanced accept hands the four to both front-ends, two each, once both have
        # registered with the acceptor (the first one up can answer /readyz before the second has)
        deadline = time.monotonic() + 60
        while True:
            clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(4)]
            pids = {_process_id(c.get("/metrics").text) for c in clients}
            if len(pids) == 2:
                break
            for c in clients:
                c.close()
            assert time.monotonic() < deadline, f"one front-end answered all connections: {pids}"
            time.sleep(0.5)
        for c in clients:
            assert c.get("/api/galleries", headers={"X-API-Key": token}).status_code == 200
            assert c.get("/api/galleries").status_code == 401  # no key sent
        KeyStore(tmp_path).revoke(record.id)  # the last key: none is left
        time.sleep(2.5)  # each front-end rereads the keys file within a second
        for c in clients:
            for headers in ({}, {"X-API-Key": token}):
                r = c.get("/api/galleries", headers=headers)
                assert r.status_code == 401, (r.status_code, r.text)
                err = r.json()["error"]
                assert err["code"] == "unauthorized" and "no API keys" in err["message"], err
            assert c.get("/readyz").status_code == 200
        for c in clients:
            c.close()
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=60)
    finally:
        for c in clients:
            c.close()
        rc = server.close()
    assert rc == 0, server.log()[-3000:]
