"""benchmarks/loadgen.py against a tiny local FastAPI app (uvicorn on loopback) that sleeps a fixed time."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from facegate.errors import EmptyInputError, EngineClosedError, InvalidParameterError

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from loadgen import BenchResult, collect_images, main, run_http_bench

DELAY_S = 0.1  # what every fake endpoint sleeps
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4  # never decoded by the fake server


class FakeState:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_every = 0  # every n-th request answers 503
        self.ready = True
        self.item_error = False


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request) -> tuple[dict[str, Any], JSONResponse | None]:
        form = await request.form()
        files = {k: [getattr(v, "filename", None) for v in form.getlist(k)] for k in form}
        call = {"path": request.url.path, "query": dict(request.query_params), "form": files}
        state.calls.append(call)
        seq = len(state.calls)  # taken before sleeping: concurrent requests must not share a number
        await asyncio.sleep(DELAY_S)
        if state.fail_every and seq % state.fail_every == 0:
            body = {"error": {"code": "queue_full", "message": "full", "detail": {}}}
            return call, JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        return call, None

    @app.post("/api/compare")
    async def compare(request: Request) -> JSONResponse:
        _, err = await handle(request)
        return err or JSONResponse({"similarity": 0.5, "verdict": "match"})

    @app.post("/api/embed")
    async def embed(request: Request) -> JSONResponse:
        call, err = await handle(request)
        if err:
            return err
        n = len(call["form"].get("images", []))
        results: list[dict[str, Any]] = [{"index": i, "faces": []} for i in range(n)]
        if state.item_error:
            results[0] = {"index": 0, "error": {"code": "no_face", "message": "no face", "detail": {}}}
        return JSONResponse({"model": "fake", "dim": 4, "results": results})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        return JSONResponse({"status": "ready"} if state.ready else {"status": "loading"}, 200 if state.ready else 503)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="warning", access_log=False, lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture()
def fake(server: tuple[str, FakeState]) -> tuple[str, FakeState]:
    server[1].reset()
    return server


@pytest.fixture(params=["raw", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_duration_mode_latency_and_throughput(fake: tuple[str, FakeState], transport: str) -> None:
    url, state = fake
    c = 4
    res = run_http_bench(
        url, kind="compare", images=[JPEG], concurrency=c, duration_s=2.0, warmup=4, transport=transport
    )
    assert res.errors == {}
    assert res.n == res.n_ok == len(state.calls) - 4  # warm-up requests reached the server but are not counted
    assert res.p50_ms is not None and res.p95_ms is not None and res.p99_ms is not None and res.mean_ms is not None
    assert res.p50_ms >= DELAY_S * 1000 * 0.95, res.summary()  # no answer comes before the server's sleep
    assert res.p50_ms <= res.p95_ms <= res.p99_ms <= res.max_ms  # type: ignore[operator]
    # closed loop: c clients each waiting one latency, so req/s follows the latency measured in the same run
    # (Little's law), whatever a loaded machine made that latency; and it can never beat c / sleep
    assert res.req_s == pytest.approx(c / (res.mean_ms / 1000), rel=0.3), res.summary()
    assert res.req_s <= 1.1 * c / DELAY_S, res.summary()
    assert res.req_s == pytest.approx(res.n / res.elapsed_s, rel=0.01)
    assert res.elapsed_s >= 1.9  # duration mode measures for at least the duration
    assert res.images_s == pytest.approx(2 * res.ok_req_s)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["settings"]["kind"] == "compare" and d["settings"]["concurrency"] == c
    assert d["settings"]["duration_s"] == 2.0 and d["settings"]["n_requests"] is None and d["settings"]["warmup"] == 4
    assert d["settings"]["transport"] == transport and d["settings"]["client"].startswith(
        "rawhttp.py" if transport == "raw" else "httpx"
    )


def test_throughput_scales_with_concurrency(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    one = run_http_bench(url, kind="compare", images=[JPEG], concurrency=1, n_requests=12)
    eight = run_http_bench(url, kind="compare", images=[JPEG], concurrency=8, n_requests=96)
    assert one.n == 12 and eight.n == 96
    assert one.req_s <= 1.1 / DELAY_S, one.summary()  # one client can never beat one answer per sleep
    # ratios of the same run: eight clients serve several times one client's rate at about its latency
    assert eight.req_s > 4.5 * one.req_s, (one.summary(), eight.summary())
    assert one.p50_ms is not None and eight.p50_ms is not None and eight.p50_ms < 2.5 * one.p50_ms


def test_n_requests_exact_and_errors_by_status(fake: tuple[str, FakeState], transport: str) -> None:
    url, state = fake
    state.fail_every = 4
    res = run_http_bench(
        url, kind="compare", images=[JPEG, JPEG + b"x"], concurrency=3, n_requests=40, transport=transport
    )
    assert len(state.calls) == 40 and res.n == 40
    assert res.errors == {"503": 10} and res.n_ok == 30
    assert len(res.error_samples["503"]) == 3 and all('"queue_full"' in b for b in res.error_samples["503"])
    assert res.ok_req_s < res.req_s


def test_compare_sends_image_pairs_and_crops(fake: tuple[str, FakeState], tmp_path: Path, transport: str) -> None:
    url, state = fake
    paths = []
    for i in range(3):
        p = tmp_path / f"p{i}.jpg"
        p.write_bytes(JPEG)
        paths.append(p)
    run_http_bench(url, kind="compare", images=paths, concurrency=1, n_requests=3, crops=True, transport=transport)
    pairs = [(c["form"]["img1"][0], c["form"]["img2"][0]) for c in state.calls]
    assert pairs == [("p0.jpg", "p1.jpg"), ("p2.jpg", "p0.jpg"), ("p1.jpg", "p2.jpg")]
    assert all(c["path"] == "/api/compare" and c["query"] == {"crops": "true"} for c in state.calls)


@pytest.mark.parametrize("kind", ["embed", "embed_aligned"])
def test_embed_kinds(fake: tuple[str, FakeState], kind: str, transport: str) -> None:
    url, state = fake
    state.item_error = True
    res = run_http_bench(
        url, kind=kind, images=[JPEG] * 5, concurrency=2, n_requests=6, images_per_request=3, transport=transport
    )  # type: ignore[arg-type]
    assert res.n_ok == 6 and res.errors == {}
    assert res.item_errors == {"no_face": 6}
    assert all(c["path"] == "/api/embed" and len(c["form"]["images"]) == 3 for c in state.calls)
    assert res.images_s == pytest.approx(3 * res.ok_req_s)
    assert res.settings["images_per_request"] == 3


def test_transport_errors_are_counted_not_raised(transport: str) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    res = run_http_bench(
        f"http://127.0.0.1:{port}", kind="compare", images=JPEG, concurrency=2, n_requests=4, transport=transport
    )
    assert res.n == 4 and res.n_ok == 0 and res.errors == {"ConnectError": 4}
    assert res.p50_ms is None and res.req_s > 0
    json.dumps(res.to_dict())


def test_wait_ready_times_out(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    state.ready = False
    with pytest.raises(EngineClosedError, match="not ready"):
        run_http_bench(url, kind="compare", images=JPEG, concurrency=1, n_requests=1, wait_ready_s=0.5)
    assert state.calls == []


def test_validation() -> None:
    url = "http://127.0.0.1:1"
    with pytest.raises(InvalidParameterError):
        run_http_bench(url, kind="compare", images=JPEG, concurrency=1, duration_s=1.0, n_requests=3)
    with pytest.raises(InvalidParameterError):
        run_http_bench(url, kind="compare", images=JPEG, concurrency=1)
    with pytest.raises(InvalidParameterError):
        run_http_bench(url, kind="detect", images=JPEG, concurrency=1, n_requests=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        run_http_bench(url, kind="compare", images=JPEG, concurrency=0, n_requests=1)
    with pytest.raises(EmptyInputError):
        run_http_bench(url, kind="compare", images=[], concurrency=1, n_requests=1)


def test_collect_images(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    for name in ("a/x.jpg", "a/y.PNG", "a/notes.txt", "z.jpeg"):
        (tmp_path / name).write_bytes(JPEG)
    got = collect_images([tmp_path / "a", tmp_path / "z.jpeg"])
    assert [p.name for p in got] == ["x.jpg", "y.PNG", "z.jpeg"]
    assert len(collect_images([tmp_path], limit=2)) == 2
    with pytest.raises(InvalidParameterError):
        collect_images([tmp_path / "missing"])
    with pytest.raises(EmptyInputError):
        collect_images([tmp_path / "a" / "notes.txt"][:0])


def test_main_writes_json(fake: tuple[str, FakeState], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake
    img_dir = tmp_path / "imgs"
    img_dir.mkdir()
    for i in range(2):
        (img_dir / f"{i}.jpg").write_bytes(JPEG)
    out = tmp_path / "res" / "bench.json"
    argv = ["--url", url, "--images", str(img_dir), "-n", "10", "-c", "2", "--warmup", "2"]
    rc = main([*argv, "--no-progress", "--wait-ready", "5", "--out", str(out)])
    assert rc == 0
    saved = json.loads(out.read_text())
    printed = json.loads(capsys.readouterr().out)
    assert saved == printed
    assert saved["n"] == 10 and saved["settings"]["n_images"] == 2 and saved["settings"]["warmup"] == 2
    assert len(state.calls) == 12
    assert BenchResult(**saved).n_ok == 10


def test_merge_error_samples_keeps_the_first_three_per_kind() -> None:
    from http_e2e import merge_error_samples

    parts = [{"422": ["a", "b"]}, {"422": ["c", "d"], "503": ["e"]}, {}]
    assert merge_error_samples(parts) == {"422": ["a", "b", "c"], "503": ["e"]}
