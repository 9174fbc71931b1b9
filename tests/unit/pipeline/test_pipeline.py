"""FacePipeline on real weights (CPU): selection, gate, compare, batching, pre-aligned crops, stages."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from facegate.config import QualitySettings, Settings
from facegate.errors import InvalidParameterError, NoFaceError
from facegate.io.decode import decode_image
from facegate.models.recognizer import build_recognizer, frozen_cpu
from facegate.models.registry import get_spec
from facegate.pipeline.pipeline import FacePipeline, quality_verdict, select_faces, start_photo_check
from facegate.pipeline.stages import DetectStage
from facegate.quality_reasons import face_reasons
from facegate.tuning import Machine, make_plan
from facegate.types import Detection, FaceSelect

LIMITS = {"max_bytes": 1 << 24, "max_pixels": 1 << 24}


def _det(x1: float, y1: float, x2: float, y2: float, score: float) -> Detection:
    return Detection(np.array([x1, y1, x2, y2], np.float32), np.zeros((5, 2), np.float32), score)


def test_select_faces_policies() -> None:
    dets = [_det(0, 0, 10, 10, 0.99), _det(0, 0, 50, 50, 0.80), _det(0, 0, 20, 20, 0.70)]
    assert select_faces(dets, FaceSelect.LARGEST)[0].score == 0.80
    assert len(select_faces(dets, "all")) == 3
    with pytest.raises(NoFaceError):
        select_faces([], FaceSelect.LARGEST)
    with pytest.raises(ValueError):
        select_faces(dets, "nearest")


def test_quality_verdict_reason() -> None:
    ok = quality_verdict(0.8, 12.0, 0.4, face_reasons(None, None, 0.8, 0.4, QualitySettings()))
    assert ok.accepted and ok.reason is None
    bad = quality_verdict(0.21, 9.0, 0.4, face_reasons(None, None, 0.21, 0.4, QualitySettings()))
    assert not bad.accepted and bad.reason is not None and bad.reason.startswith("retake")
    assert "0.21" in bad.reason and "0.40" in bad.reason


@pytest.fixture(scope="module")
def pipeline() -> FacePipeline:
    return FacePipeline.from_settings(Settings(device="cpu", precision="fp32"))  # the eager module's outputs


@pytest.fixture(scope="module")
def photos(lfw_root: Path) -> dict[str, np.ndarray]:
    base = lfw_root / "lfw-deepfunneled"
    names = {
        "a1": "Aaron_Peirsol/Aaron_Peirsol_0001.jpg",
        "a2": "Aaron_Peirsol/Aaron_Peirsol_0002.jpg",
        "b1": "Aaron_Eckhart/Aaron_Eckhart_0001.jpg",
    }
    return {k: decode_image((base / v).read_bytes(), **LIMITS) for k, v in names.items()}


def test_faces_compare_real_weights(pipeline: FacePipeline, photos: dict[str, np.ndarray]) -> None:
    faces = pipeline.faces([photos["a1"], photos["a2"], photos["b1"]], keep_crops=True)
    assert [len(f) for f in faces] == [1, 1, 1]
    a1, a2, b1 = (f[0] for f in faces)
    for f in (a1, a2, b1):
        assert f.detection is not None and f.detection.score > 0.8
        assert f.embedding.shape == (128,) and abs(float(np.linalg.norm(f.embedding)) - 1) < 1e-5
        assert 0.0 <= f.quality.score <= 1.0
        assert f.crop is not None and f.crop.shape == (112, 112, 3) and f.crop.dtype == np.uint8
        x1, y1, x2, y2 = f.detection.box
        assert 40 < (x1 + x2) / 2 < 210 and 40 < (y1 + y2) / 2 < 210  # LFW faces are centred
    same, diff = pipeline.compare_faces(a1, a2), pipeline.compare_faces(a1, b1)
    assert same.match is True and diff.match is False
    assert same.similarity is not None and diff.similarity is not None and same.similarity > diff.similarity + 0.3
    assert same.threshold == pipeline.operating.match_threshold and same.fmr == pipeline.operating.match_fmr


def test_batched_equals_single(pipeline: FacePipeline, photos: dict[str, np.ndarray]) -> None:
    batched = pipeline.faces([photos["a1"], photos["b1"]])
    single = pipeline.faces([photos["b1"]])
    assert float(np.dot(batched[1][0].embedding, single[0][0].embedding)) > 0.9999
    np.testing.assert_allclose(batched[1][0].detection.box, single[0][0].detection.box, atol=0.5)


def test_a_kept_crop_embeds_as_its_face(pipeline: FacePipeline, photos: dict[str, np.ndarray]) -> None:
    face = pipeline.faces([photos["a1"]], keep_crops=True)[0][0]
    emb, _, _ = pipeline.embed(face.crop[None])
    assert float(np.dot(face.embedding, emb[0])) > 0.9999
    with pytest.raises(InvalidParameterError):
        pipeline.embed(photos["a1"][None])  # not a (K, 112, 112, 3) crop batch


def test_a_112_pixel_photo_is_detected(pipeline: FacePipeline, photos: dict[str, np.ndarray]) -> None:
    """Only ``aligned=True`` marks an image as an aligned crop: a photo shrunk to 112×112 is detected."""
    import cv2

    small = cv2.resize(photos["a1"], (112, 112), interpolation=cv2.INTER_AREA)
    face = pipeline.faces([small])[0][0]
    assert face.detection is not None
    ref = pipeline.faces([photos["a1"]])[0][0]
    assert float(np.dot(face.embedding, ref.embedding)) >= pipeline.operating.match_threshold


def test_gate_refuses_and_never_compares(photos: dict[str, np.ndarray]) -> None:
    strict = FacePipeline.from_settings(Settings(device="cpu", quality_threshold=1.0))
    a, b = (f[0] for f in strict.faces([photos["a1"], photos["a2"]]))
    assert not a.quality.accepted and a.quality.reason
    res = strict.compare_faces(a, b)
    assert res.refused and res.similarity is None and res.match is None
    assert res.reason is not None and "img1" in res.reason and "img2" in res.reason


def test_no_face_raises(pipeline: FacePipeline) -> None:
    grey = np.full((240, 320, 3), 128, np.uint8)
    assert pipeline.detect([grey]) == [[]]
    assert pipeline.detect([]) == []
    with pytest.raises(NoFaceError):
        pipeline.faces([grey])


def test_embed_rejects_bad_crops(pipeline: FacePipeline) -> None:
    with pytest.raises(InvalidParameterError):
        pipeline.embed(np.zeros((2, 100, 100, 3), np.uint8))
    emb, q, raw = pipeline.embed(np.zeros((0, 112, 112, 3), np.uint8))
    assert emb.shape == (0, 128) and q.shape == (0,) and raw.shape == (0,)


def test_fp16_on_cpu_is_refused() -> None:
    with pytest.raises(InvalidParameterError):
        FacePipeline.from_settings(Settings(device="cpu", precision="fp16"))


def test_engine_stages_split_results(pipeline: FacePipeline, photos: dict[str, np.ndarray]) -> None:
    detect, embed = pipeline.stages()
    dets = detect.execute(detect.prepare([photos["a1"], photos["b1"]]))
    assert len(dets) == 2 and all(len(d) == 1 for d in dets)
    crops = pipeline.align([photos["a1"], photos["b1"]], [dets[0][0], dets[1][0]], [0, 1])
    payloads = [crops[:1], crops]  # two requests: 1 face and 2 faces
    assert [embed.item_cost(p) for p in payloads] == [1, 2]
    out = embed.deliver(embed.execute(embed.prepare(payloads)), 2)
    assert [o[0].shape for o in out] == [(1, 128), (2, 128)]
    np.testing.assert_allclose(out[0][0][0], out[1][0][0], atol=1e-5)


def test_mixed_size_batch_equals_single(
    pipeline: FacePipeline, photos: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images are batched only with images of the same padded size, so batching never changes a result."""
    big = np.zeros((480, 640, 3), np.uint8)
    big[100:350, 200:450] = photos["a1"]
    with monkeypatch.context() as m:
        m.setattr(pipeline, "pool", None)  # one forward per size, not one per row for the pool's threads
        groups = DetectStage(pipeline).prepare([photos["a1"], big, photos["b1"]])
    assert sorted(idx for idx, _ in groups) == [[0, 2], [1]]
    mixed = pipeline.faces([photos["a1"], big, photos["b1"]])
    for i, img in enumerate([photos["a1"], big, photos["b1"]]):
        alone = pipeline.faces([img])[0][0]
        assert float(np.dot(alone.embedding, mixed[i][0].embedding)) > 0.99999
        np.testing.assert_allclose(alone.detection.landmarks, mixed[i][0].detection.landmarks, atol=1e-3)


