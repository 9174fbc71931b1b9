"""Shared by the YuNet and detector tests: LFW face helpers (the ``helpers`` fixture) and a CPU detector."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest

from facegate.models.detector import FaceDetector
from facegate.models.yunet import load_yunet
from facegate.types import Detection

FACES = ["Aaron_Eckhart_0001", "Colin_Powell_0001", "Serena_Williams_0001", "Tony_Blair_0001"]


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


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """``FACES`` (LFW names), ``read_rgb(lfw_root, name)``, ``two_faces(lfw_root)`` and
    ``assert_same_dets(got, ref, box_px=, lm_px=, score=)``."""
    return SimpleNamespace(FACES=FACES, read_rgb=_read_rgb, two_faces=_two_faces, assert_same_dets=_assert_same_dets)


@pytest.fixture(scope="module")
def detector() -> FaceDetector:
    return FaceDetector(load_yunet())
