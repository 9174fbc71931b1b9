"""The engine process and its front-end client (facegate.transport.remote, facegate.api.multiprocess)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from facegate.api.multiprocess import EngineProcess, engine_devices
from facegate.config import Settings
from facegate.errors import (
    CheckpointError,
    DeadlineExceededError,
    EngineClosedError,
    EngineError,
    FacegateError,
    InvalidParameterError,
    ModelError,
    NoFaceError,
    QueueFullError,
)
from facegate.io.memcopy import copy_in
from facegate.metrics.stats import ENGINE_FAMILIES, family_name
from facegate.service.faces import FaceService
from facegate.transport import remote as remote_module
from facegate.transport.remote import (
    Arena,
    FrameReader,
    RemoteEngine,
    RemotePool,
    engine_affinity,
    error_to_wire,
    same_engine,
)
from facegate.tuning import Machine, make_plan


def _all_free(arena: Arena | None) -> bool:
    """Whether every slot of ``arena`` was given back: the whole block allocates as one range (then freed)."""
    if arena is None or arena.alloc(len(arena.buf)) != 0:
        return False
    arena.free(0, len(arena.buf))
    return True


# --------------------------------------------------------------------------- pure parts
def test_arena_first_fit_alloc_free_and_merge() -> None:
    arena = Arena(1024)
    try:
        a, b, c = arena.alloc(100), arena.alloc(64), arena.alloc(200)
        assert (a, b, c) == (0, 128, 192)  # rounded up to 64-byte multiples
        assert arena.alloc(1024) is None  # no range large enough: the caller goes inline
        arena.free(b, 64)
        assert arena.alloc(50) == 128  # first fit reuses the hole
        arena.free(128, 50)
        arena.free(a, 100)
        arena.free(c, 200)
        assert arena.alloc(1024) == 0  # every range merged back into one
        x = np.arange(12, dtype=np.uint8).reshape(3, 4)
        copy_in(arena.buf, 0, x)
        np.testing.assert_array_equal(np.ndarray((3, 4), np.uint8, buffer=arena.buf, offset=0), x)
    finally:
        arena.close()


def test_errors_cross_the_boundary_with_their_class_and_attributes() -> None:
    def cross(exc: BaseException) -> FacegateError:
        return pickle.loads(pickle.dumps(error_to_wire(exc)))  # as the connection sends it

    exc = cross(QueueFullError("full", retry_after_s=2.5, detail={"stage": "embed"}))
    assert isinstance(exc, QueueFullError) and exc.retry_after_s == 2.5 and exc.detail == {"stage": "embed"}
    assert type(cross(NoFaceError("none"))) is NoFaceError
    other = cross(RuntimeError("boom"))
    assert isinstance(other, ModelError) and "RuntimeError: boom" in other.message

    class ElsewhereError(FacegateError, code="elsewhere"):  # e.g. the models' own, whose module imports torch
        pass

    plain = cross(ElsewhereError("m", detail={"k": 1}))
    assert type(plain) is FacegateError and plain.message == "m" and plain.detail == {"k": 1}


# --------------------------------------------------------------------------- a real engine process
#: the registry's random-weight test double: real detector, tiny recognizer
TINY = {"device": "cpu", "model": "sface-tiny"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    settings = Settings(**TINY, data_dir=tmp_path_factory.mktemp("engine"), engine={"max_wait_ms": 1.0})
    proc = EngineProcess(settings)
    proc.spawn()
    info = proc.wait(120)
    assert info["device"] == "cpu" and info["model"] == "sface-tiny"
    yield proc
    proc.stop()
    assert not proc.alive


def _value(families: list[Any], sample: str, *labels: str) -> float:
    """One sample's value in :meth:`ServiceStats.engine_samples`' families (0 if absent)."""
    found = (s.value for m in families for s in m.samples if s.name == sample and tuple(s.labels.values()) == labels)
    return next(found, 0.0)


def _crops(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, 112, 112, 3), dtype=np.uint8)


def test_front_ends_get_the_engines_results(engine: EngineProcess) -> None:
    """Two front-ends submit concurrently; results equal an in-process tiny service's (same seed)."""
    local = FaceService.build(Settings(**TINY))
    ref_emb, ref_q, _ = local.pipeline.embed(_crops(5))
    photo = np.full((240, 320, 3), 127, np.uint8)

    async def go() -> None:
        a = FaceService.connect(Settings(device="cpu"), engine.address, engine.authkey)
        b = FaceService.connect(Settings(device="cpu"), engine.address, engine.authkey)
        await a.start()
        await b.start()
        assert (
            a.ready and b.ready and a.pipeline.operating.quality_threshold == local.pipeline.operating.quality_threshold
        )
        crops = _crops(5)
        outs = await asyncio.gather(*[(a if i % 2 else b)._submit("embed", crops[i : i + 1]) for i in range(5)])
        emb = np.concatenate([o[0] for o in outs])
        np.testing.assert_allclose(emb, ref_emb, atol=1e-5)
        np.testing.assert_allclose(np.concatenate([o[1] for o in outs]), ref_q, atol=1e-5)
        assert await a.detect(photo) == []  # a flat image: the real detector finds nothing
        with pytest.raises(NoFaceError):  # a typed error raised by the front-end's own selection
            await a.faces(photo)
        face = await b.face_aligned(crops[0])
        np.testing.assert_allclose(face.embedding, ref_emb[0], atol=1e-5)
        await a.stop()
        await b.stop()
        assert not a.ready

    asyncio.run(go())


