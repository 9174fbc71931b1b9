"""facegate: face recognition with a built-in quality gate."""

from __future__ import annotations

from facegate.config import Settings
from facegate.errors import FacegateError
from facegate.types import CompareResult, Detection, Face, FaceSelect, QualityVerdict

__version__ = "0.1.0"

__all__ = [
    "CompareResult",
    "Detection",
    "Face",
    "FaceSelect",
    "FacegateError",
    "QualityVerdict",
    "Settings",
    "__version__",
]
