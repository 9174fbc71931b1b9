"""Synthetic degradations ``(image (H, W, 3) uint8 RGB, severity 1..5, rng) → image``, worse as the severity grows.
They apply to whole photos before detection, so every quality signal sees the degraded picture."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import cv2
import numpy as np

Degradation = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]
SEVERITIES = (1, 2, 3, 4, 5)


def path_rng(path: str, k: int, seed: int = 0) -> np.random.Generator:
    """Deterministic RNG for variant ``k`` of ``path``."""
    h = hashlib.sha256(f"{seed}:{path}:{k}".encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def blur(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    sigma = [0.8, 1.5, 2.5, 3.5, 5.0][s - 1]
    return cv2.GaussianBlur(img, (0, 0), sigmaX=sigma)


def noise(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    sigma = [6, 12, 20, 32, 48][s - 1]
    return np.clip(img.astype(np.float32) + rng.normal(0, sigma, img.shape), 0, 255).astype(np.uint8)


def jpeg(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    q = [40, 20, 12, 7, 3][s - 1]
    _, buf = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, q])
    return cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def lowres(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    f = [0.6, 0.4, 0.28, 0.2, 0.14][s - 1]
    h, w = img.shape[:2]
    small = cv2.resize(img, (max(1, int(w * f)), max(1, int(h * f))), interpolation=cv2.INTER_AREA)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)


def occlusion(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    """A grey rectangle over part of the central face region (where LFW's face is)."""
    frac = [0.10, 0.18, 0.26, 0.34, 0.42][s - 1]
    h, w = img.shape[:2]
    out = img.copy()
    ch, cw = int(h * 0.5), int(w * 0.4)  # central face box
    oh, ow = int(np.sqrt(frac) * ch * 1.3), int(np.sqrt(frac) * cw * 1.3)
    y0 = int(h * 0.25 + rng.uniform(0, max(1, ch - oh)))
    x0 = int(w * 0.3 + rng.uniform(0, max(1, cw - ow)))
    out[y0 : y0 + oh, x0 : x0 + ow] = rng.integers(0, 255)
    return out


def _gain(gains: list[float]) -> Degradation:
    return lambda img, s, rng: np.clip(img.astype(np.float32) * gains[s - 1], 0, 255).astype(np.uint8)


overexpose, underexpose = _gain([1.5, 2.0, 2.6, 3.3, 4.2]), _gain([0.5, 0.32, 0.2, 0.12, 0.07])


DEGRADATIONS: dict[str, Degradation] = {
    "blur": blur,
    "noise": noise,
    "jpeg": jpeg,
    "lowres": lowres,
    "occlusion": occlusion,
    "overexpose": overexpose,
    "underexpose": underexpose,
}


def random_variant(rng: np.random.Generator) -> tuple[str, int]:
    """A random (degradation name, severity in 1..5)."""
    names = list(DEGRADATIONS)
    return names[int(rng.integers(len(names)))], int(rng.integers(1, 6))


def downscale(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    """A genuinely small face: the photo shrunk (area filter) and *not* brought back to its size."""
    f = [0.6, 0.45, 0.33, 0.25, 0.18][s - 1]
    h, w = img.shape[:2]
    return cv2.resize(img, (max(1, round(w * f)), max(1, round(h * f))), interpolation=cv2.INTER_AREA)


def mask(img: np.ndarray, s: int, rng: np.random.Generator, landmarks: np.ndarray) -> np.ndarray:
    """A flat-coloured mask over the lower face from the landmarks, its top from the mouth (1) to the eyes (5)."""
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    eyes, mouth = (lm[0] + lm[1]) / 2, (lm[3] + lm[4]) / 2
    iod = float(np.linalg.norm(lm[1] - lm[0]))
    down = (mouth - eyes) / max(1e-6, float(np.linalg.norm(mouth - eyes)))
    side = np.array([-down[1], down[0]])
    top_t = [0.9, 0.7, 0.5, 0.35, 0.2][s - 1]  # along eyes → mouth
    top = eyes + top_t * (mouth - eyes)
    chin = mouth + 0.9 * iod * down
    half = 1.05 * iod
    poly = np.array([top - half * side, top + half * side, chin + 0.8 * half * side, chin - 0.8 * half * side])
    out = img.copy()
    colour = tuple(int(v) for v in rng.integers(60, 230, 3))
    cv2.fillPoly(out, [np.round(poly).astype(np.int32)], colour)
    return out


def eyeband(img: np.ndarray, s: int, rng: np.random.Generator, landmarks: np.ndarray) -> np.ndarray:
    """Dark glasses or a hand across the eyes, from the landmarks: a flat band whose height grows with severity."""
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    iod = float(np.linalg.norm(lm[1] - lm[0]))
    h = [0.25, 0.35, 0.5, 0.65, 0.8][s - 1] * iod
    across = (lm[1] - lm[0]) / max(1e-6, iod)
    up = np.array([across[1], -across[0]])
    a, b = lm[0] - 0.55 * iod * across, lm[1] + 0.55 * iod * across
    poly = np.array([a + h / 2 * up, b + h / 2 * up, b - h / 2 * up, a - h / 2 * up])
    out = img.copy()
    cv2.fillPoly(out, [np.round(poly).astype(np.int32)], tuple(int(v) for v in rng.integers(0, 60, 3)))
    return out


#: the degraded side of P1's one-side-degraded pairs (severity 1-3)
P1_DEGS = (*DEGRADATIONS, "downscale", "mask", "eyeband")
#: the labelled reasons' strata (severity 1-5); "yaw" is a landmark-driven head-turn warp
REASON_DEGS = ("downscale", "blur", "underexpose", "overexpose", "mask", "eyeband", "yaw")


def yaw_warp(img: np.ndarray, s: int, rng: np.random.Generator, landmarks: np.ndarray) -> np.ndarray:
    """A head turn of 10-50°: the face as a vertical cylinder (radius 1.5 IOD) turned, the nose (0.6 IOD in
    front) moved further."""
    theta = np.radians([10, 20, 30, 40, 50][s - 1]) * (1 if rng.random() < 0.5 else -1)
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    iod = max(1.0, float(np.linalg.norm(lm[1] - lm[0])))
    xc = float(lm[[0, 1, 3, 4], 0].mean())
    r = 1.5 * iod
    h, w = img.shape[:2]
    xs, ys = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))
    u = np.clip((xs - xc) / r, -1.0, 1.0)
    phi = np.arcsin(u) - theta  # output angle → source angle
    inside = (np.abs(xs - xc) < r) & (np.abs(phi) < np.pi / 2)
    src_x = np.where(inside, xc + r * np.sin(np.clip(phi, -np.pi / 2, np.pi / 2)), xs)
    nose = lm[2]
    bump = np.exp(-((xs - nose[0] - 0.6 * iod * np.sin(theta)) ** 2 + (ys - nose[1]) ** 2) / (2 * (0.45 * iod) ** 2))
    src_x = src_x - 0.6 * iod * np.sin(theta) * bump
    out = cv2.remap(
        img, src_x.astype(np.float32), ys.astype(np.float32), cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE
    )
    return np.where(inside[..., None] | (bump[..., None] > 0.05), out, img)


