"""FaceDetector (models/detector.py): preprocessing on the host and the device, batching, precision, CUDA graphs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from facegate.errors import EmptyInputError, InvalidParameterError
from facegate.models.detector import FaceDetector, same_device
from facegate.models.yunet import flat_outputs, load_yunet


def test_preprocess_resizes_pads_and_validates(detector: FaceDetector) -> None:
    imgs = [np.full((100, 50, 3), 7, np.uint8), np.full((1280, 960, 3), 9, np.uint8)]
    batch = detector.preprocess(imgs)
    assert batch.images.shape == (2, 640, 480, 3) and batch.images.dtype == np.uint8
    assert batch.input_hw == (640, 480)
    assert batch.orig_sizes.tolist() == [[100, 50], [1280, 960]]
    assert batch.resized_sizes.tolist() == [[100, 50], [640, 480]]
    assert (batch.images[0, :100, :50] == 7).all() and batch.images[0, 100:].max() == 0
    assert batch.images[0, :, 50:].max() == 0 and (batch.images[1] == 9).all()
    for bad in (np.zeros((10, 10), np.uint8), np.zeros((10, 10, 4), np.uint8), np.zeros((10, 10, 3)), "x"):
        with pytest.raises(InvalidParameterError):
            detector.preprocess([imgs[0], bad])
    with pytest.raises(InvalidParameterError):
        detector.preprocess([np.zeros((0, 10, 3), np.uint8)])
    with pytest.raises(EmptyInputError):
        detector.preprocess([])
    assert detector.detect([]) == []


def test_bucket_padding_stays_within_the_pixel_cap(detector: FaceDetector) -> None:
    buckets, cap = detector.batch_buckets, detector.max_batch_pixels
    detector.batch_buckets = (4, 16, 64)
    px = 256 * 256  # an LFW photo's padded size
    try:
        detector.max_batch_pixels = None
        assert [detector._batch_rows(n, 256, 256) for n in (1, 5, 70)] == [4, 16, 70]
        detector.max_batch_pixels = px  # one photo per forward: never padded to 4 rows (4× the memory)
        assert detector._batch_rows(1, 256, 256) == 1
        assert detector.preprocess([np.zeros((250, 250, 3), np.uint8)]).images.shape[0] == 1
        detector.max_batch_pixels = 10 * px  # 4 fits; past it, the rows the cap holds (one shape, warmed up)
        assert [detector._batch_rows(n, 256, 256) for n in (1, 4, 5, 10)] == [4, 4, 10, 10]
        assert detector._batch_rows(1, 1024, 1024) == 1  # a photo over the cap runs alone
    finally:
        detector.batch_buckets, detector.max_batch_pixels = buckets, cap


def test_same_device(monkeypatch: pytest.MonkeyPatch) -> None:
    d = torch.device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device(d("cuda:1"), d("cuda")) and same_device(d("cuda"), d("cuda:1"))  # nvJPEG's "cuda:1" vs ours
    assert not same_device(d("cuda:0"), d("cuda")) and not same_device(d("cuda:0"), d("cuda:1"))
    assert same_device(d("cpu"), d("cpu")) and not same_device(d("cpu"), d("cuda"))


def test_preprocess_tensors_builds_the_host_canvas(detector: FaceDetector) -> None:
    rng = np.random.default_rng(1)
    sizes = [(250, 250), (120, 300), (120, 300), (120, 300), (250, 250), (200, 240), (250, 250), (250, 250)]
    imgs = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]  # runs of equal sizes
    host = detector.preprocess(imgs)
    dev = detector.preprocess_tensors([torch.from_numpy(im).permute(2, 0, 1) for im in imgs])
    assert isinstance(dev.images, torch.Tensor) and dev.input_hw == host.input_hw  # same canvas → same detections
    np.testing.assert_array_equal(dev.images.numpy(), host.images)
    for field in ("orig_sizes", "resized_sizes"):
        np.testing.assert_array_equal(getattr(dev, field), getattr(host, field))
    with pytest.raises(InvalidParameterError):
        detector.preprocess_tensors([torch.zeros((250, 250, 3), dtype=torch.uint8)])  # HWC, not CHW
    with pytest.raises(EmptyInputError):
        detector.preprocess_tensors([])


def test_no_face(detector: FaceDetector) -> None:
    grey = np.full((250, 250, 3), 128, np.uint8)
    assert detector.detect([grey, np.zeros((64, 300, 3), np.uint8)]) == [[], []]


@pytest.mark.lfw
def test_two_faces_and_rescaling(helpers: SimpleNamespace, detector: FaceDetector, lfw_root: Path) -> None:
    canvas = helpers.two_faces(lfw_root)
    (dets,) = detector.detect([canvas])
    assert len(dets) == 2
    assert dets[0].score >= dets[1].score >= 0.6
    centres = sorted(float(d.box[0] + d.box[2]) / 2 for d in dets)
    assert 20 < centres[0] < 270 < 290 < centres[1] < 540  # one face in each pasted photo
    for d in dets:
        assert d.box.dtype == np.float32 and d.box.shape == (4,) and d.landmarks.shape == (5, 2)
        assert d.landmarks.dtype == np.float32
        assert d.box[0] < d.landmarks[:, 0].min() and d.landmarks[:, 0].max() < d.box[2]
    # the prefetch overflow path (second copy) gives the same answer
    small = FaceDetector(detector.model)
    small.prefetch = 2
    helpers.assert_same_dets(small.detect([canvas])[0], dets, box_px=0, lm_px=0, score=0)
    # a large photo is downscaled to max_side (INTER_AREA) and the result mapped back to its own pixels
    big = cv2.resize(helpers.read_rgb(lfw_root, helpers.FACES[2]), (1000, 800), interpolation=cv2.INTER_CUBIC)
    (got,) = detector.detect([big])
    (ref,) = detector.detect([cv2.resize(big, (640, 512), interpolation=cv2.INTER_AREA)])
    assert len(ref) == len(got) == 1
    np.testing.assert_allclose(got[0].box, ref[0].box * 1.5625, atol=1e-3)
    np.testing.assert_allclose(got[0].landmarks, ref[0].landmarks * 1.5625, atol=1e-3)
    assert got[0].box.min() >= 0 and got[0].box[2] <= 1000 and got[0].box[3] <= 800


@pytest.mark.lfw
def test_batch_equals_single(helpers: SimpleNamespace, detector: FaceDetector, lfw_root: Path) -> None:
    """Mixed sizes: padding to the batch's common size moves boxes by at most ~1.3 px (measured)."""
    face = helpers.read_rgb(lfw_root, helpers.FACES[0])
    big = cv2.resize(helpers.read_rgb(lfw_root, helpers.FACES[2]), (1000, 800), interpolation=cv2.INTER_LINEAR)
    images = [face, helpers.two_faces(lfw_root), big, np.full((90, 120, 3), 200, np.uint8)]
    batched = detector.detect(images)
    assert [len(d) for d in batched] == [1, 2, 1, 0]
    for img, dets in zip(images, batched, strict=True):
        helpers.assert_same_dets(dets, detector.detect([img])[0], box_px=2.0, lm_px=1.0, score=2e-3)
    # identical images in one batch give identical results
    same = detector.detect([face, face, face])
    for d in same[1:]:
        helpers.assert_same_dets(d, same[0], box_px=1e-4, lm_px=1e-4, score=1e-6)


