"""facegate.models.nms: greedy NMS, one image and many at once, against a reference and by hand."""

from __future__ import annotations

import numpy as np
import pytest

from facegate.models.nms import nms, nms_grouped, nms_rows


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _nms_reference(boxes: np.ndarray, scores: np.ndarray, thr: float) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    keep: list[int] = []
    for i in order:
        if all(_iou(boxes[i], boxes[j]) <= thr for j in keep):
            keep.append(i)
    return keep


def test_nms_hand_made() -> None:
    def run(boxes: list[list[float]], scores: list[float], thr: float) -> list[int]:
        out = nms(np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32), thr)
        assert out.dtype == np.int64
        return out.tolist()

    # D (0.95) suppresses A (IoU 0.5) and B (IoU 0.316); C does not overlap
    boxes = [[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 5]]
    assert run(boxes, [0.9, 0.8, 0.7, 0.95], 0.3) == [3, 2]
    assert run(boxes, [0.9, 0.8, 0.7, 0.95], 0.6) == [3, 0, 2]  # A-D 0.5 ok, B-A 0.68 suppressed
    # greedy: Y is suppressed by X, so Y cannot suppress Z
    assert run([[0, 0, 10, 10], [5, 0, 15, 10], [10, 0, 20, 10]], [0.9, 0.8, 0.7], 0.3) == [0, 2]
    # IoU exactly at the threshold survives (OpenCV rule); zero-area boxes never suppress
    assert run([[0, 0, 2, 1], [0, 0, 1, 1]], [0.9, 0.8], 0.5) == [0, 1]
    assert run([[0, 0, 0, 0], [0, 0, 0, 0]], [0.9, 0.8], 0.0) == [0, 1]
    assert run([], [], 0.3) == []
    rng = np.random.default_rng(1)
    for _ in range(5):
        xy = rng.uniform(0, 50, (60, 2))
        b = np.concatenate([xy, xy + rng.uniform(1, 30, (60, 2))], 1).astype(np.float32)
        s = rng.uniform(0, 1, 60).astype(np.float32)
        assert run(b.tolist(), s.tolist(), 0.3) == _nms_reference(b, s, 0.3)


@pytest.mark.parametrize("thr", [0.0, 0.3, 0.5, 1.0])
def test_nms_rows_equals_nms_per_row(thr: float) -> None:
    """All rows at once give each row's greedy NMS, with clusters, ties, exact-threshold IoU and padding rows."""
    rng = np.random.default_rng(7)
    n, c = 40, 24
    centres = rng.uniform(0, 60, (n, 3, 2))  # three clusters per row: many overlaps
    pick = rng.integers(0, 3, (n, c))
    xy = np.take_along_axis(centres, pick[..., None].repeat(2, -1), 1) + rng.normal(0, 4, (n, c, 2))
    wh = rng.uniform(5, 30, (n, c, 2))
    boxes = np.concatenate([xy, xy + wh], -1).astype(np.float32)
    boxes[0, 1] = boxes[0, 0]  # identical boxes: IoU exactly 1
    boxes[1, :, 2] = boxes[1, :, 0]  # zero-area boxes: IoU 0
    scores = -np.sort(-rng.uniform(0.6, 1.0, (n, c)).astype(np.float32), axis=1)
    scores[2, 3:6] = scores[2, 3]  # ties keep their order
    counts = rng.integers(0, c + 1, n)
    counts[:3] = c
    valid = np.arange(c)[None, :] < counts[:, None]
    keep = nms_rows(boxes, valid, thr)
    assert keep.shape == (n, c) and keep.dtype == bool and not keep[~valid].any()
    for r in range(n):
        want = nms(boxes[r, : counts[r]], scores[r, : counts[r]], thr)
        assert np.flatnonzero(keep[r]).tolist() == want.tolist(), r
        assert want.tolist() == _nms_reference(boxes[r, : counts[r]], scores[r, : counts[r]], thr)


@pytest.mark.parametrize("thr", [0.0, 0.3, 0.5, 1.0])
def test_nms_grouped_equals_nms_per_group(thr: float) -> None:
    """One IoU matrix for many images gives each image's greedy NMS: boxes of different images never suppress
    each other, even where they overlap; clusters, ties, identical and zero-area boxes, images without boxes."""
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 12, 16)
    counts[:2] = (9, 0)
    groups = np.repeat(np.arange(counts.size), counts)
    k = int(counts.sum())
    xy = rng.uniform(0, 30, (3, 2))[rng.integers(0, 3, k)] + rng.normal(0, 3, (k, 2))  # all images on one spot
    boxes = np.concatenate([xy, xy + rng.uniform(5, 30, (k, 2))], 1).astype(np.float32)
    boxes[1] = boxes[0]
    boxes[2, 2] = boxes[2, 0]
    scores = rng.uniform(0.6, 1.0, k).astype(np.float32)
    scores[3:5] = scores[5]
    order = np.lexsort((-scores, groups))
    boxes, scores = boxes[order], scores[order]
    keep = nms_grouped(boxes, groups, thr)
    assert keep.shape == (k,) and keep.dtype == bool
    start = 0
    for c in counts.tolist():
        want = start + nms(boxes[start : start + c], scores[start : start + c], thr)
        assert np.flatnonzero(keep[start : start + c]).tolist() == sorted((want - start).tolist())
        start += c