def test_large_payloads_go_inline_and_engine_errors_keep_their_type(
    engine: EngineProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_module, "ARENA_BYTES", 4096)  # smaller than one crop

    async def go() -> None:
        remote = RemoteEngine(engine.address, engine.authkey)
        remote.start()
        try:
            emb, q, _raw = await remote.submit("embed", _crops(3))
            assert emb.shape == (3, 128) and q.shape == (3,)
            samples = await remote.engine_samples()
            assert {family_name(m) for m in samples} == set(ENGINE_FAMILIES)
            assert _value(samples, "facegate_items_total", "embed") >= 3
            with pytest.raises(EngineError, match="unknown stage") as info:
                await remote.submit("no-such-stage", _crops(1))
            assert type(info.value) is EngineError and info.value.detail == {"known": ["detect", "embed", "search"]}
            assert _all_free(remote._arena)  # every slot given back
        finally:
            remote.stop()
        with pytest.raises(EngineClosedError):
            await remote.submit("embed", _crops(1))

    asyncio.run(go())


def test_connect_fails_clearly_without_an_engine(tmp_path: Path) -> None:
    remote = RemoteEngine(str(tmp_path / "none.sock"), b"k", connect_timeout_s=0.3)
    with pytest.raises(EngineClosedError, match="no engine"):
        remote.start()


def test_engine_startup_errors_reach_the_supervisor(tmp_path: Path) -> None:
    bad = Settings(device="cpu", data_dir=tmp_path, rts_checkpoint=tmp_path / "missing.pt")
    proc = EngineProcess(bad)
    with pytest.raises(CheckpointError, match=r"missing\.pt"):
        proc.spawn()
        proc.wait(120)
    assert not proc.alive


def test_the_engine_process_logs_in_the_configured_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FACEGATE_LOG_FORMAT", "json")
    proc = EngineProcess(Settings(device="cpu", data_dir=tmp_path, rts_checkpoint=tmp_path / "missing.pt"))
    with pytest.raises(CheckpointError):
        proc.spawn()
        proc.wait(120)
    records = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    failed = [r for r in records if r["message"] == "engine: startup failed"]
    assert failed and failed[0]["level"] == "ERROR" and "missing.pt" in failed[0]["exception"], records


def test_a_dead_engine_fails_requests_and_readiness(tmp_path: Path) -> None:
    proc = EngineProcess(Settings(**TINY, data_dir=tmp_path))
    proc.spawn()
    proc.wait(120)

    async def go() -> None:
        remote = RemoteEngine(proc.address, proc.authkey)
        remote.start()
        await remote.submit("embed", _crops(1))
        proc._proc.kill()  # the engine process dies (OOM killer, driver fault, ...)
        proc._proc.join(10)
        for _ in range(100):  # the reader notices the closed socket
            if not remote.ready:
                break
            await asyncio.sleep(0.05)
        assert not remote.ready
        with pytest.raises(EngineClosedError):
            await remote.submit("embed", _crops(1))
        remote.stop()

    try:
        asyncio.run(go())
    finally:
        proc.stop()


