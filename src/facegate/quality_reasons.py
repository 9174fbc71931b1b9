"""Why a face is poor: causes a person can act on, each a measured value against a limit.

Computed from what the pipeline already has, with no extra model and no torch (front-end processes run it): the
landmarks (inter-ocular distance, yaw, pitch; with the photo's size, how much of the face lies outside the photo),
the aligned crop's statistics (sharpness, brightness, flat area), the detector score and the quality score.
docs/quality.md lists the reasons and how their limits were measured; ``Settings.quality`` holds the shipped limits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from facegate.config import QualitySettings
from facegate.pipeline.align import ARCFACE_TEMPLATE
from facegate.types import Detection, QualityReason, QualityVerdict

N_STATS = 3
#: The face region of a 112×112 ArcFace crop (rows, cols) whose statistics count: brows to chin, cheek to cheek.
FACE_ROWS = slice(24, 108)
FACE_COLS = slice(20, 92)
#: A block is flat when its grey-level spread is below ``FLAT_STD`` of the face region's (a mask is flat against the
#: face's own contrast; a dark photo's blocks are all dim). The worse of the eyes' strip (crop rows 36-68) and the
#: nose and mouth's (68-108) counts: glasses or a mask fill one, smooth skin is spread over both.
FLAT_BLOCK = 8
FLAT_STD = 0.06
FLAT_ROWS = slice(12, 84)
FLAT_EYE_BLOCKS = 4
#: Sharpness is the Laplacian's variance over the grey levels' variance (times this scale): a blurred face has
#: little high-frequency energy *for its contrast*, while a dark face has little of either.
SHARP_SCALE = 100.0
#: Depth of the nose tip in front of the eyes, in inter-ocular distances, and the nose's place between the eye
#: line and the mouth line on a frontal face (the ArcFace template), for the landmark pose estimate.
NOSE_DEPTH_IOD = 0.6
NOSE_FRONTAL_T = 0.495
EYE_MOUTH_PER_IOD = 40.6 / 35.2


def flat_fraction(grey: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """``(K,)`` share of flat blocks in the worse strip of ``grey``, the ``(K, 84, 72)`` float32 grey face regions
    whose spreads (standard deviations) are ``spread`` ``(K,)``; torch tensors work as well (the device path)."""
    k, w = grey.shape[0], grey.shape[2] // FLAT_BLOCK
    b = grey[:, FLAT_ROWS, : w * FLAT_BLOCK].reshape(k, -1, FLAT_BLOCK, w, FLAT_BLOCK)
    sd = ((b - b.mean(axis=(2, 4), keepdims=True)) ** 2).mean(axis=(2, 4)) ** 0.5
    flat = 1.0 * (sd < FLAT_STD * (spread[:, None, None] + 1.0))
    eyes, low = flat[:, :FLAT_EYE_BLOCKS].mean(axis=(1, 2)), flat[:, FLAT_EYE_BLOCKS:].mean(axis=(1, 2))
    return (eyes + low + abs(eyes - low)) / 2


def crop_stats(crops: np.ndarray) -> np.ndarray:
    """``(K, 3) float32`` per ``(K, 112, 112, 3) uint8`` RGB aligned crop: sharpness (``SHARP_SCALE`` × variance
    of the 4-neighbour Laplacian of the grey face region over the variance of its grey levels), its mean grey
    level (0–255), and its flat fraction (:func:`flat_fraction`)."""
    grey = crops[:, FACE_ROWS, FACE_COLS].astype(np.float32) @ np.asarray([0.299, 0.587, 0.114], np.float32)
    lap = grey[:, 1:-1, :-2] + grey[:, 1:-1, 2:] + grey[:, :-2, 1:-1] + grey[:, 2:, 1:-1] - 4.0 * grey[:, 1:-1, 1:-1]
    spread = grey.std(axis=(1, 2))
    flat = flat_fraction(grey, spread)
    sharp = SHARP_SCALE * lap.var(axis=(1, 2)) / (spread**2 + 1.0)
    return np.stack([sharp, grey.mean(axis=(1, 2)), flat], axis=1).astype(np.float32)


def landmark_geometry(landmarks: np.ndarray) -> tuple[float, float, float]:
    """``(iod_px, yaw_deg, pitch_deg)`` from ``(5, 2)`` landmarks in source pixels (order in :mod:`facegate.types`).

    Yaw: the nose tip's signed offset from the eye-mouth axis (``NOSE_DEPTH_IOD · sin(yaw)``) over the projected
    inter-ocular distance (``cos(yaw)``, foreshortened alike, unlike the eye-mouth height), i.e.
    ``NOSE_DEPTH_IOD · tan(yaw)``. Pitch: the nose's place between the eye line and the mouth line against a frontal
    face's. Both are coarse (a few degrees near frontal): enough to tell a person to face the camera.
    """
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    eyes = (lm[0] + lm[1]) / 2.0
    mouth = (lm[3] + lm[4]) / 2.0
    iod = float(np.linalg.norm(lm[1] - lm[0]))
    axis = mouth - eyes
    height = float(np.linalg.norm(axis))
    if iod < 1e-6 or height < 1e-6:
        return iod, 0.0, 0.0
    u = axis / height
    rel = lm[2] - eyes
    across = float(u[0] * rel[1] - u[1] * rel[0])  # signed distance of the nose from the eye-mouth line
    along = float(np.dot(rel, u)) / height
    yaw = math.degrees(math.atan2(-across / iod, NOSE_DEPTH_IOD))
    pitch_ratio = (along - NOSE_FRONTAL_T) * EYE_MOUTH_PER_IOD / NOSE_DEPTH_IOD
    return iod, yaw, math.degrees(math.asin(max(-1.0, min(1.0, pitch_ratio))))


#: Sample points per side of the aligned crop's face region (:data:`FACE_ROWS`, :data:`FACE_COLS`).
REGION_GRID = 16
_TEMPLATE_Z = ARCFACE_TEMPLATE.astype(np.float64) @ np.array([1.0, 1j])


def similarity_fit(landmarks: np.ndarray) -> tuple[complex, complex, np.ndarray]:
    """Alignment's least-squares similarity taking ``(5, 2)`` source landmarks onto the ArcFace template, as complex
    ``z ↦ a·z + b``, and the residuals ``(5,) complex`` in crop pixels: the closed form of
    :func:`facegate.pipeline.align.similarity_matrices` for one face, in complex numbers."""
    z = np.asarray(landmarks, np.float64).reshape(5, 2) @ np.array([1.0, 1j])
    zc, wc = z - z.mean(), _TEMPLATE_Z - _TEMPLATE_Z.mean()
    den = float(np.sum(np.abs(zc) ** 2))
    a = complex(np.sum(np.conj(zc) * wc) / den) if den > 1e-12 else 0j
    b = complex(_TEMPLATE_Z.mean() - a * z.mean())
    return a, b, a * z + b - _TEMPLATE_Z


def face_outside_box(landmarks: np.ndarray, box: np.ndarray) -> float:
    """Share (0-1) of the face region the ``(5, 2)`` landmarks imply (the crop's face region mapped back to source
    pixels) outside ``box`` ``(4,)`` (x0, y0, x1, y1), from a :data:`REGION_GRID`² grid of points."""
    a, b, _ = similarity_fit(landmarks)
    if a == 0:
        return 1.0
    x0, y0, x1, y1 = FACE_COLS.start, FACE_ROWS.start, FACE_COLS.stop, FACE_ROWS.stop
    bx = np.asarray(box, np.float64).reshape(4)

    def outside(src: np.ndarray) -> np.ndarray:
        return (src.real < bx[0]) | (src.real > bx[2]) | (src.imag < bx[1]) | (src.imag > bx[3])

    # the region maps to a parallelogram: with its four corners inside the box all of it is (most faces)
    if not outside((np.array([x0 + 1j * y0, x1 + 1j * y0, x0 + 1j * y1, x1 + 1j * y1]) - b) / a).any():
        return 0.0
    u = (np.arange(REGION_GRID) + 0.5) / REGION_GRID
    crop = (x0 + u * (x1 - x0))[None, :] + 1j * (y0 + u * (y1 - y0))[:, None]
    return float(outside((crop - b) / a).mean())


def face_outside_photo(detection: Detection) -> float:
    """Share (0-1) of the detection's face region outside its photo (:func:`face_outside_box` with the frame
    ``(0, 0, width, height)``); 0 when the photo's size is unknown."""
    if detection.photo_wh is None:
        return 0.0
    w, h = detection.photo_wh
    return face_outside_box(detection.landmarks, np.array([0.0, 0.0, w, h]))


