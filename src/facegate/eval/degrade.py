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
    return np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed}:{path}:{k}".encode()).digest()[:8], "little"))


def blur(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    return cv2.GaussianBlur(img, (0, 0), sigmaX=[0.8, 1.5, 2.5, 3.5, 5.0][s - 1])


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


DEGRADATIONS: dict[str, Degradation] = {
    "blur": blur,
    "noise": noise,
    "jpeg": jpeg,
    "lowres": lowres,
    "occlusion": occlusion,
    "overexpose": _gain([1.5, 2.0, 2.6, 3.3, 4.2]),
    "underexpose": _gain([0.5, 0.32, 0.2, 0.12, 0.07]),
}


def random_variant(rng: np.random.Generator) -> tuple[str, int]:
    """A random (degradation name, severity in 1..5)."""
    names = list(DEGRADATIONS)
    return names[int(rng.integers(len(names)))], int(rng.integers(1, 6))


def degrade(img: np.ndarray, name: str, s: int, rng: np.random.Generator) -> np.ndarray:
    """One photo degradation of :data:`DEGRADATIONS` by name (severity 0: ``img`` itself)."""
    return img if s == 0 else DEGRADATIONS[name](img, s, rng)
