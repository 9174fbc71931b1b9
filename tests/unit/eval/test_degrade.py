"""Synthetic degradations: deterministic, and worse as the severity grows."""

from __future__ import annotations

import itertools

import cv2
import numpy as np
import pytest

from facegate.eval.degrade import DEGRADATIONS, SEVERITIES, degrade, random_variant
from facegate.eval.features import plan_variants


def _image() -> np.ndarray:
    rng = np.random.default_rng(1)
    img = cv2.resize(rng.integers(0, 255, (25, 25, 3), dtype=np.uint8), (250, 250), interpolation=cv2.INTER_CUBIC)
    return np.ascontiguousarray(img)


@pytest.mark.parametrize("name", sorted(DEGRADATIONS))
def test_every_degradation_changes_the_image_more_with_severity(name: str) -> None:
    img = _image()
    diffs = []
    for s in SEVERITIES:
        out = degrade(img, name, s, np.random.default_rng(0))
        assert out.shape == img.shape and out.dtype == np.uint8
        diffs.append(float(np.abs(out.astype(float) - img).mean()))
    assert diffs[0] > 0
    assert diffs[-1] > diffs[0]
    assert degrade(img, name, 0, np.random.default_rng(0)) is img


def test_blur_loses_sharpness_monotonically() -> None:
    img = _image()
    sharp = [cv2.Laplacian(degrade(img, "blur", s, np.random.default_rng(0)), cv2.CV_64F).var() for s in SEVERITIES]
    assert all(a > b for a, b in itertools.pairwise(sharp)), sharp


@pytest.mark.parametrize("name", ["blur", "lowres", "noise", "overexpose", "underexpose"])
def test_distance_from_original_grows_monotonically(name: str) -> None:
    img = _image()
    d = [float(np.abs(degrade(img, name, s, np.random.default_rng(0)).astype(float) - img).mean()) for s in SEVERITIES]
    assert all(a < b for a, b in itertools.pairwise(d)), (name, d)


def test_deterministic_and_random_variant() -> None:
    img = _image()
    a = degrade(img, "noise", 3, np.random.default_rng(7))
    b = degrade(img, "noise", 3, np.random.default_rng(7))
    assert np.array_equal(a, b)
    name, sev = random_variant(np.random.default_rng(0))
    assert name in DEGRADATIONS and sev in SEVERITIES


def test_a_plan_row_belongs_to_the_path_in_the_same_place() -> None:
    paths = ["b/b_0001.jpg", "a/a_0001.jpg", "c/c_0001.jpg"]
    plan = plan_variants(paths, n_random=2, progressive_every=2)
    alone = [plan_variants([p], n_random=2, progressive_every=1)[0] for p in paths]
    assert plan[0] == alone[0] and plan[1] == alone[1][:3] and plan[2] == alone[2]  # every 2nd: 0 and 2