def test_a_signalled_engine_serves_until_its_front_ends_have_gone(tmp_path: Path) -> None:
    """SIGTERM to the whole process group (Ctrl-C) reaches the engine with its front-ends: it keeps answering
    until they disconnect, then exits at once (well before engine_drain_s)."""
    import signal

    proc = EngineProcess(Settings(**TINY, data_dir=tmp_path, drain_s=60.0))
    proc.spawn()
    proc.wait(120)

    async def go() -> None:
        remote = RemoteEngine(proc.address, proc.authkey)
        remote.start()
        os.kill(proc._proc.pid, signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert proc.alive
        emb, _, _ = await remote.submit("embed", _crops(2))  # still served while this front-end is connected
        assert emb.shape == (2, 128)
        t0 = time.monotonic()
        remote.stop()
        proc._proc.join(20)
        assert not proc.alive and proc.exitcode == 0 and time.monotonic() - t0 < 10

    try:
        asyncio.run(go())
    finally:
        proc.stop()


def test_a_cancelled_request_is_dropped_by_the_engine(tmp_path: Path) -> None:
    """A client that goes away before its batch forms costs the engine nothing (like in one process)."""
    slow = Settings(**TINY, data_dir=tmp_path, engine={"max_wait_ms": 400.0, "max_batch_size": 64})
    proc = EngineProcess(slow)
    proc.spawn()
    proc.wait(120)

    async def go() -> None:
        remote = RemoteEngine(proc.address, proc.authkey)
        remote.start()
        task = asyncio.create_task(remote.submit("embed", _crops(1)))
        await asyncio.sleep(0.05)  # queued in the engine, waiting up to 400 ms for a fuller batch
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the engine answers the cancelled item; its slot comes back
            if _all_free(remote._arena):
                break
            await asyncio.sleep(0.02)
        assert _all_free(remote._arena)
        await asyncio.sleep(0.6)  # past the 400 ms batch window, when the engine drops the item
        samples = await remote.engine_samples()
        assert _value(samples, "facegate_dropped_total", "embed", "cancelled") == 1
        assert _value(samples, "facegate_items_total", "embed") == 0  # never computed
        emb, _, _ = await remote.submit("embed", _crops(1))  # and the connection still works
        assert emb.shape == (1, 128)
        remote.stop()

    try:
        asyncio.run(go())
    finally:
        proc.stop()


def test_a_pool_spreads_requests_over_engines_and_sums_their_metrics(
    engine: EngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine per GPU: a front-end sends each request to the least busy engine."""
    second = EngineProcess(Settings(**TINY, data_dir=tmp_path, engine={"max_wait_ms": 1.0}), authkey=engine.authkey)
    second.spawn()
    second.wait(120)

    async def go() -> None:
        svc = FaceService.connect(Settings(device="cpu"), [engine.address, second.address], engine.authkey)
        pool = svc.engine
        assert isinstance(pool, RemotePool) and pool.info["devices"] == ["cpu", "cpu"]
        await svc.start()
        before = [_value(await e.engine_samples(), "facegate_items_total", "embed") for e in pool.engines]
        outs = await asyncio.gather(*[svc._submit("embed", _crops(1, seed=i)) for i in range(40)])
        assert all(o[0].shape == (1, 128) for o in outs)
        after = [_value(await e.engine_samples(), "facegate_items_total", "embed") for e in pool.engines]
        done = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(done) == 40 and min(done) > 0, done  # both engines computed some
        assert _value(await pool.engine_samples(), "facegate_items_total", "embed") == sum(after)

        # same_engine(): each request's items (submitted concurrently, as compare's two photos) go to one engine
        async def request(i: int) -> list[int]:
            with same_engine():
                await asyncio.gather(*[svc._submit("embed", _crops(1, seed=i + k)) for k in range(2)])
                group = engine_affinity.get()
                assert group is not None and len(group) == 1
                return [pool.engines.index(group[0])]

        chosen = [c[0] for c in await asyncio.gather(*[request(i) for i in range(20)])]
        final = [_value(await e.engine_samples(), "facegate_items_total", "embed") for e in pool.engines]
        per_engine = [f - a for f, a in zip(final, after, strict=True)]
        assert per_engine == [2 * chosen.count(k) for k in range(2)], (per_engine, chosen)
        assert 0 < chosen.count(0) < 20  # the requests themselves still spread over both engines
        assert engine_affinity.get() is None
        await svc.stop()

    try:
        asyncio.run(go())
    finally:
        second.stop()


def test_engines_per_gpu_share_the_visible_gpus_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert engine_devices(4, 2, on_cuda=True) == ["3", "3", "5", "5"]
    assert engine_devices(2, 1, on_cuda=True) == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert engine_devices(2, 1, on_cuda=True) == ["3", "5"]  # the first ones
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert engine_devices(2, 2, on_cuda=True) == [None, None]  # one GPU: the process's default device
    assert engine_devices(3, 1, on_cuda=False) == [None, None, None]
    with pytest.raises(InvalidParameterError, match="3 engines need 3 GPUs, 2 visible"):
        engine_devices(3, 1, on_cuda=True)
    with pytest.raises(InvalidParameterError, match="6 engines need 3 GPUs, 2 visible"):
        engine_devices(6, 2, on_cuda=True)


def test_the_arena_has_no_name_reaches_its_peer_and_is_zeroed_after_use() -> None:
    """The block travels as a descriptor over the Unix socket: nothing appears in /dev/shm, the peer maps the
    same memory, and a freed range (a request's photo) reads back as zeros on both sides."""
    from multiprocessing import Pipe

    from facegate.transport.remote import receive

    before = set(os.listdir("/dev/shm"))
    arena = Arena(4096)
    ours, theirs = Pipe()
    try:
        arena.send_to(ours)
        block = receive(theirs)
        assert len(block) == 4096
        off = arena.alloc(100)
        assert off is not None
        copy_in(arena.buf, off, np.full(100, 7, np.uint8))
        assert block[off : off + 100] == b"\x07" * 100  # the same memory
        assert set(os.listdir("/dev/shm")) == before  # no named segment
        arena.free(off, 100)
        assert block[:] == bytes(4096)
        block.close()
    finally:
        arena.close()
        ours.close()
        theirs.close()
    assert arena.fd == -1


def test_a_front_end_of_a_gpu_engine_runs_one_intra_op_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Front-ends decode and align; with a CUDA engine they take the plan's one intra-op thread."""
    import cv2
    import torch

    from facegate.transport.remote import RemoteEngine

    info = {"model": "sface", "device": "cuda:0",
            "operating": {"match_threshold": 0.4, "match_fmr": 1e-3, "quality_threshold": 0.5}}  # fmt: skip
    monkeypatch.setattr(RemoteEngine, "start", lambda self: setattr(self, "info", info) or info)
    before = torch.get_num_threads(), cv2.getNumThreads()
    try:
        gpu = make_plan(Settings(device="cuda"), Machine(gpus=1, cores=16))
        FaceService.connect(Settings(device="cuda"), "/nonexistent.sock", b"k", gpu)
        assert (torch.get_num_threads(), cv2.getNumThreads()) == (1, 1)
        torch.set_num_threads(before[0])
        cv2.setNumThreads(before[1])
        info["device"] = "cpu"
        FaceService.connect(Settings(device="cpu"), "/nonexistent.sock", b"k", make_plan(Settings(device="cpu")))
        assert (torch.get_num_threads(), cv2.getNumThreads()) == before  # a CPU engine: defaults stay
    finally:
        torch.set_num_threads(before[0])
        cv2.setNumThreads(before[1])


def test_a_socket_nobody_listens_on_fails_fast(tmp_path: Path) -> None:
    """A dead engine's socket file is left behind: connecting is refused, and start() gives up in seconds."""
    import socket
    import time

    path = str(tmp_path / "engine.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # the file exists, nothing listens
    try:
        remote = RemoteEngine(path, b"k", connect_timeout_s=60.0)
        t0 = time.monotonic()
        with pytest.raises(EngineClosedError, match="no engine"):
            remote.start()
        assert time.monotonic() - t0 < remote.refused_grace_s + 2.0
    finally:
        s.close()


def test_the_sender_answers_in_bursts_and_fails_items_past_their_deadline() -> None:
    """EngineHost's per-connection sender: finished items go back together; a stuck item fails at its deadline."""
    import concurrent.futures
    import queue
    import threading
    import time

    from facegate.engine.batcher import WorkItem
    from facegate.transport.remote import EngineHost

    done: queue.SimpleQueue = queue.SimpleQueue()
    sent: list[tuple] = []
    stuck: concurrent.futures.Future = concurrent.futures.Future()
    ok1: concurrent.futures.Future = concurrent.futures.Future()
    ok2: concurrent.futures.Future = concurrent.futures.Future()
    pending = {
        1: WorkItem("a", ok1, time.monotonic() + 60),
        2: WorkItem("b", ok2, time.monotonic() + 60),
        3: WorkItem("c", stuck, time.monotonic() + 0.2),  # never completed by the engine
    }
    for rid, fut in ((1, ok1), (2, ok2), (3, stuck)):
        fut.add_done_callback(lambda f, rid=rid: done.put((rid, f)))
    ok1.set_result("x")
    ok2.set_exception(NoFaceError("none"))
    t = threading.Thread(target=EngineHost._sender, args=(done, pending, sent.append))
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(m[1][0][1] == 3 for m in sent):
        time.sleep(0.05)
    done.put(None)
    t.join(5)
    assert not t.is_alive() and not pending
    assert sent[0][0] == "batch" and sent[0][1][0] == ("ok", 1, "x") and sent[0][1][1][:2] == ("err", 2)
    assert type(sent[0][1][1][2]) is NoFaceError and sent[0][1][1][2].message == "none"
    (late,) = [m for m in sent if m[1][0][1] == 3]
    assert late[1][0][:2] == ("err", 3) and type(late[1][0][2]) is DeadlineExceededError


def test_frame_reader_reads_connection_messages_in_order_in_bursts() -> None:
    """Small messages (header and body in one write), large ones (header, then the body in pieces), a limit."""
    import multiprocessing as mp
    import threading

    a, b = mp.Pipe(duplex=True)
    big = np.arange(3 * 2**20, dtype=np.uint8)  # several socket reads
    sent = [("submit", i, "embed", None, (1,), "uint8", None) for i in range(300)] + [("inline", big)]
    sent += [("stats", 7)]
    writer = threading.Thread(target=lambda: [b.send(m) for m in sent])
    writer.start()
    frames = FrameReader(a)
    got: list = []
    while len(got) < len(sent):
        burst = frames.recv_many(limit=100)
        assert 1 <= len(burst) <= 100
        got += burst
    writer.join()
    assert got[:300] == sent[:300] and got[-1] == ("stats", 7)
    np.testing.assert_array_equal(got[300][1], big)
    b.send(("after", 1))  # plain Connection.send still pairs with it
    assert frames.recv_many() == [("after", 1)]
    b.close()
    with pytest.raises(EOFError):
        frames.recv_many()
    a.close()
    with pytest.raises(OSError):
        frames.recv_many()


def test_frame_reader_parses_the_long_length_header() -> None:
    """Messages over 2 GiB carry -1, then an 8-byte length; the parser takes that form at any size."""
    import pickle
    import struct

    body = pickle.dumps(("x", 1))
    frames = FrameReader.__new__(FrameReader)
    frames._buf = bytearray(struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body + struct.pack("!i", 3))
    out: list = []
    frames._parse(out, 10)
    assert out == [("x", 1)] and bytes(frames._buf) == struct.pack("!i", 3)  # an incomplete frame stays


def test_engine_side_modules_load_no_http_stack() -> None:
    """What an engine process or Ray engine replica imports of facegate (the run folders included) loads neither
    FastAPI, Starlette nor uvicorn."""
    code = (
        "import sys\n"
        "import facegate.service.faces, facegate.transport.remote, facegate.transport.run_dirs, facegate.tuning\n"
        "loaded = sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
