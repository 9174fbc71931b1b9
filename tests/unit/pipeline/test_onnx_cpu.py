"""The CPU pipeline's default detector runs in ONNX Runtime and gives PyTorch's results end to end."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from facegate.config import Settings
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from facegate.tuning import Machine, make_plan

pytest.importorskip("onnxruntime")

LIMITS = {"max_bytes": 1 << 24, "max_pixels": 1 << 24}
NAMES = [
    "Aaron_Peirsol/Aaron_Peirsol_0001.jpg",
    "Aaron_Peirsol/Aaron_Peirsol_0002.jpg",
    "Aaron_Eckhart/Aaron_Eckhart_0001.jpg",
    "Serena_Williams/Serena_Williams_0001.jpg",
]


@pytest.fixture(scope="module")
def pipelines() -> tuple[FacePipeline, FacePipeline]:
    """(the CPU default, the same settings on PyTorch alone), in fp32 (bf16 on AMX CPUs would blur the comparison)."""
    s = Settings(device="cpu", precision="fp32")
    torch_only = dataclasses.replace(make_plan(s), onnx_cpu=False)
    return FacePipeline.from_settings(s), FacePipeline.from_settings(s, torch_only)


def test_the_cpu_default_runs_the_detector_in_onnx_runtime(pipelines: tuple[FacePipeline, FacePipeline]) -> None:
    from facegate.models.onnx_backend import OrtYuNet

    default, reference = pipelines
    assert make_plan(Settings(device="cpu")).onnx_cpu  # the CPU plan runs the detector in ONNX Runtime
    assert not make_plan(Settings(device="cuda"), Machine(gpus=1, cores=16)).onnx_cpu  # PyTorch on CUDA
    assert isinstance(default.detector.model, OrtYuNet)
    assert not isinstance(reference.detector.model, OrtYuNet)


@pytest.mark.lfw
def test_detect_align_embed_match_pytorch(pipelines: tuple[FacePipeline, FacePipeline], lfw_root: Path) -> None:
    default, reference = pipelines
    images = [decode_image((lfw_root / "lfw-deepfunneled" / n).read_bytes(), **LIMITS) for n in NAMES]
    got, want = default.faces(images, keep_crops=True), reference.faces(images, keep_crops=True)
    for g_faces, w_faces in zip(got, want, strict=True):
        assert len(g_faces) == len(w_faces) >= 1
        for g, w in zip(g_faces, w_faces, strict=True):
            assert g.detection is not None and w.detection is not None
            assert np.abs(g.detection.box - w.detection.box).max() < 1e-2
            assert np.abs(g.detection.landmarks - w.detection.landmarks).max() < 1e-2
            assert g.crop is not None and w.crop is not None
            assert np.abs(g.crop.astype(int) - w.crop.astype(int)).max() <= 1  # warp rounding at most
            assert float(g.embedding @ w.embedding) > 0.9999
            assert abs(g.quality.score - w.quality.score) < 1e-3 and g.quality.accepted == w.quality.accepted
    a1, a2, b1 = (f[0] for f in got[:3])
    same, diff = default.compare_faces(a1, a2), default.compare_faces(a1, b1)
    assert same.match is True and diff.match is False
    ref_same = reference.compare_faces(*(f[0] for f in want[:2]))
    assert same.similarity is not None and ref_same.similarity is not None
    assert abs(same.similarity - ref_same.similarity) < 1e-4