def test_cpu_pool_and_frozen_recognizer_keep_every_result(
    pipeline: FacePipeline, photos: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU plan runs a batch one row per forward on a pool's threads, through the recognizer frozen as one
    TorchScript graph: the same faces, in order, as in turn, and the same outputs as the eager module."""
    imgs = [photos["a1"], photos["b1"], photos["a2"]]
    with monkeypatch.context() as m:
        m.setattr(pipeline, "pool", None)
        in_turn = pipeline.faces(imgs)
    with monkeypatch.context() as m:
        m.setattr(pipeline, "pool", concurrent.futures.ThreadPoolExecutor(2))
        assert [idx for idx, _ in DetectStage(pipeline).prepare(imgs)] == [[0], [1], [2]]
        pooled = pipeline.faces(imgs)
    for a, b in zip(in_turn, pooled, strict=True):
        np.testing.assert_allclose(a[0].embedding, b[0].embedding, atol=1e-6)
        np.testing.assert_allclose(a[0].detection.box, b[0].detection.box, atol=1e-4)
    assert isinstance(pipeline.recognizer, torch.jit.ScriptModule)
    crops = np.random.default_rng(5).integers(0, 255, (5, 112, 112, 3), dtype=np.uint8)
    with torch.inference_mode():
        want = build_recognizer(pipeline.spec).eval()(torch.from_numpy(crops))
    for got, ref in zip(pipeline.embed(crops), want, strict=True):
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)


def test_a_bf16_frozen_recognizer_folds_in_fp32_and_keeps_the_embeddings(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, bf16 (the plan's choice on AMX CPUs) is frozen like fp32, its BatchNorms folded before the cast;
    an embedding turned away from fp32's is refused."""
    from facegate.errors import ModelError

    crops = torch.from_numpy(np.random.default_rng(6).integers(0, 255, (4, 112, 112, 3), dtype=np.uint8))
    rec = build_recognizer(get_spec("sface"))
    with torch.inference_mode():
        want = rec(crops)
        got = frozen_cpu(rec, "bf16")(crops)
    conv = rec.backbone.blocks[0].pw.conv
    assert conv.weight.dtype == torch.bfloat16 and conv.bias is not None  # folded, then cast
    assert float((got[0] * want[0]).sum(1).min()) > 0.99
    np.testing.assert_allclose(got[1].numpy(), want[1].numpy(), atol=0.05)
    monkeypatch.setattr(torch.jit, "freeze", lambda m: lambda x: (-m(x)[0], *m(x)[1:]))
    with pytest.raises(ModelError, match="traced recognizer differs"):
        frozen_cpu(build_recognizer(get_spec("sface")), "bf16")


def test_a_frozen_recognizer_that_differs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from facegate.errors import ModelError

    rec = build_recognizer(get_spec("sface"))
    monkeypatch.setattr(torch.jit, "freeze", lambda m: lambda x: tuple(t + 0.01 for t in m(x)))
    with pytest.raises(ModelError, match="traced recognizer differs"):
        frozen_cpu(rec)


def test_batch_bucket_padding_is_ignored(
    pipeline: FacePipeline, photos: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    det = pipeline.detector
    monkeypatch.setattr(pipeline, "pool", None)  # as on CUDA: the batch in one forward
    ref = pipeline.detect([photos["a1"], photos["b1"], photos["a2"]])
    det.batch_buckets = (1, 4, 8)
    try:
        ((_idx, batch),) = DetectStage(pipeline).prepare([photos["a1"], photos["b1"], photos["a2"]])
        assert batch.images.shape[0] == 4 and len(batch) == 3
        padded = pipeline.detect([photos["a1"], photos["b1"], photos["a2"]])
    finally:
        det.batch_buckets = None
    assert [len(d) for d in padded] == [len(d) for d in ref]
    for a, b in zip(ref, padded, strict=True):
        np.testing.assert_allclose(a[0].box, b[0].box, atol=1e-3)


def test_detector_batches_are_capped_in_pixels(
    pipeline: FacePipeline, photos: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pixel cap splits a same-size group into forwards of at most cap // (Hp·Wp) images, results unchanged."""
    monkeypatch.setattr(pipeline, "pool", None)
    imgs = [photos["a1"], photos["b1"], photos["a2"], photos["a1"], photos["b1"]]
    ref = pipeline.detect(imgs)
    chunk, cap = pipeline.chunk, pipeline.detector.max_batch_pixels
    pipeline.chunk, pipeline.detector.max_batch_pixels = None, 2 * 256 * 256  # LFW photos pad to 256×256
    try:
        groups = DetectStage(pipeline).prepare(imgs)
        capped = pipeline.detect(imgs)
    finally:
        pipeline.chunk, pipeline.detector.max_batch_pixels = chunk, cap
    assert [idx for idx, _ in groups] == [[0, 1], [2, 3], [4]]
    assert all(b.images.shape[0] * b.images.shape[1] * b.images.shape[2] <= 2 * 256 * 256 for _, b in groups)
    for a, b in zip(ref, capped, strict=True):
        np.testing.assert_allclose(a[0].box, b[0].box, atol=1e-3)


def test_detector_warm_batches_cover_the_shapes_serving_meets(pipeline: FacePipeline) -> None:
    """Per photo size, one detect call per batch bucket that fits the pixel cap, plus the partly filled bucket
    a capped forward pads to; every shape they produce is one the detect stage builds for real traffic."""
    buckets, cap = pipeline.detector.batch_buckets, pipeline.detector.max_batch_pixels
    pipeline.detector.batch_buckets, pipeline.detector.max_batch_pixels = (1, 4, 16, 64), 16 * 256 * 256
    try:
        assert pipeline.detector_warm_batches(250, 250) == [1, 4, 16]  # 64 LFW photos run as forwards of 16
        assert pipeline.detector_warm_batches(480, 640) == [1, 3]  # 3 fit one forward: 2 or 3 photos pad to 3
        assert pipeline.detector_warm_batches(720, 1280) == [1, 4]  # scaled to 360×640, padded to 384×640
        # the rows a forward of 1..cap photos gets are the shapes warm-up ran
        assert {pipeline.detector._batch_rows(n, 480, 640) for n in (1, 2, 3)} == {1, 3}
        assert {pipeline.detector._batch_rows(n, 256, 256) for n in range(1, 17)} == {1, 4, 16}
    finally:
        pipeline.detector.batch_buckets, pipeline.detector.max_batch_pixels = buckets, cap


def test_detector_layout_follows_the_plan() -> None:
    assert make_plan(Settings(device="cpu")).det_channels_last  # the CPU plan: NHWC for PyTorch's CPU kernels
    settings = Settings(device="cpu")
    plan = dataclasses.replace(make_plan(settings), det_channels_last=False, onnx_cpu=False)
    pipe = FacePipeline.from_settings(settings, plan)
    assert not pipe.detector.channels_last
    assert pipe.detector.max_batch_pixels == plan.det_max_batch_pixels  # the plan's cap reaches the detector
    batch = pipe.detector.preprocess([np.zeros((64, 64, 3), np.uint8)])
    assert pipe.detector._to_input(pipe.detector._host_batch(batch)).is_contiguous()  # NCHW all the way in


def test_warmup_detects_every_warm_size_at_its_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = FacePipeline.from_settings(Settings(device="cpu", detector={"warm_sizes": [(250, 250), (480, 640)]}))
    assert pipe.det_warm_sizes == [(250, 250), (480, 640)]
    pipe.detector.batch_buckets = (1, 4, 16, 64)  # as on CUDA
    pipe.detector.max_batch_pixels = 16 * 256 * 256
    calls: list[tuple[int, tuple[int, ...]]] = []
    monkeypatch.setattr(
        pipe, "detect", lambda images: calls.append((len(images), images[0].shape)) or [[]] * len(images)
    )
    monkeypatch.setattr(pipe, "embed", lambda crops: None)
    pipe.warmup()
    assert calls[:5] == [
        (1, (250, 250, 3)),
        (4, (250, 250, 3)),
        (16, (250, 250, 3)),
        (1, (480, 640, 3)),
        (3, (480, 640, 3)),
    ]


def test_configure_device_sets_only_unset_gemm_variables_and_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from facegate.pipeline.pipeline import NO_GEMM_WORKSPACE, configure_device

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in NO_GEMM_WORKSPACE})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cpu = dataclasses.replace(make_plan(Settings(device="cpu")), cpu_threads=None)
    configure_device(cpu)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = "1024"  # the user's own choice stays
    configure_device(dataclasses.replace(cpu, device="cuda"))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0" and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1024"


def test_configure_cpu_threads_follows_the_plan() -> None:
    import cv2

    from facegate.pipeline.pipeline import configure_cpu_threads

    before_torch, before_cv2 = torch.get_num_threads(), cv2.getNumThreads()
    try:
        cpu = make_plan(Settings(device="cpu"), Machine(gpus=0, cores=6))
        assert (cpu.cpu_threads, cpu.cpu_shards) == (1, 6)  # one thread per row of a batch, one row per core
        configure_cpu_threads(None)
        assert (torch.get_num_threads(), cv2.getNumThreads()) == (before_torch, before_cv2)
        cuda = make_plan(Settings(device="cuda"), Machine(gpus=1, cores=6))
        assert (cuda.cpu_threads, cuda.cpu_shards) == (1, 1)  # CUDA: one thread, the CPU only preprocesses
        configure_cpu_threads(1)
        assert (torch.get_num_threads(), cv2.getNumThreads()) == (1, 1)
        configure_cpu_threads(2)
        assert (torch.get_num_threads(), cv2.getNumThreads()) == (2, 2)
    finally:
        torch.set_num_threads(before_torch)
        cv2.setNumThreads(before_cv2)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["graphs", "off"])