def face_reasons(
    detection: Detection | None,
    stats: np.ndarray | None,
    score: float,
    gate: float,
    limits: QualitySettings,
) -> tuple[QualityReason, ...]:
    """Every limit this face misses, most actionable first. ``detection``: None for an aligned crop (no geometry,
    no detector score); ``stats``: its ``(3,)`` row of :func:`crop_stats`, None when the crop was not seen;
    ``score``: calibrated quality in ``[0, 1]``, held to ``gate``; ``limits``: the reasons' limits (``Settings.quality``
    documents each, with its unit)."""
    out: list[QualityReason] = []

    def miss(code: str, message: str, value: float, limit: float, *, digits: int = 0, scale: float = 1.0) -> None:
        """``message``'s two ``{}`` get ``scale`` × the value and the limit, :func:`shown` at ``digits``."""
        text = message.format(*shown(scale * value, scale * limit, digits))
        out.append(QualityReason(code, text, float(value), float(limit)))

    if detection is not None:
        iod, yaw, pitch = landmark_geometry(detection.landmarks)
        if iod < (lim := limits.min_iod_px):
            miss("too_small", "face too small ({} px between the eyes, {} needed)", iod, lim)
        for what, angle, v, most in (
            ("turned aside", "yaw", abs(yaw), limits.max_yaw_deg),
            ("tilted", "pitch", abs(pitch), limits.max_pitch_deg),
        ):
            if v > most:
                miss("pose", f"face {what} ({{}}° {angle}, at most {{}}°): face the camera", v, most)
    if stats is not None:
        sharp, luma, flat = (float(v) for v in stats[:N_STATS])
        lo, hi = limits.min_luma, limits.max_luma
        if luma < lo:
            miss("too_dark", "face too dark (brightness {}, {} needed)", luma, lo)
        elif luma > hi:
            miss("too_bright", "face too bright (brightness {}, at most {})", luma, hi)
        # clipped highlights or shadows are flat too: there the exposure says why
        if flat > (lim := limits.max_flat) and lo <= luma <= hi:
            pct = "{} % of the eyes or of the nose and mouth hidden, at most {} %"
            miss("occluded", f"face covered ({pct}): remove masks, hands or glasses", flat, lim, scale=100)
        if sharp < (lim := limits.min_sharpness):
            miss("blur", "face blurred (sharpness {}, {} needed): hold still, focus", sharp, lim)
    if detection is not None:
        outside = face_outside_photo(detection)
        if outside > (lim := limits.max_outside_photo):
            cut = "face partly outside the photo ({} % of it outside, at most {} %): show the whole face"
            miss("low_confidence", cut, outside, lim, scale=100)
        elif detection.score < (lim := limits.min_det_score):
            how = "face hard to find (detector confidence {}, {} needed): show the whole face, in focus"
            miss("low_confidence", how, detection.score, lim, digits=3)
    if not score >= gate:  # NaN included: a refusal always has a reason
        why = "quality {} is below the gate {} (the face is unlike those the model knows)"
        miss("out_of_distribution", why, score, gate, digits=2)
    return tuple(out)


