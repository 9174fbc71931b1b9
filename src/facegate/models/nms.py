"""Greedy non-maximum suppression on the host, by OpenCV's ``NMSBoxes`` rule: visit boxes by descending score (ties:
lower index first), keep one and drop every later box whose IoU with it is ``> iou_threshold`` (IoU in fp64; a
zero union gives IoU 0)."""

from __future__ import annotations

import numpy as np

#: Most candidates per row :func:`nms_rows` takes (its IoU tensor is ``rows × c × c`` fp64); crowds go one by one.
NMS_ROWS_MAX = 64


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of broadcast xyxy boxes ``a (..., 4)``, ``b (..., 4)`` in fp64; a zero union gives 0."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    iwh = np.clip(np.minimum(a[..., 2:], b[..., 2:]) - np.maximum(a[..., :2], b[..., :2]), 0, None)
    inter = iwh[..., 0] * iwh[..., 1]
    wa, wb = np.clip(a[..., 2:] - a[..., :2], 0, None), np.clip(b[..., 2:] - b[..., :2], 0, None)
    union = wa[..., 0] * wa[..., 1] + wb[..., 0] * wb[..., 1] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy NMS of ``boxes (K, 4)`` xyxy by ``scores (K,)``: the kept indices ``(k,) int64``, by score."""
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        order = order[1:][_iou(boxes[i], boxes[order[1:]]) <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def nms_rows(boxes: np.ndarray, valid: np.ndarray, iou_threshold: float) -> np.ndarray:
    """:func:`nms` of many rows at once: ``boxes (N, C, 4)`` xyxy by descending score, ``valid (N, C) bool`` (a
    prefix of each row) → the kept ``(N, C) bool``."""
    c = boxes.shape[1]
    # over[r, i, j]: candidate i, if kept, removes the later candidate j
    over = (_iou(boxes[:, :, None], boxes[:, None, :]) > iou_threshold) & np.triu(np.ones((c, c), bool), 1)[None]
    alive = np.array(valid, bool, copy=True)
    for k in range(c):
        rows = np.flatnonzero(alive[:, k])
        if rows.size:
            alive[rows] &= ~over[rows, k]
    return alive


#: Most candidates of a whole batch :func:`nms_grouped` takes (its IoU matrix is ``K × K`` fp64).
NMS_GROUPED_MAX = 256


def nms_grouped(boxes: np.ndarray, groups: np.ndarray, iou_threshold: float) -> np.ndarray:
    """:func:`nms` of every image of a batch at once: ``boxes (K ≥ 1, 4)`` xyxy ordered by ``groups (K,) int`` (the
    image, ascending) and within a group by descending score (ties: lower index first) → the kept ``(K,) bool``. One
    IoU matrix for the batch, then one greedy pass: a few candidates per face beat :func:`nms` per image."""
    over = _iou(boxes[:, None], boxes[None]) > iou_threshold
    if groups[0] != groups[-1]:  # over[i, j] for j > i: box i, if kept, removes the later box j of its image
        over &= groups[:, None] == groups[None]
    keep = np.ones(boxes.shape[0], bool)
    for i in range(boxes.shape[0] - 1):  # ascending: i's fate is settled before it is visited
        if keep[i]:
            keep[i + 1 :] &= ~over[i, i + 1 :]
    return keep
