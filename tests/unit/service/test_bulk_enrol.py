"""Bulk enrolment: photos by folder or CSV (resumable, refusals reported) and template import, via the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from facegate.cli import app
from facegate.gallery import open_store
from store_helpers import add_embeddings, stored_template

runner = CliRunner()


def test_template_import_from_ids_and_embeddings(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((2500, 128)).astype(np.float32)
    np.savez(tmp_path / "t.npz", ids=np.array([f"s{i}" for i in range(2500)]), embeddings=emb)
    url = str(tmp_path / "g.sqlite3")
    res = runner.invoke(app, ["enrol", str(tmp_path / "t.npz"), "--gallery", "big", "--gallery-url", url])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["subjects_imported"] == 2500 and out["gallery"]["subjects"] == 2500
    store = open_store(url)
    t = stored_template(store, "big", "s7")
    np.testing.assert_allclose(t, emb[7] / np.linalg.norm(emb[7]), atol=1e-6)
    store.close()
    bad = runner.invoke(app, ["enrol", str(tmp_path / "g.sqlite3"), "--gallery", "big", "--gallery-url", url])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    # arrays that are not what a template file holds: bad input (exit 2, invalid_parameter), not an internal error
    one = np.ones((1, 128), np.float32)
    for name, arrays in {
        "text.npz": {"ids": np.array(["a"]), "embeddings": np.array([["x"] * 128])},
        "objects.npz": {"ids": np.array(["a"], dtype=object), "embeddings": one},
        "quality.npz": {"ids": np.array(["a"]), "embeddings": one, "quality": np.array(["high"])},
        "nan.npz": {"ids": np.array(["a"]), "embeddings": one, "quality": np.array([np.nan], np.float32)},
        # a bad id among repeated ones: refused before any transaction, not part-way through the import
        "id.npz": {"ids": np.array(["a", "a", "bad id!"]), "embeddings": np.ones((3, 128), np.float32)},
    }.items():
        np.savez(tmp_path / name, **arrays)
        bad = runner.invoke(app, ["enrol", str(tmp_path / name), "--gallery", "big", "--gallery-url", url])
        assert bad.exit_code == 2 and "Traceback" not in bad.output, (name, bad.output)
        assert json.loads(bad.stderr.strip().splitlines()[-1])["error"]["code"] == "invalid_parameter", name


def test_template_import_of_several_rows_per_subject(tmp_path: Path) -> None:
    """Rows sharing an id (an ``.npz`` of ``facegate embed``) make one subject, in transactions of
    :data:`ENROL_CHUNK` subjects."""
    from facegate.service.enrol import ENROL_CHUNK, import_templates

    rng = np.random.default_rng(1)
    n = ENROL_CHUNK + 300
    ids = [f"p{i // 2}" for i in range(2 * n)]
    emb = rng.standard_normal((2 * n, 32)).astype(np.float32)
    with open_store(str(tmp_path / "g.sqlite3")) as store:
        store.create_gallery("g", "m", 32)
        seen: list[int] = []
        assert import_templates(store, "g", ids, emb, progress=seen.append) == n
        assert sum(seen) == 2 * n and store.get_gallery("g").subjects == n
        assert store.get_subject("g", "p7").n_embeddings == 2
        assert len(store.changes_since(0, limit=10 * n)) == 1 + n  # the gallery, then one row per subject


def test_template_import_replaces_a_subject_whether_or_not_ids_repeat(tmp_path: Path) -> None:
    """A template import is a replace (as over HTTP and for one row per id): importing the same ``.npz`` of
    ``facegate embed`` (rows sharing an id) twice leaves the same gallery, and an enrolled subject starts over
    from the imported rows, its earlier embeddings and meta gone."""
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((3, 32)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    np.savez(tmp_path / "t.npz", ids=np.array(["a", "a", "b"]), embeddings=emb)
    url = str(tmp_path / "g.sqlite3")
    with open_store(url) as store:
        store.create_gallery("g", "m", 32)
        add_embeddings(store, "g", "a", emb[2:], np.ones(1, np.float32), {"badge": 7})
    for _ in range(2):
        res = runner.invoke(app, ["enrol", str(tmp_path / "t.npz"), "--gallery", "g", "--gallery-url", url])
        assert res.exit_code == 0, res.output
        with open_store(url) as store:
            a, b = store.get_subject("g", "a"), store.get_subject("g", "b")
            assert (a.n_embeddings, b.n_embeddings, a.meta) == (2, 1, {})
            assert store.get_gallery("g").subjects == 2
            t = emb[0] + emb[1]
            np.testing.assert_allclose(stored_template(store, "g", "a"), t / np.linalg.norm(t), atol=1e-6)


def test_photo_enrolment_resumes_and_reports_refusals(lfw_root: Path, tmp_path: Path) -> None:
    base = lfw_root / "lfw-deepfunneled"
    src = tmp_path / "people"
    for name in ("Colin_Powell", "Tony_Blair"):
        (src / name).mkdir(parents=True)
        for i in (1, 2):
            shutil.copy(base / name / f"{name}_{i:04d}.jpg", src / name)
    (src / "nobody").mkdir()
    (src / "nobody" / "broken.jpg").write_bytes(b"not an image")
    url = str(tmp_path / "g.sqlite3")
    args = ["enrol", str(src), "--gallery", "staff", "--gallery-url", url, "--report", str(tmp_path / "r.json")]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    out = json.loads(first.stdout.strip().splitlines()[-1])
    assert out["subjects_enrolled"] == 2 and out["subjects_refused"] == 1 and out["faces"] == 4
    refused = json.loads((tmp_path / "r.json").read_text())
    assert [(r["subject_id"], r["code"]) for r in refused] == [("nobody", "image_unreadable")]
    again = json.loads(runner.invoke(app, args).stdout.strip().splitlines()[-1])
    assert again["subjects_skipped"] == 2 and again["subjects_enrolled"] == 0
    store = open_store(url)
    assert store.get_subject("staff", "Tony_Blair").n_embeddings == 2  # not enrolled twice
    store.close()
    # a CSV of path,subject_id works the same
    csv = tmp_path / "list.csv"
    csv.write_text(f"path,subject_id\n{src / 'Colin_Powell' / 'Colin_Powell_0001.jpg'},colin\n")
    res = runner.invoke(app, ["enrol", str(csv), "--gallery", "staff", "--gallery-url", url])
    assert json.loads(res.stdout.strip().splitlines()[-1])["subjects_enrolled"] == 1


def test_photo_enrolment_gates_with_the_crop_based_reasons(lfw_root: Path, tmp_path: Path) -> None:
    """Bulk enrolment gives each photo the reasons the pipeline gives it (crop statistics included): a blurred
    photo is refused as blurred, not enrolled."""
    import cv2

    from facegate.config import Settings
    from facegate.pipeline.pipeline import FacePipeline
    from facegate.service.enrol import enrol_photos, pipeline_faces

    photo = lfw_root / "lfw-deepfunneled" / "Colin_Powell" / "Colin_Powell_0001.jpg"
    rgb = cv2.cvtColor(cv2.imread(str(photo)), cv2.COLOR_BGR2RGB)
    blurred = cv2.GaussianBlur(rgb, (0, 0), sigmaX=5.0)
    paths = {"sharp": tmp_path / "sharp" / "a.png", "blurry": tmp_path / "blurry" / "a.png"}
    for p, img in zip(paths.values(), (rgb, blurred), strict=True):
        p.parent.mkdir()
        cv2.imwrite(str(p), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    settings = Settings(model="sface-tiny", device="cpu", compile="off", quality_threshold=0.0)
    pipe = FacePipeline.from_settings(settings)
    got = pipeline_faces(pipe, list(paths.values()), settings.limits)
    want = [pipe.faces([img])[0][0] for img in (rgb, blurred)]
    assert [[r.code for r in f.quality.reasons] for f in got] == [[r.code for r in f.quality.reasons] for f in want]
    assert "blur" in [r.code for r in got[1].quality.reasons] and not got[1].quality.accepted
    with open_store(str(tmp_path / "g.sqlite3")) as store:
        store.create_gallery("g", pipe.spec.name, pipe.spec.embedding_dim)
        subjects = {sid: [p] for sid, p in paths.items()}
        rep = enrol_photos(store, "g", subjects, pipe, settings.limits, batch_size=8, verdict=pipe.enrol_verdict)
        assert rep.subjects_enrolled == 1 and rep.subjects_refused == 1
        assert [(r["subject_id"], r["code"]) for r in rep.refused] == [("blurry", "low_quality")]
        assert "face blurred" in rep.refused[0]["reason"]
        assert [s.subject_id for s in store.list_subjects("g", 0, 10)] == ["sharp"]


def test_photo_enrolment_reports_a_csv_row_whose_file_is_missing(lfw_root: Path, tmp_path: Path) -> None:
    """A CSV row naming a file that is not there (moved, a typo) is an image not used, listed in the report with
    its reason; the other rows are enrolled (it was an internal error, exit 1 with a traceback, nothing done)."""
    photo = lfw_root / "lfw-deepfunneled" / "Colin_Powell" / "Colin_Powell_0001.jpg"
    csv = tmp_path / "list.csv"
    csv.write_text(f"path,subject_id\n{photo},colin\nmissing.jpg,ghost\n")
    url = str(tmp_path / "g.sqlite3")
    args = ["enrol", str(csv), "--gallery", "staff", "--gallery-url", url, "--report", str(tmp_path / "r.json")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["subjects_enrolled"] == 1 and out["subjects_refused"] == 1 and out["images_refused"] == 1
    (refused,) = json.loads((tmp_path / "r.json").read_text())
    assert refused["subject_id"] == "ghost" and refused["path"] == str(tmp_path / "missing.jpg")
    assert refused["code"] == "invalid_parameter" and "No such file" in refused["reason"]
    # once the file is there, a rerun enrols it (the missing file was not remembered as enrolled)
    shutil.copy(photo, tmp_path / "missing.jpg")
    again = json.loads(runner.invoke(app, args).stdout.strip().splitlines()[-1])
    assert again["subjects_enrolled"] == 1 and again["subjects_skipped"] == 1


def test_a_rerun_replaces_a_changed_subject_and_counts_the_skipped_photos(lfw_root: Path, tmp_path: Path) -> None:
    """A subject's folder is its source: after a photo is added a rerun replaces the subject (4 embeddings, not
    3 + 4), one enrolled by other means (no source_digest) starts over from its folder, an unchanged one is
    skipped, and the progress counts the skipped subject's photos."""
    from facegate.config import Settings
    from facegate.pipeline.pipeline import FacePipeline
    from facegate.service.enrol import enrol_photos, plan

    base, src = lfw_root / "lfw-deepfunneled", tmp_path / "people"
    for name, i in [("Aaron_Peirsol", 1), ("Aaron_Peirsol", 2), ("Aaron_Peirsol", 3), ("Tony_Blair", 1)]:
        (src / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(base / name / f"{name}_{i:04d}.jpg", src / name)
    settings = Settings(model="sface-tiny", device="cpu", compile="off")
    pipe = FacePipeline.from_settings(settings)
    with open_store(str(tmp_path / "g.sqlite3")) as store:
        store.create_gallery("g", pipe.spec.name, pipe.spec.embedding_dim)
        rep = enrol_photos(store, "g", plan(src), pipe, settings.limits, batch_size=64, verdict=None)
        assert rep.subjects_enrolled == 2
        shutil.copy(base / "Aaron_Peirsol" / "Aaron_Peirsol_0004.jpg", src / "Aaron_Peirsol")
        (src / "Colin_Powell").mkdir()
        shutil.copy(base / "Colin_Powell" / "Colin_Powell_0001.jpg", src / "Colin_Powell")
        one = np.eye(1, pipe.spec.embedding_dim, dtype=np.float32)
        add_embeddings(store, "g", "Colin_Powell", np.vstack([one, one]), np.ones(2, np.float32), {"badge": 7})
        seen: list[int] = []
        rep = enrol_photos(
            store,
            "g",
            plan(src),
            pipe,
            settings.limits,
            batch_size=64,
            verdict=None,
            progress=lambda n, _: seen.append(n),
        )
        assert (rep.subjects_enrolled, rep.subjects_skipped, sum(seen)) == (2, 1, 6)
        got = {s.subject_id: (s.n_embeddings, "badge" in s.meta) for s in store.list_subjects("g")}
        assert got == {"Aaron_Peirsol": (4, False), "Tony_Blair": (1, False), "Colin_Powell": (1, False)}


def _embed_npz(path: Path, **arrays: np.ndarray) -> Path:
    """An ``.npz`` as ``facegate embed`` writes it (sface, 128-d), with ``arrays`` in place of its own."""
    rng = np.random.default_rng(5)
    emb = rng.standard_normal((3, 128)).astype(np.float32)
    boxes = np.array([[0, 0, 50, 50], [0, 0, 90, 90], [0, 0, 40, 40]], np.float32)  # photo a: face 1 is the largest
    z = {"paths": np.array(["p/alice/a.jpg", "p/alice/a.jpg", "p/bob/b.jpg"]), "face": np.array([0, 1, 0], np.int32)}
    z |= {"embeddings": emb / np.linalg.norm(emb, axis=1, keepdims=True), "quality": np.full(3, 0.9, np.float32)}
    z |= {"enrol_accepted": np.ones(3, bool), "boxes": boxes, "model": np.array("sface")}
    np.savez(path, **(z | arrays))
    return path


def test_an_embed_npz_enrols_the_largest_face_of_each_photo(tmp_path: Path) -> None:
    """A subject taken from ``paths`` gets one face per photo, the largest, as enrolling the folder does: a
    bystander is not enrolled, and a photo whose largest face failed the gate gives none (one face refused)."""
    from facegate.service.enrol import read_templates

    path = _embed_npz(tmp_path / "faces.npz")
    ids, emb, q, refused = read_templates(path, model="sface", dim=128)
    z = np.load(path)
    assert (ids, refused) == (["alice", "bob"], 0)
    np.testing.assert_array_equal(emb, z["embeddings"][[1, 2]])
    assert q is not None and q.shape == (2,)
    _embed_npz(path, enrol_accepted=np.array([True, False, True]))
    ids, emb, _, refused = read_templates(path, model="sface", dim=128)
    assert (ids, refused) == (["bob"], 1)
    np.testing.assert_array_equal(emb, z["embeddings"][[2]])


@pytest.mark.parametrize(
    ("field", "arrays"),
    [
        ("embeddings", {"embeddings": np.ones(128, np.float32)}),
        ("embeddings", {"embeddings": np.ones((3, 128, 1), np.float32)}),
        ("embeddings", {"embeddings": np.ones((3, 64), np.float32)}),
        ("embeddings", {"embeddings": np.full((3, 128), np.nan, np.float32)}),
        ("embeddings", {"embeddings": np.zeros((3, 128), np.float32)}),
        ("quality", {"quality": np.ones((3, 1), np.float32)}),
        ("quality", {"quality": np.array([0.9, np.nan, 0.9], np.float32)}),
        ("ids", {"ids": np.array(["a", "b c", "d"])}),
        ("paths", {"paths": np.array(["p/alice/a.jpg", "p/alice/a.jpg", "p/bo b/b.jpg"])}),
        ("ids", {"ids": np.array([["a"], ["b"], ["c"]])}),
        ("model", {"model": np.array("arcface")}),
    ],
)
def test_a_bad_npz_is_bad_input_and_creates_no_gallery(tmp_path: Path, field: str, arrays: dict) -> None:
    """Templates that cannot be this model's (shape, dimension, NaN or zero rows, another model): exit 2 naming
    the file and the array, and no gallery left behind."""
    path = _embed_npz(tmp_path / "bad.npz", **arrays)
    url = str(tmp_path / "g.sqlite3")
    res = runner.invoke(app, ["enrol", str(path), "--gallery", "new", "--gallery-url", url])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = json.loads(res.stderr.strip().splitlines()[-1])["error"]
    assert err["code"] == "invalid_parameter" and str(path) in err["message"] and repr(field) in err["message"], err
    with open_store(url) as store:
        assert store.list_galleries() == []


def test_a_csv_with_a_bom_or_not_utf8(tmp_path: Path) -> None:
    """An Excel CSV (UTF-8 with a BOM, padded header) has its header skipped; one not in UTF-8 is bad input
    naming the file, not an internal error."""
    from facegate.service.enrol import plan

    csv = tmp_path / "list.csv"
    csv.write_text("path , subject_id\na.jpg,colin\n", encoding="utf-8-sig")
    assert plan(csv) == {"colin": [tmp_path / "a.jpg"]}
    csv.write_bytes("path,subject_id\nJos\u00e9.jpg,jose\n".encode("latin-1"))
    url = str(tmp_path / "g.sqlite3")
    res = runner.invoke(app, ["enrol", str(csv), "--gallery", "new", "--gallery-url", url])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = json.loads(res.stderr.strip().splitlines()[-1])["error"]
    assert err["code"] == "invalid_parameter" and str(csv) in err["message"], err
    with open_store(url) as store:
        assert store.list_galleries() == []