@pytest.mark.lfw
def test_enqueue_then_finish_equals_run_many(helpers: SimpleNamespace, detector: FaceDetector, lfw_root: Path) -> None:
    """Off CUDA, enqueue_many computes at once and finish_many hands the same detections back."""
    images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES] + [helpers.two_faces(lfw_root)]
    batches = [detector.preprocess(images[:2]), detector.preprocess(images[2:])]
    pending = detector.enqueue_many(batches)
    assert pending.event is None and pending.done is not None
    got, want = detector.finish_many(pending), detector.run_many(batches)
    assert [len(d) for b in got for d in b] == [len(d) for b in want for d in b] and sum(map(len, got[1])) >= 2
    for gb, wb in zip(got, want, strict=True):
        for g, w in zip(gb, wb, strict=True):
            helpers.assert_same_dets(g, w, box_px=0, lm_px=0, score=0)
    assert detector.finish_many(detector.enqueue_many([])) == []


@pytest.mark.parametrize(("top_k", "power"), [(5000, 3), (3, 3), (5000, 40)])
def test_host_postprocess_equals_the_device_selection(detector: FaceDetector, top_k: int, power: int) -> None:
    """The CPU's threshold-first decode finds the device path's candidates (decode all, top-k, threshold count),
    in the same order, for crowds past the prefetch too (``power`` 3: hundreds per row, NMS per image), a few
    per row (``power`` 40: one NMS for the batch), with a ``top_k`` cap, and rows of no face."""
    rng = np.random.default_rng(0)
    batch = detector.preprocess([np.zeros((250, 250, 3), np.uint8), np.zeros((200, 180, 3), np.uint8)] * 2)
    a = [(256 // s) ** 2 for s in (8, 16, 32)]
    cls = [torch.from_numpy(rng.uniform(0, 1, (4, n, 1)).astype(np.float32) ** power) for n in a]
    obj = [torch.from_numpy(rng.uniform(0.5, 1, (4, n, 1)).astype(np.float32)) for n in a]
    for c in cls:
        c[3] = 0.0  # an image without a face
    bbox = [torch.from_numpy(rng.normal(0, 1, (4, n, 4)).astype(np.float32)) for n in a]
    kps = [torch.from_numpy(rng.normal(0, 3, (4, n, 10)).astype(np.float32)) for n in a]
    old_k, detector.top_k = detector.top_k, top_k
    try:
        got = detector._postprocess_host([t.numpy() for t in flat_outputs((cls, obj, bbox, kps))], batch)
        with torch.inference_mode():
            packed, *full = detector._select((cls, obj, bbox, kps), batch.input_hw)
            want = detector._finish_host(packed[: len(batch)].numpy(), batch, tuple(full))
    finally:
        detector.top_k = old_k
    assert [len(d) for d in got] == [len(d) for d in want] and got[3] == []
    assert len(got[0]) > (10 if top_k > 10 and power < 10 else 1)
    for g, w in zip(got, want, strict=True):
        for p, q in zip(g, w, strict=True):
            np.testing.assert_allclose(p.box, q.box, rtol=1e-6, atol=1e-4)
            np.testing.assert_allclose(p.landmarks, q.landmarks, rtol=1e-6, atol=1e-4)
            assert p.score == pytest.approx(q.score, abs=1e-6)


@pytest.mark.lfw
def test_rare_candidates_without_a_graph_run_the_batch_again(
    helpers: SimpleNamespace, detector: FaceDetector, lfw_root: Path
) -> None:
    """A crowd row's candidates past the prefetch, when neither the decoded outputs nor a graph of the batch's
    shape are at hand: the batch runs again eagerly, with the same candidates."""
    batch = detector.preprocess([helpers.two_faces(lfw_root)])
    _, *full = detector._select(detector.forward(batch), batch.input_hw)
    want = detector._rare_candidates(batch, 0, 5, (full[0], full[1], full[2]))
    np.testing.assert_array_equal(detector._rare_candidates(batch, 0, 5, None), want)


@pytest.mark.lfw
def test_bf16_on_cpu_agrees_with_fp32(helpers: SimpleNamespace, detector: FaceDetector, lfw_root: Path) -> None:
    try:
        low = FaceDetector(load_yunet(), dtype=torch.bfloat16)
        images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES[:2]]
        got = low.detect(images)
    except RuntimeError as exc:  # pragma: no cover - CPU builds without bf16 conv
        pytest.skip(f"bf16 conv unsupported on this CPU: {exc}")
    for g, r in zip(got, detector.detect(images), strict=True):
        helpers.assert_same_dets(g, r, box_px=3.0, lm_px=3.0, score=1e-2)


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_fp16_and_fp32_agree(helpers: SimpleNamespace, detector: FaceDetector, lfw_root: Path) -> None:
    images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES] + [
        helpers.two_faces(lfw_root),
        np.full((200, 300, 3), 90, np.uint8),
    ]
    ref = detector.detect(images)  # CPU fp32
    cuda32 = FaceDetector(load_yunet(), device="cuda", dtype=torch.float32)
    cuda16 = FaceDetector(load_yunet(), device="cuda", dtype=torch.float16)
    batch = cuda16.preprocess(images)
    assert batch.pinned is not None and batch.pinned.is_pinned()
    assert batch.pinned.data_ptr() == batch.images.ctypes.data
    got32, got16 = cuda32.detect(images), cuda16.detect(images)
    for r, g32, g16 in zip(ref, got32, got16, strict=True):
        # cuDNN may use TF32 for fp32 convolutions (PyTorch's default), hence not bit-exact
        helpers.assert_same_dets(g32, r, box_px=0.5, lm_px=0.5, score=2e-3)
        helpers.assert_same_dets(g16, g32, box_px=1.5, lm_px=1.5, score=5e-3)


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_graphs_equal_eager(helpers: SimpleNamespace, lfw_root: Path) -> None:
    """A graphed detector returns the eager detector's results; padding rows and new shapes are handled."""
    images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES] + [
        helpers.two_faces(lfw_root),
        np.full((200, 300, 3), 90, np.uint8),
    ]
    eager = FaceDetector(load_yunet(), device="cuda", dtype=torch.float32, channels_last=False)
    graphed = FaceDetector(load_yunet(), device="cuda", dtype=torch.float32, channels_last=False)
    graphed.enable_graphs(max_graphs=2)
    graphed.batch_buckets = eager.batch_buckets = (1, 4, 8)
    for _ in range(2):  # the second round replays the graphs captured in the first
        for img in images:
            helpers.assert_same_dets(
                graphed.detect([img])[0], eager.detect([img])[0], box_px=1e-3, lm_px=1e-3, score=1e-5
            )
    lfw_batch = images[: len(helpers.FACES)]
    for g, e in zip(graphed.detect(lfw_batch), eager.detect(lfw_batch), strict=True):
        helpers.assert_same_dets(g, e, box_px=1e-3, lm_px=1e-3, score=1e-5)
    assert len(graphed._graphs) == 2  # capped: further shapes ran eagerly, with the same results


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_run_many_equals_run(helpers: SimpleNamespace, lfw_root: Path) -> None:
    """Several batches of one graph shape enqueued before one wait (run_many) give each batch's own results,
    also when a row overflows the prefetch (its batch's graph is replayed again for it)."""
    images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES] + [helpers.two_faces(lfw_root)[:250, :250]]
    det = FaceDetector(load_yunet(), device="cuda", dtype=torch.float16)
    det.enable_graphs()
    det.batch_buckets = (4,)
    batches = [det.preprocess(images[k : k + 3]) for k in range(0, len(images), 3)]
    want = [det.run_many([b])[0] for b in batches]
    got = det.run_many(batches)
    assert len(det._graphs) == 1 and len(got) == len(batches)
    for gb, wb in zip(got, want, strict=True):
        for g, w in zip(gb, wb, strict=True):
            helpers.assert_same_dets(g, w, box_px=0, lm_px=0, score=0)
    # prefetch 2: rows overflow, so their batch's graph is replayed again after later batches overwrote it
    small = FaceDetector(det.model, device="cuda", dtype=torch.float16)
    small.enable_graphs()
    small.batch_buckets, small.prefetch = (4,), 2
    for gb, wb in zip(small.run_many(batches), want, strict=True):
        for g, w in zip(gb, wb, strict=True):
            helpers.assert_same_dets(g, w, box_px=1e-3, lm_px=1e-3, score=1e-5)


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_enqueue_on_one_thread_finish_on_another(helpers: SimpleNamespace, lfw_root: Path) -> None:
    """The photo stage's split: batches enqueued on one thread, then more enqueued (overwriting the graph's
    outputs) before the first are finished on another thread; each batch keeps its own results, also the rows
    that overflow the prefetch (their graph replays again at finish)."""
    import threading

    images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES] + [helpers.two_faces(lfw_root)[:250, :250]]
    det = FaceDetector(load_yunet(), device="cuda", dtype=torch.float16)
    det.enable_graphs()
    det.batch_buckets, det.prefetch = (4,), 2
    first = [det.preprocess(images[k : k + 3]) for k in range(0, len(images), 3)]
    second = list(reversed(first))
    want_first = [det.run_many([b])[0] for b in first]
    want_second = [det.run_many([b])[0] for b in second]
    pending = [det.enqueue_many(first), det.enqueue_many(second)]
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.extend(det.finish_many(p) for p in pending))
    worker.start()
    worker.join(timeout=60)
    assert len(got) == 2
    for got_b, want_b in zip(got, (want_first, want_second), strict=True):
        for gb, wb in zip(got_b, want_b, strict=True):  # type: ignore[call-overload]
            for g, w in zip(gb, wb, strict=True):
                helpers.assert_same_dets(g, w, box_px=1e-3, lm_px=1e-3, score=1e-5)