def test_cuda_embed_stage_copies_crops_into_a_ring_of_pinned_buffers(compile_mode: str) -> None:
    """Batches prepared ahead of execution (as the engine pipelines them) keep their own crops and results."""
    cpu = next(s for s in FacePipeline.from_settings(Settings(device="cpu")).stages() if s.name == "embed")
    pipe = FacePipeline.from_settings(Settings(device="cuda", precision="fp32", compile=compile_mode))
    embed = next(s for s in pipe.stages() if s.name == "embed")
    rng = np.random.default_rng(0)
    reqs = [rng.integers(0, 255, (k, 112, 112, 3), dtype=np.uint8) for k in (1, 3, 2, 5)]
    batches = [reqs[:2], reqs[2:], reqs, [reqs[3]] * 20, reqs[:1]]  # the 4th (100 crops) grows its buffer
    want = [cpu.deliver(cpu.execute(cpu.prepare(b)), len(b)) for b in batches]
    prepared = [embed.prepare(batches[0]), embed.prepare(batches[1])]  # one batch ahead of the one running
    got = []
    for i in range(len(batches)):
        x, sizes = prepared[i]
        assert x.is_pinned() and sizes == [len(r) for r in batches[i]]
        if i + 2 < len(batches):
            prepared.append(embed.prepare(batches[i + 2]))
        got.append(embed.deliver(embed.execute((x, sizes)), len(batches[i])))
    assert prepared[3][0].shape[0] == 100 and prepared[3][0].data_ptr() != prepared[0][0].data_ptr()  # grown
    assert prepared[1][0].data_ptr() == prepared[4][0].data_ptr()  # the ring of 3 came round
    for g_batch, w_batch in zip(got, want, strict=True):
        for (ge, gq, _), (we, wq, _) in zip(g_batch, w_batch, strict=True):
            assert ge.shape == we.shape and float((ge * we).sum(1).min()) > 0.999
            np.testing.assert_allclose(gq, wq, atol=0.02)


