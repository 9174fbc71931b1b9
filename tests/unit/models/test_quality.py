"""Quality calibration maps, their NumPy fit, the RTS head and the versioned head file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from facegate.errors import InvalidParameterError, ModelError
from facegate.models.quality import (
    QualityCalibration,
    QualityHeadError,
    RTSQualityHead,
    fit_logistic,
    load_head,
    save_head,
)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# --------------------------------------------------------------------------- QualityCalibration
def test_logistic_matches_formula_and_is_monotone() -> None:
    raw = torch.linspace(0.01, 5.0, 200)
    up = QualityCalibration("logistic", direction=1, transform="log", a=2.0, b=-0.5)
    q = up(raw)
    assert q.dtype == torch.float32 and q.shape == (200,)
    np.testing.assert_allclose(q.numpy(), _sigmoid(2.0 * np.log(raw.numpy()) - 0.5), rtol=1e-5, atol=1e-6)
    assert bool((q[1:] >= q[:-1]).all()) and q[-1] > q[0]
    down = QualityCalibration("logistic", direction=-1, a=-3.0, b=1.0)
    qd = down(raw)
    assert bool((qd[1:] <= qd[:-1]).all()) and qd[-1] < qd[0]
    assert float(qd.min()) >= 0.0 and float(qd.max()) <= 1.0


def test_nan_raw_gives_zero_and_bf16_input_works() -> None:
    cal = QualityCalibration("logistic", direction=1, a=1.0, b=0.0)
    q = cal(torch.tensor([float("nan"), 0.0], dtype=torch.bfloat16))
    assert q.dtype == torch.float32 and q.tolist() == [0.0, 0.5]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "logistic", "direction": 1, "a": -1.0},  # slope disagrees with direction
        {"kind": "logistic", "direction": 2},
        {"kind": "logistic", "direction": 1, "a": float("inf")},
        {"kind": "logistic", "direction": 1, "transform": "sqrt"},
        {"kind": "piecewise_linear", "direction": 1},
        {"kind": "cubic", "direction": 1},
    ],
)
def test_invalid_calibrations_are_refused(kwargs: dict) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(InvalidParameterError):
        QualityCalibration(kind, **kwargs)


def test_to_dict_from_dict_round_trip_is_json() -> None:
    raw = torch.linspace(0.01, 4, 64)
    cal = QualityCalibration("logistic", direction=-1, transform="log", a=-0.7, b=0.2, fitted=True, note="x")
    back = QualityCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back.to_dict() == cal.to_dict()
    assert torch.equal(back(raw), cal(raw))
    with pytest.raises(InvalidParameterError):
        QualityCalibration.from_dict({"kind": "logistic"})


def test_calibration_traces_without_graph_breaks() -> None:
    """fullgraph=True fails on any graph break (e.g. a host sync such as .item())."""
    torch._dynamo.reset()
    raw = torch.rand(16) * 3
    cal = QualityCalibration("logistic", direction=-1, transform="log", a=-1.0, b=0.0)
    compiled = torch.compile(cal, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(raw), cal(raw))


# --------------------------------------------------------------------------- fits
@pytest.mark.parametrize("slope", [2.0, -1.5])
def test_logistic_fit_recovers_slope(slope: float) -> None:
    rng = np.random.default_rng(2)
    raw = rng.normal(0, 2, 20_000)
    y = (rng.uniform(size=raw.size) < _sigmoid(slope * raw + 0.5)).astype(float)
    cal = fit_logistic(raw, y)
    assert cal.direction == int(np.sign(slope)) and cal.fitted
    assert float(cal.a) == pytest.approx(slope, rel=0.1)
    assert float(cal.b) == pytest.approx(0.5, abs=0.1)


def test_logistic_fit_log_transform_uncertainty() -> None:
    rng = np.random.default_rng(3)
    sigma2 = np.exp(rng.normal(0, 1, 10_000))  # an uncertainty: higher is worse
    y = (rng.uniform(size=sigma2.size) < _sigmoid(-1.0 * np.log(sigma2))).astype(float)
    cal = fit_logistic(sigma2, y, transform="log")
    assert cal.direction == -1 and float(cal.a) == pytest.approx(-1.0, rel=0.15)


def test_fits_reject_bad_input() -> None:
    with pytest.raises(InvalidParameterError, match="single class"):
        fit_logistic([1, 2, 3], [1, 1, 1])
    with pytest.raises(InvalidParameterError):
        fit_logistic([1, 2, 3], [0, 1, 1, 0])
    with pytest.raises(InvalidParameterError):
        fit_logistic([1.0, float("nan")], [0, 1])
    with pytest.raises(InvalidParameterError):
        fit_logistic([1.0], [1.0])


# --------------------------------------------------------------------------- head + head file
def test_rts_head_shapes() -> None:
    torch.manual_seed(0)
    head = RTSQualityHead(32).eval()
    f = torch.randn(5, 32)
    logvar = head(f)
    assert logvar.shape == (5, 1)
    from facegate.training.rts import head_sigma2  # σ² = exp(logvar), as the calibration reads it

    assert np.allclose(head_sigma2(head, f.numpy()), torch.exp(logvar).squeeze(1).detach().double().numpy())


def _head_and_cal() -> tuple[RTSQualityHead, QualityCalibration]:
    torch.manual_seed(0)
    head = RTSQualityHead(24, backbone="sface").eval()
    with torch.no_grad():
        head.bn.running_mean.fill_(0.3)
        head.bn.running_var.fill_(2.0)
    cal = QualityCalibration("logistic", direction=-1, transform="log", a=-1.2, b=0.1, fitted=True)
    return head, cal


def test_head_file_round_trip(tmp_path: Path) -> None:
    head, cal = _head_and_cal()
    meta = {"trained_on": "lfw folds 1-9", "folds": [1, 2, 3], "command": "facegate fit-head ..."}
    path = tmp_path / "heads" / "h.pt"
    save_head(path, head, cal, meta)
    head2, cal2, meta2 = load_head(path, backbone="sface", feature_dim=24)
    assert meta2 == meta and cal2.to_dict() == cal.to_dict() and head2.backbone == "sface"
    f = torch.randn(7, 24)
    with torch.no_grad():
        assert torch.equal(head(f), head2(f))
    obj = torch.load(path, weights_only=True)
    assert obj["format"] == "facegate.quality_head" and obj["version"] == 1 and obj["feature_dim"] == 24


def _write(tmp_path: Path, obj: object, name: str = "bad.pt") -> Path:
    p = tmp_path / name
    torch.save(obj, p)
    return p


def test_head_file_errors(tmp_path: Path) -> None:
    head, cal = _head_and_cal()
    good = tmp_path / "good.pt"
    save_head(good, head, cal, {})
    obj = torch.load(good, weights_only=True)

    cases = {
        "format": (dict(obj, format="something.else"), "not a facegate quality head"),
        "version": (dict(obj, version=2), "version 2 is not supported"),
        "state": (dict(obj, state_dict={"fc.weight": torch.zeros(1, 24)}), "does not fit"),
        "calib": (dict(obj, calibration={"kind": "logistic", "direction": 5, "a": 1, "b": 0}), "direction"),
        "kind": (dict(obj, calibration={"kind": "piecewise_linear", "direction": 1, "a": 1, "b": 0}), "kind"),
        "notdict": ([1, 2, 3], "not a facegate quality head"),
    }
    for name, (payload, msg) in cases.items():
        with pytest.raises(QualityHeadError, match=msg):
            load_head(_write(tmp_path, payload, f"{name}.pt"))
    with pytest.raises(QualityHeadError, match="trained on backbone 'sface', not 'irse64_rts'"):
        load_head(good, backbone="irse64_rts")
    with pytest.raises(QualityHeadError, match="expects 24-dim features, the backbone gives 25088"):
        load_head(good, feature_dim=25088)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00garbage")
    with pytest.raises(QualityHeadError, match="cannot read"):
        load_head(junk)
    with pytest.raises(QualityHeadError, match="does not exist"):
        load_head(tmp_path / "missing.pt")
    with pytest.raises(QualityHeadError, match="backbone"):
        save_head(tmp_path / "x.pt", RTSQualityHead(4), cal, {})
    assert issubclass(QualityHeadError, ModelError) and QualityHeadError.code == "quality_head_invalid"