def shown(value: float, limit: float, digits: int = 0) -> tuple[str, str]:
    """``value`` and ``limit`` at ``digits`` decimals, or at more until they differ: a refusal must not read
    "sharpness 1, 1 needed"."""
    for d in range(digits, digits + 4):
        a, b = f"{value:.{d}f}", f"{limit:.{d}f}"
        if a != b:
            break
    return a, b


#: The enrolment gate measured on LFW (``benchmarks/quality_p1.py``, ``docs/quality.md``): the largest quality that
#: refuses at most 2 % of clean faces.
ENROL_GATE = 0.87


def enrol_gate(verify_gate: float, setting: float | None) -> float:
    """The enrolment gate in force: the setting, else :data:`ENROL_GATE` when a verify gate is in force (a model
    without a meaningful quality runs with gate 0, and then no stricter gate either); never below the verify gate."""
    if setting is not None:
        return max(float(setting), verify_gate)
    return max(ENROL_GATE, verify_gate) if verify_gate > 0 else verify_gate


#: Per-comparison reliability weights shipped for a model (``benchmarks/quality_p1.py`` writes them).
RELIABILITY_FILES = {"sface": Path(__file__).parent / "models" / "heads" / "sface_reliability_v1.json"}
RELIABILITY_FEATURES = ("bias", "verdict_margin", "margin", "logit_qmin", "logit_qmax", "verdict_logit_qmin")
_Q_EPS = 1e-4


