"""ONNX export: a dynamic-batch file that ONNX Runtime reproduces (CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from facegate.models.onnx_backend import export_onnx
from facegate.models.recognizer import build_recognizer
from facegate.models.registry import IRSE64_RTS, SFACE, WeightsSource

pytest.importorskip("onnxruntime")


def test_export_sface_matches_onnxruntime(tmp_path: Path) -> None:
    rep = export_onnx(build_recognizer(SFACE), tmp_path / "sface.onnx")
    assert rep["verify_batch"] != 2  # checked on a batch size other than the traced one: the axis is dynamic
    assert rep["embedding_cosine_min"] >= 0.99999
    assert rep["quality_max_abs_diff"] <= 1e-4
    assert (tmp_path / "sface.onnx").stat().st_size > 1_000_000


def test_export_irse_tiny(tmp_path: Path) -> None:
    rep = export_onnx(
        build_recognizer(dataclasses.replace(IRSE64_RTS, weights=WeightsSource("random"))), tmp_path / "irse.onnx"
    )
    assert rep["embedding_cosine_min"] >= 0.99999
    assert rep["quality_max_abs_diff"] <= 1e-4