def test_a_failed_photo_check_drops_the_photo_stage() -> None:
    pipe = FacePipeline.from_settings(Settings(device="cpu", gpu_preprocess="on"))
    assert "photo" in [s.name for s in pipe.stages()]
    calls: list[int] = []
    pipe._photo_check = lambda: calls.append(1) or False
    report = pipe.warmup()
    assert pipe.photo_limits is None and "photo_check_wait" in report and "photo_stage" not in report
    assert "photo_check_wait" not in pipe.warmup() and calls == [1]  # waited for once
    assert [s.name for s in pipe.stages()] == ["detect", "embed"]


def test_a_passed_photo_check_keeps_the_stage_and_warmup_waits_for_it() -> None:
    pipe = FacePipeline.from_settings(Settings(device="cpu", gpu_preprocess="on"))
    pipe._photo_check = lambda: True
    report = pipe.warmup()
    assert pipe.photo_limits is not None and pipe._photo_check is None
    assert "photo_check_wait" in report and "photo_stage" in report


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_start_photo_check_answers_from_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import facegate.io.decode as decode

    monkeypatch.setattr(decode, "gpu_decode_available", lambda: True)
    assert start_photo_check()() is True
    monkeypatch.setattr(decode, "gpu_decode_available", lambda: False)
    assert start_photo_check()() is False

    def boom() -> bool:
        raise RuntimeError("torchvision exploded")

    monkeypatch.setattr(decode, "gpu_decode_available", boom)
    assert start_photo_check()() is False  # a thread that died answers False


