"""Five-point face alignment in torch, batched, for accelerators: the conventions of
:mod:`facegate.pipeline.align`, whose CPU warp :func:`warp_torch` matches (``F.affine_grid`` + ``F.grid_sample``,
bilinear, ``align_corners=False``, zeros outside the image).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from facegate.errors import InvalidParameterError
from facegate.pipeline.align import CROP_SIZE, _check_size

#: :func:`warp_torch` converts at most this many bytes of source images to float32 at once.
DEFAULT_MAX_FLOAT_BYTES = 1024 * 1024 * 1024


def _compute_dtype(device: torch.device) -> torch.dtype:
    """float64 on the CPU (exact enough to compare with NumPy), float32 on accelerators."""
    return torch.float64 if device.type == "cpu" else torch.float32


def umeyama_torch(src: torch.Tensor, dst: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The least-squares similarity of :func:`~facegate.pipeline.align.umeyama` by the 2-D closed form (no SVD,
    no host sync): ``a = Σ(p·q) / Σ|p|²``, ``b = Σ(p × q) / Σ|p|²`` on centred points, ``A = [[a, −b], [b, a]]``.

    ``src (K, P>=2, 2)`` on any device, ``dst (P, 2) | (K, P, 2)`` → ``(K, 2, 3) float32`` on ``src.device``
    (computed in float64 on the CPU). No degenerate-input check (it would sync): coincident points give a zero
    linear part.
    """
    if src.ndim != 3 or src.shape[2] != 2 or src.shape[1] < 2:
        raise InvalidParameterError(
            f"src must have shape (K, P>=2, 2), got {tuple(src.shape)}", detail={"shape": list(src.shape)}
        )
    dtype = _compute_dtype(src.device)
    s = src.to(dtype)
    if isinstance(dst, np.ndarray):  # copy: ARCFACE_TEMPLATE is read-only, torch warns on those
        dst = torch.from_numpy(np.array(dst, dtype=np.float64))
    d = torch.as_tensor(dst, dtype=dtype, device=src.device)
    if tuple(d.shape) not in {tuple(src.shape[1:]), tuple(src.shape)}:
        raise InvalidParameterError(
            f"dst must have shape {tuple(src.shape[1:])} or {tuple(src.shape)}, got {tuple(d.shape)}",
            detail={"shape": list(d.shape)},
        )
    d = d.expand_as(s)
    mu_s = s.mean(dim=1)
    mu_d = d.mean(dim=1)
    sc = s - mu_s[:, None, :]
    dc = d - mu_d[:, None, :]
    norm = (sc * sc).sum(dim=(1, 2)).clamp_min(torch.finfo(dtype).tiny)
    a = (sc * dc).sum(dim=(1, 2)) / norm
    b = (sc[..., 0] * dc[..., 1] - sc[..., 1] * dc[..., 0]).sum(dim=1) / norm
    tx = mu_d[:, 0] - (a * mu_s[:, 0] - b * mu_s[:, 1])
    ty = mu_d[:, 1] - (b * mu_s[:, 0] + a * mu_s[:, 1])
    m = torch.stack([torch.stack([a, -b, tx], dim=1), torch.stack([b, a, ty], dim=1)], dim=1)
    return m.to(torch.float32)


def _theta_parts(m: Any, in_h: Any, in_w: Any, size: int, stack: Callable[..., Any]) -> Any:
    """:func:`_pixel_to_theta`'s arithmetic on ``(K, 2, 3)`` float matrices of NumPy or torch (``stack``).

    ``in_h`` / ``in_w``: the source size, a number, or one per matrix (``(K,)``, same library and device).
    """
    a, b, c = m[:, 0, 0], m[:, 0, 1], m[:, 0, 2]
    d, e, f = m[:, 1, 0], m[:, 1, 1], m[:, 1, 2]
    det = a * e - b * d
    # M⁻¹ = [[e, -b, b f - c e], [-d, a, c d - a f]] / det
    ia, ib, ic = e / det, -b / det, (b * f - c * e) / det
    id_, ie, if_ = -d / det, a / det, (c * d - a * f) / det
    half = size / 2.0
    off = (size - 1) / 2.0
    # M⁻¹ · N_out⁻¹ (column scale by S/2, translation gains the (S-1)/2 offset on both axes), then
    # N_in · (...): row x by 2/W, row y by 2/H, and (1/L - 1) added to the translation.
    sx, sy = 2.0 / in_w, 2.0 / in_h
    r0 = stack([ia * half * sx, ib * half * sx, (ia * off + ib * off + ic) * sx + (1.0 / in_w - 1.0)], 1)
    r1 = stack([id_ * half * sy, ie * half * sy, (id_ * off + ie * off + if_) * sy + (1.0 / in_h - 1.0)], 1)
    return stack([r0, r1], 1)


