"""Greedy non-maximum suppression (OpenCV's ``NMSBoxes`` rule), on the host (NumPy) or on a device (torch)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from facegate.errors import InvalidParameterError

__all__ = ["NMS_ROWS_MAX", "nms", "nms_rows"]

#: Most candidates per row :func:`nms_rows` is used for (its IoU tensor is ``rows × c × c`` fp64); the
#: detector runs rows with more (crowds) through the per-image loop.
NMS_ROWS_MAX = 64


def _nms_numpy(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy NMS on host arrays; see :func:`nms`. ``boxes (K, 4)``, ``scores (K,)``; returns int64 indices."""
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
    """Greedy NMS of many images at once, each row's candidates already in visiting order.

    The same rule and fp64 arithmetic as :func:`nms`, so each row's result equals ``nms`` on that row's valid
    candidates; instead of a Python loop per image, the loop runs over candidate ranks, over all rows at once.

    Args:
        boxes: ``(N, C, 4)`` xyxy; row ``r``'s candidates sorted by descending score (ties: as given).
        valid: ``(N, C) bool``: the real candidates of each row (a prefix of it).
        iou_threshold: suppression threshold in ``[0, 1]``.

    Returns:
        ``(N, C) bool``: the kept candidates.
    """
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


def _nms_torch(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy NMS with tensor ops on ``boxes``' device (one host sync per kept box); see :func:`nms`."""
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes.double()
    x1, y1, x2, y2 = b.unbind(1)
    areas = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    keep: list[Tensor] = []
    while order.numel():
        i = order[0]
        keep.append(i)
        rest = order[1:]
        iw = (torch.minimum(x2[i], x2[rest]) - torch.maximum(x1[i], x1[rest])).clamp(min=0)
        ih = (torch.minimum(y2[i], y2[rest]) - torch.maximum(y1[i], y1[rest])).clamp(min=0)
        inter = iw * ih
        union = areas[i] + areas[rest] - inter
        iou = torch.where(union > 0, inter / union.clamp(min=1e-300), torch.zeros_like(inter))
        order = rest[iou <= iou_threshold]
    if not keep:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    return torch.stack(keep).to(torch.int64)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """Greedy non-maximum suppression.

    Visits boxes by descending score (ties: lower index first); keeps a box and removes every remaining box
    whose IoU with it is ``> iou_threshold`` (a box with IoU exactly at the threshold survives, as in
    OpenCV's ``NMSBoxes``). Boxes with zero union have IoU 0. IoU is computed in fp64.

    Args:
        boxes: ``(K, 4)`` xyxy, any float dtype, any device.
        scores: ``(K,)``.
        iou_threshold: suppression threshold in ``[0, 1]``.

    Returns:
        ``(k,) int64`` indices into ``boxes`` of the kept boxes, by descending score, on ``boxes``' device.
        CPU tensors run through NumPy; other devices use tensor ops (one host sync per kept box).
    """
    if boxes.numel() == 0 and scores.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    if boxes.ndim != 2 or boxes.shape[-1] != 4 or scores.shape != boxes.shape[:1]:
        raise InvalidParameterError(f"nms expects boxes (K, 4) and scores (K,), got {tuple(boxes.shape)}")
    if boxes.device.type == "cpu":
        keep = _nms_numpy(boxes.detach().double().numpy(), scores.detach().double().numpy(), iou_threshold)
        return torch.from_numpy(keep)
    return _nms_torch(boxes, scores, iou_threshold)