def test_the_plans_activation_budget_reaches_the_recognizer() -> None:
    crops = np.random.default_rng(4).integers(0, 255, (12, 112, 112, 3), dtype=np.uint8)
    settings = Settings(device="cpu", precision="fp32")
    want = FacePipeline.from_settings(settings).embed(crops)
    pipe = FacePipeline.from_settings(settings, dataclasses.replace(make_plan(settings), activation_budget_mib=4))
    plan = pipe.recognizer.activation_plan
    assert plan is not None and plan.split(12)[1] < 4  # sub-batches below cpu_chunk's 4
    for got, ref in zip(pipe.embed(crops), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_configure_device_caps_gpu_memory_and_refuses_more_than_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from facegate.pipeline import pipeline as pl

    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=1024 * 2**20))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    plan = dataclasses.replace(make_plan(Settings(device="cuda")), cpu_threads=None, gpu_arena_mib=None)
    pl.configure_device(plan, 256)
    assert calls == [(0.25, 0)]
    with pytest.raises(InvalidParameterError, match="exceeds"):
        pl.configure_device(plan, 2048)
    assert len(calls) == 1


@pytest.mark.gpu
def test_cuda_pipeline_within_a_memory_limit_and_activation_budget() -> None:
    """Eager fp16 with a 16 MiB activation budget under a 256 MiB allocator cap: a batch of 64 embeds as on the
    CPU, its forward allocates at most ~1.25x the budget beyond its input, and the cap holds."""
    crops = np.random.default_rng(5).integers(0, 255, (64, 112, 112, 3), dtype=np.uint8)
    want = FacePipeline.from_settings(Settings(device="cpu")).embed(crops)
    settings = Settings(device="cuda", profile="low-memory", engine={"gpu_memory_limit_mib": 256})
    lean = {"activation_budget_mib": 16, "gpu_arena_mib": None, "det_max_batch_pixels": 2 * 256 * 256}
    pipe = FacePipeline.from_settings(settings, dataclasses.replace(make_plan(settings), **lean))
    try:
        pipe.warmup()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        emb, q, _ = pipe.embed(crops)
        peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        assert peak_mib <= 16 * 1.25 + crops.nbytes / 2**20, peak_mib
        assert float((emb * want[0]).sum(1).min()) > 0.99
        assert float(np.abs(q - want[1]).max()) < 0.03
        assert torch.cuda.memory_reserved() <= 256 * 2**20
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