def reliability_features(qa: np.ndarray, qb: np.ndarray, sim: np.ndarray, threshold: float) -> np.ndarray:
    """``(P, 6) float64`` inputs of the reliability model, in the order of :data:`RELIABILITY_FEATURES`:
    ``1, m·d, d, logit q_min, logit q_max, m·logit q_min`` with ``d = similarity − threshold`` and ``m = ±1`` the
    verdict (match / no match)."""
    qa, qb, sim = (np.atleast_1d(np.asarray(v, np.float64)) for v in (qa, qb, sim))
    lo, hi = (np.clip(pick(qa, qb), _Q_EPS, 1 - _Q_EPS) for pick in (np.minimum, np.maximum))
    d = sim - threshold
    m = np.where(d >= 0, 1.0, -1.0)
    llo, lhi = np.log(lo / (1 - lo)), np.log(hi / (1 - hi))
    return np.stack([np.ones_like(d), m * d, d, llo, lhi, m * llo], axis=1)


@dataclass(frozen=True)
class ReliabilityModel:
    """Logistic weights ``(6,)`` over :func:`reliability_features`, then an isotonic map (knots ``x``, ``y``, both
    ``(K,)`` increasing) that makes the probability calibrated on held-out folds."""

    weights: np.ndarray
    knots_x: np.ndarray
    knots_y: np.ndarray


def load_reliability(model: str) -> ReliabilityModel | None:
    """The shipped reliability model of ``model``, or ``None`` when it has none."""
    path = RELIABILITY_FILES.get(model)
    if path is None or not path.is_file():
        return None
    obj = json.loads(path.read_text())
    if obj.get("features") != list(RELIABILITY_FEATURES):
        raise ValueError(f"{path}: reliability features {obj.get('features')} are not {list(RELIABILITY_FEATURES)}")
    knots = obj.get("isotonic", {"x": [0.0, 1.0], "y": [0.0, 1.0]})
    return ReliabilityModel(*(np.asarray(v, np.float64) for v in (obj["weights"], knots["x"], knots["y"])))


def reliability(qa: float, qb: float, sim: float, threshold: float, model: ReliabilityModel) -> float:
    """Calibrated probability that the verdict ``sim >= threshold`` is right, given both faces' qualities."""
    z = float(reliability_features(qa, qb, sim, threshold)[0] @ model.weights)
    p = 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, z))))
    return float(np.interp(p, model.knots_x, model.knots_y))


def refusal_message(reasons: tuple[QualityReason, ...]) -> str:
    """``"retake: <reason>; <reason>"``: what a refused person reads."""
    return "retake: " + "; ".join(r.message for r in reasons)


def quality_verdict(
    score: float,
    raw: float,
    threshold: float,
    reasons: tuple[QualityReason, ...],
    *,
    refuse_on_reasons: bool = True,
) -> QualityVerdict:
    """The gate: accept when ``score >= threshold`` (and, with ``refuse_on_reasons``, no reason was found), else
    refuse with a 'retake' message that names the ``reasons`` (:func:`face_reasons` at gate ``threshold``)."""
    accepted = bool(score >= threshold) and not (refuse_on_reasons and reasons)
    reason = None if accepted else refusal_message(reasons)
    return QualityVerdict(float(score), float(raw), float(threshold), accepted, reason, reasons)


def enrol_verdict(q: QualityVerdict, gate: float) -> QualityVerdict:
    """``q`` at the enrolment gate: ``q`` itself when it passes, else a refusal that names the enrolment gate (unless
    the quality gate's reason already says the score is too low) and the face's other reasons."""
    if q.accepted and q.score >= gate:
        return q
    reasons = q.reasons
    if q.score < gate and not any(r.code == "out_of_distribution" for r in q.reasons):
        below = "quality {} is below the enrolment gate {}".format(*shown(q.score, gate, 2))
        reasons = (*q.reasons, QualityReason("below_enrol_gate", below, q.score, gate))
    return QualityVerdict(q.score, q.raw, gate, False, refusal_message(reasons), reasons)