def _pixel_to_theta(
    M: torch.Tensor | np.ndarray, in_h: int, in_w: int, size: int, device: torch.device
) -> torch.Tensor:
    """Turn source→crop pixel matrices into ``affine_grid`` thetas (crop→source, normalised).

    With ``align_corners=False``, normalised ``u ∈ [-1, 1]`` relates to a pixel-centre coordinate
    ``x`` of an axis of length ``L`` by ``u = (2x + 1) / L - 1``. For crop pixel ``(j, i)`` the source
    pixel is ``M⁻¹ [j, i, 1]``, so ``θ = N_in · M⁻¹ · N_out⁻¹`` with
    ``N_out⁻¹: x = (S/2) u + (S-1)/2`` and ``N_in: u = (2/L) x + 1/L - 1``.

    Args:
        M: ``(K, 2, 3)`` source→crop pixel matrices: a host array (computed in float64 with NumPy, then one
            host→device copy instead of ~30 tiny kernels) or a tensor on any device (computed there).
        device: where the thetas go.

    Returns:
        ``(K, 2, 3) float32`` thetas on ``device``. A singular ``M`` yields non-finite entries.
    """
    if isinstance(M, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            theta = _theta_parts(np.asarray(M, np.float64), in_h, in_w, size, np.stack)
        # non-blocking: a blocking copy would wait for all the device's queued work (from pageable memory the
        # driver stages the few bytes at once, so the array may go)
        return torch.from_numpy(theta.astype(np.float32)).to(device, non_blocking=True)
    m = M.to(device=device, dtype=_compute_dtype(device))
    return _theta_parts(m, in_h, in_w, size, torch.stack).to(torch.float32)


def _sample_chunk(images_f: torch.Tensor, grid: torch.Tensor, local_idx: torch.Tensor) -> torch.Tensor:
    """Bilinear-sample K crops from a stack of images in one ``grid_sample`` call, copying no image.

    The image stack becomes the *depth* axis of a 5-D input ``(1, 3, B, H, W)``; each face's 2-D grid
    gets a third coordinate at the centre of its image's slice (``z = (2b + 1) / B − 1``), where the
    trilinear weights along depth are 1 for that slice and 0 for its neighbours — so the result is the
    2-D bilinear sample of image ``b`` (up to float rounding: < 1e-4 grey levels in the tests), out-of-range
    x/y read zeros exactly as in 2-D, and no per-face copy of a source image is ever made.

    Args:
        images_f: ``(B, 3, H, W)`` float32. grid: ``(K, S, S, 2)`` normalised x/y.
        local_idx: ``(K,)`` int64 index into ``images_f``, on its device.

    Returns:
        ``(K, 3, S, S)`` float32.
    """
    n_img = images_f.shape[0]
    k, s = grid.shape[0], grid.shape[1]
    z = (2.0 * local_idx.to(grid.dtype) + 1.0) / n_img - 1.0
    grid3 = torch.cat([grid, z[:, None, None, None].expand(k, s, s, 1)], dim=-1).unsqueeze(0)
    vol = images_f.transpose(0, 1).unsqueeze(0)  # (1, 3, B, H, W), a view
    out = F.grid_sample(vol, grid3, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out[0].transpose(0, 1)  # (K, 3, S, S)


def _grid(theta: torch.Tensor, size: int) -> torch.Tensor:
    """``affine_grid`` of ``theta (K, 2, 3)``: ``(K, size, size, 2)``, non-finite entries sent far outside."""
    grid = F.affine_grid(theta, [int(theta.shape[0]), 3, size, size], align_corners=False)
    # Non-finite coordinates (singular M) would be undefined in grid_sample: send them far outside.
    return torch.nan_to_num(grid, nan=-4.0, posinf=-4.0, neginf=-4.0)


def warp_theta(images: torch.Tensor, theta: torch.Tensor, size: int = CROP_SIZE) -> torch.Tensor:
    """One crop per image: ``images (K, 3, H, W)`` (uint8 or float) warped by ``theta (K, 2, 3)`` (``affine_grid``
    parameters, as :func:`_pixel_to_theta` makes them) into ``(K, 3, size, size) float32``, bilinear, zeros
    outside; a non-finite theta gives an all-zero crop."""
    return F.grid_sample(
        images.to(torch.float32), _grid(theta, size), mode="bilinear", padding_mode="zeros", align_corners=False
    )


def warp_torch(
    images: torch.Tensor,
    M: torch.Tensor | np.ndarray,
    image_index: torch.Tensor | np.ndarray,
    size: int = CROP_SIZE,
    *,
    max_float_bytes: int = DEFAULT_MAX_FLOAT_BYTES,
) -> torch.Tensor:
    """Warp K faces out of a batch of images with ``affine_grid`` + ``grid_sample``; matches :func:`warp_cpu`.

    Args:
        images: ``(B, 3, H, W)`` uint8 or floating, on any device; differently-sized images zero-padded at the
            bottom/right (see :mod:`facegate.pipeline.align`).
        M: ``(K, 2, 3)`` source→crop pixel matrices (OpenCV convention), moved to ``images.device``.
        image_index: ``(K,)`` int64, face ``k`` is cut from ``images[image_index[k]]``. Range-checked
            only when it is on the CPU (a check on the device would sync).
        size: crop side.
        max_float_bytes: the batch is converted to float32 (``B · 3 · H · W · 4`` bytes) and sampled in
            one ``grid_sample`` call, with no host sync, when that fits in this budget; otherwise it is
            processed in runs of images that fit (at least one image each), which needs ``image_index``
            on the host (one sync when it lives on the device).

    Returns:
        ``(K, 3, size, size) float32`` on ``images.device``, same value scale as the input (0–255 for
        uint8), not rounded. ``torch.round(out).to(torch.uint8)`` compares with :func:`warp_cpu`.
        A singular ``M`` gives an all-zero crop.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise InvalidParameterError(
            f"images must be (B, 3, H, W), got {tuple(images.shape)}", detail={"shape": list(images.shape)}
        )
    size = _check_size(size)
    device = images.device
    m = M if isinstance(M, np.ndarray) else torch.as_tensor(M, device=device)
    idx = torch.as_tensor(image_index)  # stays where it is (CPU for arrays/lists) until after the checks
    k = int(m.shape[0]) if m.ndim == 3 else -1
    if m.ndim != 3 or tuple(m.shape[1:]) != (2, 3):
        raise InvalidParameterError(f"M must be (K, 2, 3), got {tuple(m.shape)}", detail={"shape": list(m.shape)})
    if tuple(idx.shape) != (k,) or (k and idx.dtype.is_floating_point):
        raise InvalidParameterError(
            f"image_index must be an integer tensor of shape ({k},), got {tuple(idx.shape)} {idx.dtype}",
            detail={"shape": list(idx.shape)},
        )
    b, _, h, w = (int(v) for v in images.shape)
    if idx.device.type == "cpu" and k and (int(idx.min()) < 0 or int(idx.max()) >= b):
        raise InvalidParameterError(
            f"image_index out of range for {b} image(s)",
            detail={"min": int(idx.min()), "max": int(idx.max()), "n_images": b},
        )
    if k == 0:
        return torch.zeros((0, 3, size, size), dtype=torch.float32, device=device)
    host_idx = idx.to(torch.int64) if idx.device.type == "cpu" else None
    idx = idx.to(device=device, dtype=torch.int64, non_blocking=True)
    grid = _grid(_pixel_to_theta(m, h, w, size, device), size)

    per_image = 3 * h * w * 4
    if b * per_image <= max_float_bytes:
        return _sample_chunk(images.to(torch.float32), grid, idx)

    run = max(1, max_float_bytes // per_image)
    host_idx = idx.cpu() if host_idx is None else host_idx  # one sync when image_index lives on the device
    out = torch.empty((k, 3, size, size), dtype=torch.float32, device=device)
    for start in range(0, b, run):
        sel = torch.nonzero((host_idx >= start) & (host_idx < start + run)).flatten()
        if len(sel) == 0:
            continue
        sel_dev = sel.to(device)
        chunk = images[start : start + run].to(torch.float32)
        res = _sample_chunk(chunk, grid.index_select(0, sel_dev), idx.index_select(0, sel_dev) - start)
        out.index_copy_(0, sel_dev, res)
    return out
