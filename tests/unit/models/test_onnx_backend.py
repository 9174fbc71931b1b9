"""The ONNX Runtime CPU backend of the detector: the exported graph computes what facegate's YuNet module does."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from facegate.errors import ModelError
from facegate.models.detector import FaceDetector
from facegate.models.onnx_backend import (
    PARITY_MAX_ABS_DIFF,
    OrtYuNet,
    attach_onnx_detector,
    export_yunet_onnx,
    ort_session,
    parity_input,
    yunet_parity,
)
from facegate.models.yunet import load_yunet

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def pair() -> tuple[FaceDetector, FaceDetector]:
    """A PyTorch CPU detector and one whose network runs in ONNX Runtime, on the same weights."""
    ref = FaceDetector(load_yunet(), device="cpu")
    ort = FaceDetector(load_yunet(), device="cpu")
    attach_onnx_detector(ort, threads=1)
    return ref, ort


def test_exported_graph_matches_the_module_at_other_shapes() -> None:
    """Batch, height and width are symbolic: a 2×320×192 batch (not the traced 1×64×64) gives the same outputs
    as the PyTorch module on the detector's own input conversion."""
    model = load_yunet()
    graph = export_yunet_onnx(model)
    # YuNet's convolutions, not the channels-last matmul path PyTorch takes on the CPU
    ops = [node.op_type for node in onnx.load_from_string(graph).graph.node]
    assert "MatMul" not in ops and "Shape" not in ops  # the heads' reshapes have constant shapes
    session = ort_session(graph, threads=1)
    images = np.concatenate([parity_input(320, 192, seed=1), parity_input(320, 192, seed=2)])
    assert yunet_parity(model, session, images) <= PARITY_MAX_ABS_DIFF
    det = FaceDetector(load_yunet(), device="cpu", channels_last=False)
    with torch.inference_mode():
        ref = model(det._to_input(torch.from_numpy(images)))
    got = OrtYuNet(session, model)(torch.from_numpy(images))
    for ref_level, got_level in zip(ref, got, strict=True):
        for r, g in zip(ref_level, got_level, strict=True):
            assert g.shape == r.shape and g.dtype == torch.float32
            torch.testing.assert_close(g, r, atol=PARITY_MAX_ABS_DIFF, rtol=0)


def test_attach_swaps_the_network_and_keeps_the_module(pair: tuple[FaceDetector, FaceDetector]) -> None:
    _, ort = pair
    assert isinstance(ort.model, OrtYuNet) and not ort.channels_last
    assert ort.model.torch_model is not None
    attach_onnx_detector(ort, threads=1)  # again: re-exports from the kept PyTorch module
    assert isinstance(ort.model.torch_model, torch.nn.Module)


def test_no_face_either_way(pair: tuple[FaceDetector, FaceDetector]) -> None:
    ref, ort = pair
    blank = np.full((200, 300, 3), 127, np.uint8)
    assert ref.detect([blank]) == ort.detect([blank]) == [[]]


@pytest.mark.lfw
def test_detections_match_pytorch_on_faces(
    helpers: SimpleNamespace, pair: tuple[FaceDetector, FaceDetector], lfw_root: Path
) -> None:
    ref, ort = pair
    images = [helpers.read_rgb(lfw_root, n) for n in helpers.FACES] + [helpers.two_faces(lfw_root)]
    for got, want in zip(ort.detect(images), ref.detect(images), strict=True):
        assert got
        helpers.assert_same_dets(got, want, box_px=1e-2, lm_px=1e-2, score=1e-4)


def test_refuses_a_detector_it_cannot_run() -> None:
    with pytest.raises(ModelError, match="fp32 on the CPU"):
        attach_onnx_detector(FaceDetector(load_yunet(), device="cpu", dtype=torch.bfloat16))


def test_a_parity_failure_stops_the_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import facegate.models.onnx_backend as backend

    monkeypatch.setattr(backend, "yunet_parity", lambda model, session: 0.5)
    det = FaceDetector(load_yunet(), device="cpu")
    with pytest.raises(ModelError, match="differs from PyTorch"):
        attach_onnx_detector(det, threads=1)
    assert not isinstance(det.model, OrtYuNet)  # left on PyTorch
