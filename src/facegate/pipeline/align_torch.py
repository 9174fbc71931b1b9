"""Five-point face alignment in torch, batched, for accelerators: the conventions of
:mod:`facegate.pipeline.align`, whose CPU warp :func:`warp_theta` matches (``F.affine_grid`` + ``F.grid_sample``,
bilinear, ``align_corners=False``, zeros outside the image).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from facegate.pipeline.align import CROP_SIZE, similarity_matrices


def umeyama_torch(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """:func:`~facegate.pipeline.align.umeyama` on the device (its closed form, no host sync): ``src (K, P>=2, 2)``,
    ``dst (P, 2) | (K, P, 2)`` → ``(K, 2, 3) float32`` on ``src.device``. Unchecked for degenerate input (a check
    would sync): coincident points give a zero linear part; shapes unchecked (its callers' are fixed)."""
    dtype = torch.float64 if src.device.type == "cpu" else torch.float32  # CPU: exact enough to compare with NumPy
    s = src.to(dtype)
    d = dst.to(device=src.device, dtype=dtype).expand_as(s)
    return similarity_matrices(s, d, torch.finfo(dtype).tiny, torch.stack).to(torch.float32)


def _theta_parts(m: Any, in_h: Any, in_w: Any, stack: Callable[..., Any]) -> Any:
    """:func:`pixel_to_theta` on ``(K, 2, 3)`` NumPy or torch matrices (``stack``); ``in_h``/``in_w``: scalars or
    ``(K,)``."""
    a, b, c = m[:, 0, 0], m[:, 0, 1], m[:, 0, 2]
    d, e, f = m[:, 1, 0], m[:, 1, 1], m[:, 1, 2]
    det = a * e - b * d
    # M⁻¹ = [[e, -b, b f - c e], [-d, a, c d - a f]] / det
    ia, ib, ic = e / det, -b / det, (b * f - c * e) / det
    id_, ie, if_ = -d / det, a / det, (c * d - a * f) / det
    half = CROP_SIZE / 2.0
    off = (CROP_SIZE - 1) / 2.0
    # M⁻¹ · N_out⁻¹ (column scale by S/2, translation gains the (S-1)/2 offset on both axes), then
    # N_in · (...): row x by 2/W, row y by 2/H, and (1/L - 1) added to the translation.
    sx, sy = 2.0 / in_w, 2.0 / in_h
    r0 = stack([ia * half * sx, ib * half * sx, (ia * off + ib * off + ic) * sx + (1.0 / in_w - 1.0)], 1)
    r1 = stack([id_ * half * sy, ie * half * sy, (id_ * off + ie * off + if_) * sy + (1.0 / in_h - 1.0)], 1)
    return stack([r0, r1], 1)


def pixel_to_theta(M: np.ndarray, in_h: Any, in_w: Any, device: torch.device) -> torch.Tensor:
    """Source→crop pixel matrices ``M`` ``(K, 2, 3)`` → ``(K, 2, 3) float32`` ``affine_grid`` thetas on ``device``
    (source sizes ``in_h``, ``in_w``: ints or ``(K,)``): ``θ = N_in · M⁻¹ · N_out⁻¹``, with ``u = (2x + 1) / L - 1``
    (``align_corners=False``), computed in NumPy and copied once (not ~30 tiny kernels). A singular ``M`` gives
    non-finite entries."""
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = _theta_parts(np.asarray(M, np.float64), in_h, in_w, np.stack)
    # non-blocking: a blocking copy would wait for all the device's queued work (from pageable memory the
    # driver stages the few bytes at once, so the array may go)
    return torch.from_numpy(theta.astype(np.float32)).to(device, non_blocking=True)


def warp_theta(images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """One crop per image: ``images (K, 3, H, W)`` (uint8 or float; differently-sized images zero-padded at the
    bottom/right) warped by ``theta (K, 2, 3)`` (:func:`pixel_to_theta`) into ``(K, 3, 112, 112) float32``,
    bilinear, zeros outside, the input's value scale, not rounded; a non-finite theta gives an all-zero crop.
    ``torch.round(out).to(torch.uint8)`` compares with :func:`~facegate.pipeline.align.warp_cpu`."""
    grid = F.affine_grid(theta, [int(theta.shape[0]), 3, CROP_SIZE, CROP_SIZE], align_corners=False)
    # non-finite coordinates (singular M) would be undefined in grid_sample: send them far outside
    grid = torch.nan_to_num(grid, nan=-4.0, posinf=-4.0, neginf=-4.0)
    return F.grid_sample(images.to(torch.float32), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
