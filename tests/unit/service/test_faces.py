"""FaceService: async calls through the batching engine (real detector, tiny recognizer)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from facegate.config import Settings
from facegate.errors import InvalidParameterError, NoFaceError
from facegate.pipeline.pipeline import FacePipeline
from facegate.service.faces import FaceService


def _face_like() -> np.ndarray:
    """A 112×112 crop passed as pre-aligned (no detection needed)."""
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)


def test_service_batches_and_matches_sequential() -> None:
    async def main() -> None:
        svc = FaceService.build(
            Settings(model="sface-tiny", device="cpu", quality_threshold=0.0, engine={"max_wait_ms": 20})
        )
        await svc.start()
        try:
            assert svc.ready
            crops = [np.roll(_face_like(), k, axis=0) for k in range(16)]
            concurrent = await asyncio.gather(*[svc.face_aligned(c) for c in crops])
            sequential = [await svc.face_aligned(c) for c in crops]
            for a, b in zip(concurrent, sequential, strict=True):
                assert float(np.dot(a.embedding, b.embedding)) > 0.9999
                assert a.detection is None and a.quality.accepted
            batches = svc.stats.value("facegate_batch_size_count", stage="embed")
            assert svc.stats.value("facegate_batch_size_sum", stage="embed") > batches  # more than 1 a batch
            with pytest.raises(NoFaceError):
                await svc.faces(np.full((200, 200, 3), 127, np.uint8))
            with pytest.raises(InvalidParameterError):
                await svc.face_aligned(np.zeros((100, 100, 3), np.uint8))
            # a float crop is refused alone, before it joins (and fails) a batch of others' crops
            pair = (svc.face_aligned(crops[0]), svc.face_aligned(crops[0].astype(np.float32)))
            good, bad = await asyncio.gather(*pair, return_exceptions=True)
            assert isinstance(bad, InvalidParameterError) and "112×112×3 uint8" in str(bad)
            assert not isinstance(good, BaseException) and good.quality.accepted
            res = svc.compare(concurrent[0], concurrent[1])
            assert not res.refused and res.similarity is not None
        finally:
            await svc.stop()
        assert not svc.ready

    asyncio.run(main())


def test_the_build_the_warm_up_and_every_execute_run_on_one_device_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each thread that runs cuDNN/cuBLAS work holds its own handles: the service uses one for all of it."""
    seen: dict[str, set[str]] = {"build": set(), "warmup": set(), "embed": set()}
    build, warmup, recognize = FacePipeline.from_settings, FacePipeline.warmup, FacePipeline.recognize

    def spy(key: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen[key].add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(FacePipeline, "from_settings", staticmethod(spy("build", build)))
    monkeypatch.setattr(FacePipeline, "warmup", spy("warmup", warmup))
    monkeypatch.setattr(FacePipeline, "recognize", spy("embed", recognize))

    async def main() -> None:
        svc = FaceService.build(Settings(model="sface-tiny", device="cpu", quality_threshold=0.0))
        assert svc.engine.device_executor is not None
        await svc.start()
        try:
            await asyncio.gather(*[svc.face_aligned(np.roll(_face_like(), k, axis=0)) for k in range(8)])
        finally:
            await svc.stop()

    asyncio.run(main())
    assert seen == {"build": {"facegate-device"}, "warmup": {"facegate-device"}, "embed": {"facegate-device"}}


def test_service_compare_refused_below_gate() -> None:
    async def main() -> None:
        svc = FaceService.build(Settings(model="sface-tiny", device="cpu", quality_threshold=1.0))
        await svc.start()
        try:
            a = await svc.face_aligned(_face_like())
            b = await svc.face_aligned(np.roll(_face_like(), 3, axis=1))
            res = svc.compare(a, b)
            assert res.refused and res.match is None and res.similarity is None
            assert "retake" in (res.reason or "")
            assert svc.stats.value("facegate_refusals_total", reason="compare_low_quality") == 1
        finally:
            await svc.stop()

    asyncio.run(main())


def test_start_freezes_the_start_up_objects_out_of_the_collector() -> None:
    """After start, full collections no longer walk the start-up objects."""
    import gc

    gc.unfreeze()

    async def main() -> None:
        svc = FaceService.build(Settings(model="sface-tiny", device="cpu"))
        await svc.start()
        try:
            assert svc.ready
            frozen = gc.get_freeze_count()
            assert frozen > 10_000, frozen
        finally:
            await svc.stop()

    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual


def test_the_front_end_side_never_imports_torch() -> None:
    """What an HTTP front-end imports, builds (service, pipeline, CPU gallery index) and unpickles (the engine's
    embed and photo results) leaves torch unloaded."""
    import pickle
    import subprocess
    import sys

    from facegate.pipeline.results import EmbedOut, PhotoFaces
    from facegate.types import Detection

    det = Detection(box=np.arange(4, dtype=np.float32), landmarks=np.ones((5, 2), np.float32), score=0.9)
    emb = np.ones((1, 4), np.float32)
    results = pickle.dumps(
        [EmbedOut(np.ones((2, 6), np.float32)), PhotoFaces([det], emb, emb[:, 0], emb[:, 1], emb[:, :3])]
    )
    code = (
        "import pickle, sys\n"
        "got = pickle.loads(sys.stdin.buffer.read())\n"
        "assert got[1].detections[0].score > 0.89 and len(got[0]) == 3, got\n"
        "import facegate.api.app, facegate.cli, facegate.api.multiprocess, facegate.service.faces\n"
        "from facegate.config import Settings\n"
        "from facegate.tuning import make_plan\n"
        "assert make_plan(Settings()).device in ('cpu', 'cuda')\n"
        "from facegate.gallery.index import GalleryIndex\n"
        "from facegate.models.registry import get_spec\n"
        "from facegate.pipeline.pipeline import FacePipeline, Operating, configure_cpu_threads\n"
        "configure_cpu_threads(1)\n"
        "p = FacePipeline(get_spec('sface'), None, None, device='cpu', operating=Operating(0.3, 1e-3, 0.5))\n"
        "GalleryIndex(p.device_name).load_all({'g': (2, ['a'], [[1.0, 0.0]])})\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "p.device  # the engine side's torch device: imports torch now\n"
        "assert 'torch' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=results, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
