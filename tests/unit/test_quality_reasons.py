"""Quality reasons: each cause fires on the degradation it names, from landmarks and crop statistics."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from facegate.config import QualitySettings, Settings
from facegate.io.decode import decode_image
from facegate.pipeline.align import ARCFACE_TEMPLATE
from facegate.pipeline.photo import crop_stats_torch
from facegate.pipeline.pipeline import FacePipeline, quality_verdict
from facegate.quality_reasons import (
    crop_stats,
    face_outside_box,
    face_outside_photo,
    face_reasons,
    landmark_geometry,
)
from facegate.types import Detection

LIMITS = QualitySettings()


def _det(landmarks: np.ndarray, score: float = 0.9) -> Detection:
    return Detection(box=np.array([0, 0, 112, 112], np.float32), landmarks=landmarks.astype(np.float32), score=score)


def test_geometry_of_the_template_and_of_a_turned_face() -> None:
    iod, yaw, pitch = landmark_geometry(ARCFACE_TEMPLATE)
    assert iod == pytest.approx(35.24, abs=0.05) and abs(yaw) < 0.5 and abs(pitch) < 0.5
    turned = ARCFACE_TEMPLATE.copy()
    turned[2, 0] += 0.6 * 35.24  # nose tip one depth unit aside: tan(yaw) = 1
    assert abs(landmark_geometry(turned)[1]) == pytest.approx(45.0, abs=1.0)
    big = ARCFACE_TEMPLATE * 3.0
    assert landmark_geometry(big)[0] == pytest.approx(3 * 35.24, abs=0.1)


@pytest.mark.parametrize("deg", [-75, -50, -20, 0, 30, 60, 80])
def test_yaw_of_a_rigid_face_turned_by_a_known_angle(deg: float) -> None:
    # the template's landmarks on a rigid face (eyes and mouth at one depth, the nose NOSE_DEPTH_IOD in front),
    # turned about a vertical axis and projected: the estimate reads the turn, past 45° too, whatever the scale
    iod = 35.24
    z = np.array([0.0, 0.0, 0.6 * iod, 0.0, 0.0])
    for roll in (0.0, 20.0):
        th, ro = np.radians(deg), np.radians(roll)
        pts = ARCFACE_TEMPLATE.astype(np.float64) - ARCFACE_TEMPLATE.mean(axis=0)
        turned = np.stack([pts[:, 0] * np.cos(th) + z * np.sin(th), pts[:, 1]], axis=1)
        rot = np.array([[np.cos(ro), -np.sin(ro)], [np.sin(ro), np.cos(ro)]])
        lm = 2.5 * turned @ rot.T + 200.0
        assert landmark_geometry(lm)[1] == pytest.approx(deg, abs=0.5)  # the nose moved to +x: positive


def test_each_reason_names_its_value_and_limit() -> None:
    small = _det(ARCFACE_TEMPLATE * 0.25)  # 9 px between the eyes
    r = face_reasons(small, None, 0.9, 0.5, LIMITS)
    assert [x.code for x in r] == ["too_small"]
    assert r[0].message == f"face too small (9 px between the eyes, {LIMITS.min_iod_px:.0f} needed)"
    assert r[0].value == pytest.approx(8.81, abs=0.1) and r[0].threshold == LIMITS.min_iod_px
    r = face_reasons(_det(ARCFACE_TEMPLATE, score=0.4), None, 0.3, 0.5, LIMITS)
    assert [x.code for x in r] == ["low_confidence", "out_of_distribution"]
    dark = np.array([8.0, 12.0, 0.0], np.float32)
    bright = np.array([8.0, 240.0, 0.0], np.float32)
    covered = np.array([8.0, 120.0, 0.6], np.float32)
    blurred = np.array([0.2, 120.0, 0.0], np.float32)
    assert [x.code for x in face_reasons(None, dark, 0.9, 0.5, LIMITS)] == ["too_dark"]
    assert [x.code for x in face_reasons(None, bright, 0.9, 0.5, LIMITS)] == ["too_bright"]
    assert [x.code for x in face_reasons(None, covered, 0.9, 0.5, LIMITS)] == ["occluded"]
    assert [x.code for x in face_reasons(None, blurred, 0.9, 0.5, LIMITS)] == ["blur"]
    # clipped highlights are flat as well: the exposure is named, not an occlusion
    assert [x.code for x in face_reasons(None, np.array([8.0, 240.0, 0.6]), 0.9, 0.5, LIMITS)] == ["too_bright"]
    assert face_reasons(_det(ARCFACE_TEMPLATE * 2), np.array([8.0, 120.0, 0.0]), 0.9, 0.5, LIMITS) == ()


def test_a_value_near_its_limit_is_shown_apart_from_it() -> None:
    """Rounded alike, "sharpness 1, 1 needed" would tell a person nothing: more digits until they differ."""
    assert LIMITS.min_sharpness == 0.8
    (r,) = face_reasons(None, np.array([0.675, 120.0, 0.0], np.float32), 0.9, 0.5, LIMITS)
    assert "(sharpness 0.7, 0.8 needed)" in r.message
    (r,) = face_reasons(None, None, 0.4996, 0.5, LIMITS)
    assert r.message.startswith("quality 0.4996 is below the gate 0.5000")
    low = face_reasons(None, None, 0.3, 0.5, LIMITS)
    assert "0.30 is below the gate 0.50" in quality_verdict(0.3, 1.0, 0.5, low).reason
    (nan,) = face_reasons(None, None, float("nan"), 0.5, LIMITS)  # no number: refused, with its reason
    assert nan.code == "out_of_distribution" and not quality_verdict(nan.value, 1.0, 0.5, (nan,)).accepted


def test_a_refusal_names_its_reasons_and_reasons_can_be_advisory() -> None:
    r = face_reasons(_det(ARCFACE_TEMPLATE * 0.25), None, 0.9, 0.5, LIMITS)
    v = quality_verdict(0.9, 11.0, 0.5, r)
    assert (
        not v.accepted and v.reason == f"retake: face too small (9 px between the eyes, {LIMITS.min_iod_px:.0f} needed)"
    )
    assert v.to_dict()["reasons"] == [
        {"code": "too_small", "message": r[0].message, "value": round(r[0].value, 4), "threshold": LIMITS.min_iod_px}
    ]
    advisory = quality_verdict(0.9, 11.0, 0.5, r, refuse_on_reasons=False)
    assert advisory.accepted and advisory.reason is None and advisory.reasons == r
    low = face_reasons(None, None, 0.2, 0.5, LIMITS)
    why = "retake: quality 0.20 is below the gate 0.50 (the face is unlike those the model knows)"
    assert quality_verdict(0.2, 5.0, 0.5, low).reason == why


@pytest.mark.parametrize("doc", ["README.md", "docs/quality.md"])
def test_the_documented_refusal_is_what_the_default_limits_answer(doc: str) -> None:
    """The refusal the docs quote for a 9-px face names the default limit (README said 14 after it became 15)."""
    import re

    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    (quoted,) = re.findall(r"`(retake: face too small \(9 px between the eyes, \d+ needed\))`", text)
    r = face_reasons(_det(ARCFACE_TEMPLATE * 0.25), None, 0.9, 0.5, LIMITS)
    assert quality_verdict(0.9, 11.0, 0.5, r).reason == quoted


def test_crop_stats_on_the_host_and_on_the_device_agree(lfw_root: Path) -> None:
    img = cv2.cvtColor(cv2.imread(str(lfw_root / "lfw-deepfunneled/Colin_Powell/Colin_Powell_0001.jpg")), 4)
    crop = np.ascontiguousarray(cv2.resize(img[60:190, 60:190], (112, 112)))
    crops = np.stack([crop, cv2.GaussianBlur(crop, (0, 0), 3.0), (crop * 0.1).astype(np.uint8), crop, crop])
    crops[3, 60:108, 20:92] = 128  # a flat mask over the lower face
    crops[4, 42:62, 16:96] = 20  # dark glasses: a band over the eyes, a quarter of the face region
    host = crop_stats(crops)
    dev = crop_stats_torch(torch.from_numpy(crops)).numpy()
    np.testing.assert_allclose(dev, host, rtol=1e-4, atol=1e-3)
    sharp, luma, flat = host.T
    assert sharp[1] < sharp[0] / 5 and luma[2] < 0.15 * luma[0] and flat[3] > flat[0] + 0.4
    # the worse strip counts: the band fills half of the eyes' strip, past the shipped limit
    assert flat[4] > LIMITS.max_flat > flat[0]


def test_enrolment_gate_and_reliability() -> None:
    from facegate.quality_reasons import ENROL_GATE, enrol_gate, load_reliability, reliability

    assert enrol_gate(0.5, None) == ENROL_GATE > 0.5 and enrol_gate(0.0, None) == 0.0
    assert enrol_gate(0.5, 0.3) == 0.5 and enrol_gate(0.5, 0.9) == 0.9
    w = load_reliability("sface")
    assert w is not None and load_reliability("no-such-model") is None
    thr = 0.3582
    sure = reliability(0.95, 0.95, 0.8, thr, w)
    near = reliability(0.95, 0.95, thr + 0.01, thr, w)
    poor = reliability(0.1, 0.95, 0.2, thr, w)  # a no-match of a poor face is less certain than one of good faces
    good = reliability(0.95, 0.95, 0.2, thr, w)
    assert 0.9 < sure <= 1.0 and near < sure and poor < good


def test_enrol_verdict_names_the_enrolment_gate() -> None:
    from facegate.quality_reasons import enrol_verdict

    passed = quality_verdict(0.8, 1.0, 0.5, ())
    assert enrol_verdict(passed, 0.7) is passed
    below = enrol_verdict(passed, 0.87)  # passes the verify gate, not the enrolment gate
    assert not below.accepted and below.threshold == 0.87 and [r.code for r in below.reasons] == ["below_enrol_gate"]
    assert below.reason == "retake: quality 0.80 is below the enrolment gate 0.87"
    ood = face_reasons(None, None, 0.3, 0.5, LIMITS)  # already below the verify gate: that reason says it
    low = enrol_verdict(quality_verdict(0.3, 1.0, 0.5, ood), 0.87)
    assert not low.accepted and low.reasons == ood


def _similar(points: np.ndarray, scale: float, deg: float, shift: tuple[float, float]) -> np.ndarray:
    th = np.radians(deg)
    rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    return scale * np.asarray(points, np.float64) @ rot.T + np.asarray(shift)


def test_face_outside_the_photo() -> None:
    # the template face at 2× in a 400×400 photo: its region (crop columns 20-92, rows 24-108) lies inside
    lm = _similar(ARCFACE_TEMPLATE, 2.0, 0.0, (100.0, 100.0))
    box = np.array([100.0, 100.0, 324.0, 324.0], np.float32)
    whole = Detection(box=box, landmarks=lm.astype(np.float32), score=0.93, photo_wh=(400, 400))
    assert face_outside_photo(whole) == 0.0
    # the photo's right edge through the middle of the region (crop column 56 → x = 212): half of it outside
    cut = Detection(box=box, landmarks=lm.astype(np.float32), score=0.93, photo_wh=(212, 400))
    assert face_outside_photo(cut) == pytest.approx(0.5, abs=0.01)
    # and its top edge at crop row 66 (y = 232, half the rows), measured as a box: a quarter left inside
    assert face_outside_box(lm, np.array([0.0, 232.0, 212.0, 400.0])) == pytest.approx(0.75, abs=0.01)
    # a rotated face: the share does not depend on the face's roll when the frame is far away
    rolled = _similar(ARCFACE_TEMPLATE, 2.0, 30.0, (150.0, 80.0))
    assert face_outside_box(rolled, np.array([0.0, 0.0, 1000.0, 1000.0])) == 0.0
    # no photo size (a detection built by hand): nothing is measured
    assert face_outside_photo(Detection(box=box, landmarks=lm.astype(np.float32), score=0.93)) == 0.0


def test_low_confidence_names_a_face_partly_outside_the_photo_or_hard_to_find() -> None:
    lm = _similar(ARCFACE_TEMPLATE, 2.0, 0.0, (100.0, 100.0)).astype(np.float32)
    box = np.array([100.0, 100.0, 224.0, 324.0], np.float32)
    lim = LIMITS.max_outside_photo
    cut = Detection(box=box, landmarks=lm, score=0.93, photo_wh=(224, 400))  # the frame at crop column 62
    (r,) = face_reasons(cut, None, 0.9, 0.5, LIMITS)
    assert r.code == "low_confidence" and r.value > lim and r.threshold == lim
    want = f"face partly outside the photo ({100 * r.value:.0f} % of it outside, at most {100 * lim:.0f} %)"
    assert r.message == want + ": show the whole face"
    # the frame is named before the detector's confidence, which it lowers
    low_cut = Detection(box=box, landmarks=lm, score=LIMITS.min_det_score - 0.1, photo_wh=(224, 400))
    assert [x.message for x in face_reasons(low_cut, None, 0.9, 0.5, LIMITS)] == [r.message]
    whole = Detection(box=box, landmarks=lm, score=0.93, photo_wh=(400, 400))
    assert face_reasons(whole, None, 0.9, 0.5, LIMITS) == ()
    unsure = Detection(box=box, landmarks=lm, score=LIMITS.min_det_score - 0.01, photo_wh=(400, 400))
    (r,) = face_reasons(unsure, None, 0.9, 0.5, LIMITS)
    assert r.code == "low_confidence" and r.threshold == LIMITS.min_det_score
    assert r.message.startswith("face hard to find (detector confidence ") and r.message.endswith("in focus")
    # the limits are the settings'; the detector-score part is off by default (the detector's own threshold)
    assert LIMITS.min_det_score == QualitySettings().min_det_score == Settings().detector.score_threshold


def test_a_real_face_cut_by_the_frame_is_partly_outside_the_photo(lfw_root: Path) -> None:
    pipe = FacePipeline.from_settings(Settings(device="cpu"))
    data = (lfw_root / "lfw-deepfunneled/Colin_Powell/Colin_Powell_0001.jpg").read_bytes()
    img = decode_image(data, max_bytes=1 << 24, max_pixels=1 << 24)
    (face,) = pipe.faces([img])[0]
    assert face.detection is not None and face.detection.photo_wh == (img.shape[1], img.shape[0])
    assert "low_confidence" not in [x.code for x in face.quality.reasons]
    x0, x1 = face.detection.box[0], face.detection.box[2]
    # 40 % of the face box's width cut off on the right: the detector still finds the face, with its landmarks
    # extrapolated past the frame
    cut = np.ascontiguousarray(img[:, : int(np.rint(x1 - 0.4 * (x1 - x0)))])
    (face,) = pipe.faces([cut])[0]
    assert face.detection is not None and face.detection.photo_wh == (cut.shape[1], cut.shape[0])
    r = [x for x in face.quality.reasons if x.code == "low_confidence"]
    assert r and r[0].message.startswith("face partly outside the photo") and not face.quality.accepted


def test_settings_hold_the_limits() -> None:
    s = Settings(quality=QualitySettings(min_iod_px=40.0))
    frontal = _det(ARCFACE_TEMPLATE)  # 35 px between the eyes
    assert [r.code for r in face_reasons(frontal, None, 0.9, 0.5, s.quality)] == ["too_small"]
    assert face_reasons(frontal, None, 0.9, 0.5, LIMITS) == ()