#: Degradations drawn from the clean photo's landmarks: ``(image, severity, rng, landmarks (5, 2)) → image``.
FACE_DEGRADATIONS = {"mask": mask, "eyeband": eyeband, "yaw": yaw_warp}


def degrade(
    img: np.ndarray, name: str, s: int, rng: np.random.Generator, lm: np.ndarray | None = None
) -> np.ndarray | None:
    """One degradation by name (severity 0: ``img`` itself); ``None`` when it needs landmarks (``lm``, ``(5, 2)``)
    and has none."""
    if s == 0:
        return img
    if name in FACE_DEGRADATIONS:
        return None if lm is None else FACE_DEGRADATIONS[name](img, s, rng, lm)
    return downscale(img, s, rng) if name == "downscale" else DEGRADATIONS[name](img, s, rng)


def plan(path: str) -> list[tuple[str, int]]:
    """P1's variants of one photo: clean, one P1 degradation (severity 1-3), one reason degradation (1-5)."""
    r1, r2 = path_rng(path, 1), path_rng(path, 2)
    return [
        ("clean", 0),
        (P1_DEGS[int(r1.integers(len(P1_DEGS)))], int(r1.integers(1, 4))),
        (REASON_DEGS[int(r2.integers(len(REASON_DEGS)))], int(r2.integers(1, 6))),
    ]