_ARENA_CHECK = """
import dataclasses
import torch
from facegate.config import QualitySettings, Settings
from facegate.pipeline import pipeline as pl
from facegate.tuning import make_plan

torch.zeros(1, device="cuda")
before = torch.cuda.memory_reserved()
pl.configure_device(dataclasses.replace(make_plan(Settings(device="cuda")), gpu_arena_mib=32))
after = torch.cuda.memory_reserved()
assert after >= before + 32 * 2**20, (before, after)  # one free 32 MiB block in the cache
blocks = [torch.empty(4 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(6)]  # 1-10 MiB blocks
assert torch.cuda.memory_reserved() == after  # carved from the arena: no new 20 MiB segment
del blocks
torch.cuda.empty_cache()  # nothing in it any more: it goes back to the driver
assert torch.cuda.memory_reserved() <= before
"""


@pytest.mark.gpu
def test_reserve_arena_leaves_one_segment_that_later_large_blocks_share() -> None:
    # In a fresh process, as in an engine right before its models load: in this one, a live tensor of an earlier
    # test can keep a partly free segment, and the arena's block is then carved from it.
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _ARENA_CHECK], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_out_of_memory_at_start_up_names_the_memory_limit() -> None:
    from facegate.pipeline.pipeline import within_memory_limit

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of ...")
    too_small = r"gpu_memory_limit_mib=48 is too small to load the models"
    with pytest.raises(InvalidParameterError, match=too_small) as ei, within_memory_limit(48, "load the models"):
        raise oom
    assert "Tried to allocate 20.00 MiB" in str(ei.value) and ei.value.__cause__ is oom
    with pytest.raises(torch.OutOfMemoryError), within_memory_limit(None, "load the models"):
        raise oom  # no limit set: not the setting's fault, left as it is
    with pytest.raises(ValueError), within_memory_limit(48, "load the models"):
        raise ValueError("other errors pass through")
