"""The facegate CLI: JSON out, typed JSON errors and exit codes, no tracebacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from facegate.cli import app

runner = CliRunner()


def test_models_lists_registry_with_threshold_sources() -> None:
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0
    specs = {s["name"]: s for s in json.loads(res.stdout)}
    assert {"sface", "sface_rts", "irse64_rts"} <= set(specs)
    assert specs["sface"]["thresholds"]["match_fmr"] == 1e-3
    assert "FMR 1e-3" in specs["sface"]["thresholds"]["source"]
    points = specs["sface"]["search_operating_points"]
    assert {(p["n"], p["fpir_target"]) for p in points} >= {(1_000, 1e-2), (1_000_000, 1e-3)}
    assert all({"threshold", "fpir", "fmr", "extrapolated", "basis"} <= set(p) for p in points)
    # sface_rts has SFace's embeddings (only the quality head differs): it searches at SFace's measured thresholds
    rts = specs["sface_rts"]["search_operating_points"]
    assert rts == points and {p["basis"] for p in rts} == {"lfw_impostors"}


def test_compare_bad_file_is_a_json_error(tmp_path: Path) -> None:
    bad = tmp_path / "not.jpg"
    bad.write_bytes(b"definitely not an image")
    res = runner.invoke(app, ["compare", str(bad), str(bad)])
    assert res.exit_code == 2
    err = json.loads(res.stderr.strip().splitlines()[-1])["error"]
    assert err["code"] == "image_unreadable" and err["detail"]["field"] == "img1"
    assert "Traceback" not in res.output
    # a file that is not there is a bad parameter, as bulk enrolment reports a missing photo
    res = runner.invoke(app, ["compare", str(tmp_path / "missing.jpg"), str(bad)])
    err = json.loads(res.stderr.strip().splitlines()[-1])["error"]
    assert res.exit_code == 2 and err["code"] == "invalid_parameter" and "No such file" in err["message"], err


def test_compare_and_embed_on_lfw(lfw_root: Path, tmp_path: Path) -> None:
    base = lfw_root / "lfw-deepfunneled"
    a, b = base / "Aaron_Peirsol/Aaron_Peirsol_0001.jpg", base / "Aaron_Peirsol/Aaron_Peirsol_0002.jpg"
    res = runner.invoke(app, ["compare", str(a), str(b)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["verdict"] == "match" and out["similarity"] > out["threshold"]
    assert len(out["faces"]) == 2 and len(out["faces"][0]["detection"]["landmarks"]) == 5
    assert 0.0 <= out["faces"][0]["quality"]["score"] <= 1.0
    assert out["faces"][0]["quality"]["reasons"] == []  # a good face has no reasons
    # an error names its photo, as the API's does
    res = runner.invoke(app, ["compare", str(a), str(tmp_path / "missing.jpg")])
    assert res.exit_code == 2 and json.loads(res.stderr.strip().splitlines()[-1])["error"]["detail"]["field"] == "img2"

    # a photo shrunk until its eyes are a few pixels apart is refused, and the refusal says why
    import cv2

    small = tmp_path / "small.png"
    img = cv2.imread(str(a))
    cv2.imwrite(str(small), cv2.resize(img, (56, 56), interpolation=cv2.INTER_AREA))
    res = runner.invoke(app, ["compare", str(small), str(b)])
    out = json.loads(res.stdout)
    codes = [r["code"] for r in out["faces"][0]["quality"]["reasons"]]
    assert out["verdict"] == "refused" and "too_small" in codes, out["faces"][0]["quality"]
    assert "px between the eyes" in out["reason"]

    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    shutil.copy(a, folder / "a.jpg")
    shutil.copy(b, folder / "sub" / "b.jpg")
    (folder / "broken.jpg").write_bytes(a.read_bytes()[:500])  # truncated: skipped with a reason
    res = runner.invoke(app, ["embed", str(folder), "--out", str(tmp_path / "faces.npz")])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary == {"images": 3, "skipped": 1, "faces": 2, "out": str(tmp_path / "faces.npz")}
    z = np.load(tmp_path / "faces.npz")
    assert z["embeddings"].shape == (2, 128)
    np.testing.assert_allclose(np.linalg.norm(z["embeddings"], axis=1), 1.0, atol=1e-5)

    # embed gates each face as the API does: the shrunk photo's face carries its reason
    (tmp_path / "small_only").mkdir()
    shutil.copy(small, tmp_path / "small_only" / "small.png")
    res = runner.invoke(app, ["embed", str(tmp_path / "small_only"), "--out", str(tmp_path / "small.jsonl")])
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "small.jsonl").read_text().splitlines()[0])
    assert "too_small" in [r["code"] for r in row["quality"]["reasons"]], row["quality"]
    assert row["enrol_accepted"] is False

    # its .npz marks the faces the enrolment gate refused, and enrolling from it imports only the others
    (tmp_path / "mixed" / "tiny").mkdir(parents=True)
    (tmp_path / "mixed" / "good").mkdir()
    shutil.copy(small, tmp_path / "mixed" / "tiny" / "small.png")
    shutil.copy(a, tmp_path / "mixed" / "good" / "a.jpg")
    res = runner.invoke(app, ["embed", str(tmp_path / "mixed"), "--out", str(tmp_path / "mixed.npz")])
    assert res.exit_code == 0, res.output
    z = np.load(tmp_path / "mixed.npz")
    assert dict(zip(z["paths"], z["enrol_accepted"], strict=True)) == {
        str(tmp_path / "mixed" / "good" / "a.jpg"): True,
        str(tmp_path / "mixed" / "tiny" / "small.png"): False,
    }
    url = str(tmp_path / "g.sqlite3")
    res = runner.invoke(app, ["enrol", str(tmp_path / "mixed.npz"), "--gallery", "g", "--gallery-url", url])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["subjects_imported"] == 1 and out["faces_refused"] == 1 and out["gallery"]["subjects"] == 1


def _json_error(res) -> dict:
    assert "Traceback" not in res.output, res.output
    return json.loads(res.stderr.strip().splitlines()[-1])["error"]


def test_embed_rejects_unknown_output_suffix(tmp_path: Path) -> None:
    res = runner.invoke(app, ["embed", str(tmp_path), "--out", str(tmp_path / "x.csv")])
    assert res.exit_code == 2, res.output  # bad input, as the README promises (not internal_error, exit 1)
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and "--out" in err["message"]


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("FACEGATE_LIMITS__MAX_UPLOAD_BYTES", "abc", "limits.max_upload_bytes"),
        ("FACEGATE_PORT", "99999", "port"),
        ("FACEGATE_LIMITS__ALLOWED_ROOTS", "not-json", "limits"),
    ],
)
def test_a_bad_setting_in_the_environment_is_bad_input(tmp_path: Path, variable: str, value: str, field: str) -> None:
    """A bad FACEGATE_* value: exit 2 and a JSON error naming the setting and its variable, no traceback."""
    res = runner.invoke(app, ["keys", "list", "--data-dir", str(tmp_path)], env={variable: value})
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and field in err["message"], err
    assert variable.split("__")[0] in err["message"], err


def test_a_bad_log_level_is_bad_input(tmp_path: Path) -> None:
    res = runner.invoke(app, ["keys", "list", "--data-dir", str(tmp_path)], env={"FACEGATE_LOG_LEVEL": "LOUD"})
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and "FACEGATE_LOG_LEVEL" in err["message"], err


@pytest.mark.parametrize("args", [["eval", "lfw", "--root", "/nonexistent"]])
def test_eval_lfw_missing_root_is_an_error(args: list[str]) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert json.loads(res.stderr.strip().splitlines()[-1])["error"]["code"] == "invalid_parameter"


def test_ray_refuses_a_non_loopback_address_without_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`facegate ray --host 0.0.0.0` with no API keys refuses to start, as `facegate serve` does (docs/security.md),
    before any Ray node or replica exists; --no-auth serves anyway."""
    pytest.importorskip("ray")
    from facegate.scaleout import ray_app

    runs: list[object] = []
    monkeypatch.setattr(ray_app, "run", lambda settings, **kw: runs.append(settings))
    env = {"FACEGATE_DATA_DIR": str(tmp_path)}
    res = runner.invoke(app, ["ray", "--host", "0.0.0.0", "--port", "1"], env=env)
    assert res.exit_code == 1, res.output
    err = _json_error(res)
    assert err["code"] == "server_error" and "--no-auth" in err["message"], err
    assert runs == []
    res = runner.invoke(app, ["ray", "--host", "0.0.0.0", "--port", "1", "--no-auth"], env=env)
    assert res.exit_code == 0, res.output
    assert len(runs) == 1 and runs[0].security.no_auth  # type: ignore[attr-defined]
    res = runner.invoke(app, ["ray", "--host", "127.0.0.1", "--port", "1"], env=env)
    assert res.exit_code == 0 and len(runs) == 2, res.output


