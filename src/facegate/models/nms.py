"""Greedy non-maximum suppression on the host, by OpenCV's ``NMSBoxes`` rule: visit boxes by descending score (ties:
lower index first), keep one and drop every later box whose IoU with it is ``> iou_threshold`` (IoU in fp64; a
zero union gives IoU 0)."""

from __future__ import annotations

import numpy as np

#: Most candidates per row :func:`nms_rows` takes (its IoU tensor is ``rows × c × c`` fp64); crowds go one by one.
NMS_ROWS_MAX = 64


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy NMS of ``boxes (K, 4)`` xyxy by ``scores (K,)``: the kept indices ``(k,) int64``, by score."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (boxes[:, j].astype(np.float64) for j in range(4))
    areas = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    keep: list[int] = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        iw = np.clip(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0, None)
        ih = np.clip(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0, None)
        inter = iw * ih
        union = areas[i] + areas[rest] - inter
        iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[iou <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def nms_rows(boxes: np.ndarray, valid: np.ndarray, iou_threshold: float) -> np.ndarray:
    """:func:`nms` of many rows at once: ``boxes (N, C, 4)`` xyxy by descending score, ``valid (N, C) bool`` (a
    prefix of each row) → the kept ``(N, C) bool``."""
    b = boxes.astype(np.float64)
    x1, y1, x2, y2 = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    areas = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    iw = np.clip(np.minimum(x2[:, :, None], x2[:, None, :]) - np.maximum(x1[:, :, None], x1[:, None, :]), 0, None)
    ih = np.clip(np.minimum(y2[:, :, None], y2[:, None, :]) - np.maximum(y1[:, :, None], y1[:, None, :]), 0, None)
    inter = iw * ih
    union = areas[:, :, None] + areas[:, None, :] - inter
    iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    c = b.shape[1]
    # over[r, i, j]: candidate i, if kept, removes the later candidate j
    over = (iou > iou_threshold) & np.triu(np.ones((c, c), bool), 1)[None]
    alive = np.array(valid, bool, copy=True)
    for k in range(c):
        rows = np.flatnonzero(alive[:, k])
        if rows.size:
            alive[rows] &= ~over[rows, k]
    return alive


#: Most candidates of a whole batch :func:`nms_grouped` takes (its IoU matrix is ``K × K`` fp64).
NMS_GROUPED_MAX = 256


def nms_grouped(boxes: np.ndarray, groups: np.ndarray, iou_threshold: float) -> np.ndarray:
    """:func:`nms` of every image of a batch at once: ``boxes (K, 4)`` xyxy ordered by ``groups (K,) int`` (the
    image, ascending) and within a group by descending score (ties: lower index first) → the kept ``(K,) bool``.
    One IoU matrix for the batch, then one greedy pass:
    a few candidates per face make the matrix cheaper than one :func:`nms` call per image."""
    if not boxes.shape[0]:
        return np.zeros(0, bool)
    b = boxes.astype(np.float64)
    wh = np.maximum(b[:, 2:] - b[:, :2], 0)
    areas = wh[:, 0] * wh[:, 1]
    iwh = np.maximum(np.minimum(b[:, None, 2:], b[None, :, 2:]) - np.maximum(b[:, None, :2], b[None, :, :2]), 0)
    inter = iwh[..., 0] * iwh[..., 1]
    union = areas[:, None] + areas[None] - inter
    # a zero union has a zero intersection: IoU 0, as in nms(); every other union is far above `tiny`
    over = inter / np.maximum(union, np.finfo(np.float64).tiny) > iou_threshold
    if groups[0] != groups[-1]:  # over[i, j] for j > i: box i, if kept, removes the later box j of its image
        over &= groups[:, None] == groups[None]
    keep = np.ones(b.shape[0], bool)
    for i in range(b.shape[0] - 1):  # ascending: i's fate is settled before it is visited
        if keep[i]:
            keep[i + 1 :] &= ~over[i, i + 1 :]
    return keep
