"""The photo stage's face selection on the device: NMS, the largest face and its alignment, no host round trip.

The host path's rule and arithmetic: greedy NMS (IoU in fp64) over the first ``NMS_ROWS_MAX`` candidates as the
fixed point of ``keep_j = valid_j ∧ ¬∃ i<j: keep_i ∧ over_ij`` after :data:`ITERATIONS` Jacobi steps (triangular:
each step fixes one more rank); boxes rescaled and clipped as ``models.detector._detections``; the largest box. The
detector captures it in its CUDA graph (eager, its ~100 small kernels cost more than the NumPy NMS). A photo with
more candidates or an unconverged NMS is *not exact* and takes the host path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from facegate.models.detector import DetBatch
from facegate.models.nms import NMS_ROWS_MAX
from facegate.pipeline.align_torch import _theta_parts, umeyama_torch

#: Jacobi steps of the device NMS; a photo whose suppression chain is longer takes the host path.
ITERATIONS = 8


def _greedy_nms(boxes: Tensor, valid: Tensor, iou_threshold: float, iterations: int) -> tuple[Tensor, Tensor]:
    """Greedy NMS of ``boxes (n, c, 4)`` fp64 in score order, ``valid (n, c) bool`` → ``keep (n, c) bool`` and
    ``converged (n,) bool`` (``iterations >= 1``)."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    areas = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    iw = (torch.minimum(x2[:, :, None], x2[:, None, :]) - torch.maximum(x1[:, :, None], x1[:, None, :])).clamp(min=0)
    ih = (torch.minimum(y2[:, :, None], y2[:, None, :]) - torch.maximum(y1[:, :, None], y1[:, None, :])).clamp(min=0)
    inter = iw * ih
    union = areas[:, :, None] + areas[:, None, :] - inter
    iou = torch.where(union > 0, inter / union.clamp(min=torch.finfo(union.dtype).tiny), torch.zeros_like(inter))
    c = boxes.shape[1]
    over = (iou > iou_threshold) & torch.ones((c, c), dtype=torch.bool, device=boxes.device).triu(1)
    keep = valid
    for _ in range(iterations):
        prev = keep
        keep = valid & ~(prev[:, :, None] & over).any(1)
    return keep, (keep == prev).all(1)


def geometry(batch: DetBatch) -> np.ndarray:
    """``(n, 4) float64`` per photo of a detector batch: ``sx, sy`` (source pixels per input pixel), ``W, H``."""
    oh, ow = batch.orig_sizes[:, 0], batch.orig_sizes[:, 1]
    rh, rw = batch.resized_sizes[:, 0], batch.resized_sizes[:, 1]
    return np.stack([ow / rw, oh / rh, ow, oh], 1).astype(np.float64)


def choose_and_align(
    packed: Tensor, geo: Tensor, *, iou_threshold: float, dst: Tensor, candidates: int = NMS_ROWS_MAX
) -> tuple[Tensor, Tensor, Tensor]:
    """NMS, rescale, clip, the largest face and its warp, per row of a detector batch (tensor operations only).

    ``packed``: ``(rows, p·15 + 1) fp32``, per photo ``p`` candidates (box, landmarks, score in input pixels, by
    score) and the count above the threshold; ``geo``: ``(rows, 4) float64`` :func:`geometry`; ``dst``: the
    ``(5, 2)`` template on the device. Returns ``chosen (rows, 15)`` (clipped box, landmarks in source pixels,
    score), ``flags (rows, 2)`` (has a face, exact) and ``theta (rows, 2, 3)``, all fp32.
    """
    n = packed.shape[0]
    p = (packed.shape[1] - 1) // 15
    c = min(candidates, p)
    cand = packed[:, :-1].reshape(n, p, 15)[:, :c]
    counts = packed[:, -1].to(torch.int64)
    valid = torch.arange(c, device=packed.device)[None, :] < counts[:, None]
    keep, converged = _greedy_nms(cand[..., :4].double(), valid, iou_threshold, ITERATIONS)
    sx, sy, w, h = geo.unbind(1)
    boxes = cand[..., :4].double() * torch.stack([sx, sy, sx, sy], -1)[:, None, :]
    bx = torch.minimum(boxes[..., 0::2].clamp(min=0), w[:, None, None])
    by = torch.minimum(boxes[..., 1::2].clamp(min=0), h[:, None, None])
    boxes = torch.stack([bx[..., 0], by[..., 0], bx[..., 1], by[..., 1]], -1)
    lms = cand[..., 4:14].double().reshape(n, c, 5, 2) * torch.stack([sx, sy], -1)[:, None, None, :]
    good = keep & (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])
    b32 = boxes.float()
    area = (b32[..., 2] - b32[..., 0]) * (b32[..., 3] - b32[..., 1])
    best = torch.where(good, area, torch.full_like(area, -1.0)).argmax(1)
    rows = torch.cat([b32, lms.float().reshape(n, c, 10), cand[..., 14:15].float()], -1)
    chosen = rows.gather(1, best[:, None, None].expand(n, 1, 15))[:, 0]
    flags = torch.stack([good.any(1), (counts <= c) & converged], 1).float()
    m = umeyama_torch(chosen[:, 4:14].reshape(n, 5, 2), dst)
    return chosen, flags, _theta_parts(m.to(geo.dtype), h, w, torch.stack).float()