@pytest.mark.parametrize("source", ["broken.npz", "subjects.txt", "empty"])
def test_a_failed_enrol_removes_the_gallery_it_created(tmp_path: Path, source: str) -> None:
    """An enrol that fails before enrolling anything (an unreadable .npz, a source that is neither a folder nor a
    CSV, a folder without subjects) leaves no gallery behind when it created the gallery; a gallery that existed
    before the run stays, even when empty."""
    from facegate.gallery import open_store

    (tmp_path / "broken.npz").write_bytes(b"not a zip file")
    (tmp_path / "subjects.txt").write_text("a.jpg,alice\n")
    (tmp_path / "empty").mkdir()
    url = str(tmp_path / "g.sqlite3")
    res = runner.invoke(app, ["enrol", str(tmp_path / source), "--gallery", "new", "--gallery-url", url])
    assert res.exit_code == 2, res.output
    assert _json_error(res)["code"] in {"invalid_parameter", "empty_input"}
    with open_store(url) as store:
        assert [g.name for g in store.list_galleries()] == []
        store.create_gallery("old", "sface", 128)
    res = runner.invoke(app, ["enrol", str(tmp_path / source), "--gallery", "old", "--gallery-url", url])
    assert res.exit_code == 2, res.output
    with open_store(url) as store:
        assert [(g.name, g.subjects) for g in store.list_galleries()] == [("old", 0)]


def _no_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading the models fail, so a test shows that the input was refused before they load."""

    def fail(settings: object) -> None:
        raise AssertionError("the models loaded")

    monkeypatch.setattr("facegate.cli._pipeline", fail)


@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        ("1 1\nAaron_Peirsol 1 2\nAaron_Peirsol 1 Abel_Pacheco 1\n", "3 images of"),  # no lfw-deepfunneled/
        ("10 300 extra\n", "line 1"),
        ("1 1\nAaron_Peirsol 1 x\nAaron_Peirsol 1 Abel_Pacheco 1\n", "line 2"),
    ],
)
def test_eval_lfw_broken_root_is_refused_before_the_models_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pairs: str, expected: str
) -> None:
    (tmp_path / "lfw" / "Aaron_Peirsol").mkdir(parents=True)  # the images in lfw/, not lfw-deepfunneled/
    (tmp_path / "pairs.txt").write_text(pairs)
    _no_models(monkeypatch)
    res = runner.invoke(app, ["eval", "lfw", "--root", str(tmp_path), "--out", str(tmp_path / "o.json")])
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and expected in err["message"], err
    if expected == "3 images of":
        assert "Aaron_Peirsol/Aaron_Peirsol_0001.jpg" in err["message"], err


@pytest.mark.parametrize("out", ["file/x.npz", "/proc/x.npz"])
def test_embed_refuses_an_unwritable_out_before_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str
) -> None:
    if out.startswith("/proc") and not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    (tmp_path / "file").write_text("a file, not a folder")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"whatever")
    _no_models(monkeypatch)
    res = runner.invoke(app, ["embed", str(tmp_path / "photos"), "--out", str(tmp_path / out)])
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and "--out" in err["message"] and out in err["message"], err


def test_device_cuda_without_cuda_is_bad_input(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "a.jpg").write_bytes(b"whatever")
    args = ["embed", str(tmp_path), "--out", str(tmp_path / "x.npz"), "--model", "sface-tiny", "--device", "cuda"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and "no CUDA device" in err["message"], err


@pytest.mark.parametrize("flag", ["--rts-checkpoint", "--quality-head"])
def test_export_onnx_missing_model_file_is_bad_input(tmp_path: Path, flag: str) -> None:
    missing = str(tmp_path / "missing.pt")
    res = runner.invoke(app, ["export", "onnx", "--out", str(tmp_path / "m.onnx"), flag, missing])
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and flag in err["message"] and missing in err["message"], err


def test_keys_create_in_an_unwritable_data_dir_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    res = runner.invoke(app, ["keys", "create", "--data-dir", str(tmp_path / "file" / "x")])
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and str(tmp_path / "file" / "x") in err["message"], err


def test_keys_list_with_a_corrupt_keys_file_names_it(tmp_path: Path) -> None:
    """A broken keys file is broken state, not bad input: exit 1, and the error names the file."""
    (tmp_path / "api_keys.json").write_text("{not json")
    res = runner.invoke(app, ["keys", "list", "--data-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    err = _json_error(res)
    assert err["code"] == "keys_file_unreadable" and str(tmp_path / "api_keys.json") in err["message"], err


def test_train_quality_bad_device_is_bad_input(tmp_path: Path) -> None:
    res = runner.invoke(app, ["train-quality", str(tmp_path), "--out", str(tmp_path / "h.pt"), "--device", "gpu"])
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert err["code"] == "invalid_parameter" and "--device gpu" in err["message"], err


def test_train_quality_skips_an_unreadable_photo(lfw_root: Path, tmp_path: Path) -> None:
    """An unreadable photo is skipped and logged with its path (its rows not found); extraction shows a progress
    bar; too few faces says how many are needed."""
    src = lfw_root / "lfw-deepfunneled"
    for name in ("Colin_Powell", "Tony_Blair"):
        (tmp_path / "faces" / name).mkdir(parents=True)
        shutil.copy(src / name / f"{name}_0001.jpg", tmp_path / "faces" / name)
    (tmp_path / "faces" / "Colin_Powell" / "bad.jpg").write_text("not a photo")  # between the two photos
    feats = tmp_path / "f.npz"
    args = ["train-quality", str(tmp_path / "faces"), "--out", str(tmp_path / "h.pt"), "--n-random", "1"]
    res = runner.invoke(app, [*args, "--save-features", str(feats)])
    assert res.exit_code == 2, res.output
    err = _json_error(res)
    assert "need at least 256 faces" in err["message"] and "add photos" in err["message"], err
    assert f"skipping {tmp_path / 'faces' / 'Colin_Powell' / 'bad.jpg'}" in res.stderr
    assert "features: 100%" in res.stderr
    z = np.load(feats)
    paths = ["Colin_Powell/Colin_Powell_0001.jpg", "Colin_Powell/bad.jpg", "Tony_Blair/Tony_Blair_0001.jpg"]
    clean = z["variant"] == 0
    assert z["path"][clean].tolist() == paths and z["found"][clean].tolist() == [True, False, True]
