"""/api/compare, /api/embed, /api/detect against a real server (real detector, tiny recognizer)."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import httpx
import numpy as np
import pytest

FACE_KEYS = {"detection", "quality"}
QUALITY_KEYS = {"score", "raw", "threshold", "accepted", "reason", "reasons"}


def _check_face(face: dict, *, width: int = 250, height: int = 250) -> None:
    assert FACE_KEYS <= set(face) <= FACE_KEYS | {"crop", "embedding"}
    assert set(face["quality"]) == QUALITY_KEYS
    q = face["quality"]
    assert 0.0 <= q["score"] <= 1.0
    assert q["accepted"] == (q["score"] >= q["threshold"])
    assert (q["reason"] is None) == q["accepted"]
    det = face["detection"]
    if det is not None:
        x1, y1, x2, y2 = det["box"]
        assert -width * 0.25 < x1 < x2 < width * 1.25 and -height * 0.25 < y1 < y2 < height * 1.25
        assert len(det["landmarks"]) == 5 and all(len(p) == 2 for p in det["landmarks"])
        assert 0.0 < det["score"] <= 1.0


def test_compare_two_people(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    a = fg.lfw_image(lfw_root, "Colin_Powell", 1)
    b = fg.lfw_image(lfw_root, "Tony_Blair", 1)
    r = client.post("/api/compare", files=fg.files(img1=a, img2=b))
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {
        "similarity", "match", "verdict", "threshold", "fmr", "refused", "reason", "reliability", "faces", "model",
    }  # fmt: skip
    assert body["model"] == "sface-tiny"
    assert body["refused"] is False and body["reason"] is None  # the sface gate is 0.0: every face passes
    assert -1.0 <= body["similarity"] <= 1.0
    assert body["match"] == (body["similarity"] >= body["threshold"])
    assert body["verdict"] == ("match" if body["match"] else "no_match")
    assert len(body["faces"]) == 2
    for f in body["faces"]:
        _check_face(f)
        assert "crop" not in f and "embedding" not in f


def test_compare_same_photo_is_a_match_with_crops(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    a = fg.lfw_image(lfw_root, "George_W_Bush", 1)
    r = client.post("/api/compare", params={"crops": "true"}, files=fg.files(img1=a, img2=a))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["similarity"] == pytest.approx(1.0, abs=1e-4)
    assert body["verdict"] == "match" and body["match"] is True
    for f in body["faces"]:
        prefix = "data:image/png;base64,"
        assert f["crop"].startswith(prefix)
        png = base64.b64decode(f["crop"][len(prefix) :])
        crop = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_UNCHANGED)
        assert crop.shape == (112, 112, 3)
    assert body["faces"][0] == body["faces"][1]


def test_embed_uploads_paths_and_partial_errors(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    imgs = [fg.lfw_image(lfw_root, p, 1) for p in ("Colin_Powell", "Tony_Blair", "Donald_Rumsfeld")]
    r = client.post("/api/embed", files=fg.many("images", imgs))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "sface-tiny" and body["dim"] == 128
    assert [x["index"] for x in body["results"]] == [0, 1, 2]
    embs = []
    for item in body["results"]:
        assert set(item) == {"index", "faces"}
        assert len(item["faces"]) == 1
        face = item["faces"][0]
        _check_face(face)
        e = np.asarray(face["embedding"], np.float64)
        assert e.shape == (128,) and abs(np.linalg.norm(e) - 1.0) < 1e-4
        embs.append(e)
    assert np.linalg.norm(embs[0] - embs[1]) > 1e-3  # different people, different embeddings

    # the same files by server-side path (inside the allowed root) give the same embeddings
    r2 = client.post("/api/embed", data={"paths": [str(p) for p in imgs]})
    assert r2.status_code == 200, r2.text
    for item, e in zip(r2.json()["results"], embs, strict=True):
        np.testing.assert_allclose(item["faces"][0]["embedding"], e, atol=1e-5)

    # one bad image does not fail the others
    bad = [imgs[0], b"", b"this is not an image", fg.png_bytes(fg.grey_image())]
    r3 = client.post("/api/embed", files=fg.many("images", bad))
    assert r3.status_code == 200, r3.text
    res = r3.json()["results"]
    assert set(res[0]) == {"index", "faces"}
    # batched with a 240×320 image, the 250×250 one is padded differently for detection: the landmarks
    # (and so the embedding) move very slightly; same face, same identity
    assert float(np.dot(res[0]["faces"][0]["embedding"], embs[0])) > 0.999
    assert [x["error"]["code"] for x in res[1:]] == ["empty_input", "image_unreadable", "no_face"]
    assert all(set(x) == {"index", "error"} and x["error"]["message"] for x in res[1:])


def test_embed_select_all_and_aligned(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    left = cv2.imread(str(fg.lfw_image(lfw_root, "Colin_Powell", 1)))[:, :, ::-1]
    right = cv2.imread(str(fg.lfw_image(lfw_root, "Tony_Blair", 1)))[:, :, ::-1]
    pair = np.concatenate([left, right], axis=1)  # 250×500, two faces
    data = fg.png_bytes(pair)
    all_faces = client.post("/api/embed", files=fg.many("images", [data]), data={"select": "all"}).json()
    largest = client.post("/api/embed", files=fg.many("images", [data]), data={"select": "largest"}).json()
    faces = all_faces["results"][0]["faces"]
    assert len(faces) >= 2
    assert len(largest["results"][0]["faces"]) == 1
    centres = sorted((f["detection"]["box"][0] + f["detection"]["box"][2]) / 2 for f in faces[:2])
    assert centres[0] < 250 < centres[1]  # one face in each half

    # a pre-aligned 112×112 crop: no detection, still an embedding and a quality verdict
    crop = cv2.resize(np.ascontiguousarray(left[50:200, 50:200]), (112, 112), interpolation=cv2.INTER_AREA)
    r = client.post("/api/embed", files=fg.many("images", [fg.png_bytes(crop), data]), data={"aligned": "true"}).json()
    a0 = r["results"][0]["faces"][0]
    assert a0["detection"] is None and len(a0["embedding"]) == 128
    _check_face(a0)
    assert r["results"][1]["error"]["code"] == "invalid_parameter"  # not 112×112 with aligned=true


def test_detect(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    r = client.post("/api/detect", files=fg.files(image=fg.lfw_image(lfw_root, "Gerhard_Schroeder", 1)))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["width"] == 250 and body["height"] == 250
    assert len(body["faces"]) >= 1
    scores = [f["score"] for f in body["faces"]]
    assert scores == sorted(scores, reverse=True)
    x1, y1, x2, y2 = body["faces"][0]["box"]
    assert 40 < (x1 + x2) / 2 < 210 and 40 < (y1 + y2) / 2 < 210  # deep-funnelled: face near the centre

    grey = client.post("/api/detect", files=fg.files(image=fg.png_bytes(fg.grey_image(100, 160))))
    assert grey.status_code == 200
    assert grey.json() == {"faces": [], "width": 160, "height": 100}


def test_photo_stage_answers_like_the_host_path(server_factory: Any, lfw_root: Path, fg: SimpleNamespace) -> None:
    """gpu_preprocess=on (here on the CPU): compare/embed of the largest face go through the engine's photo
    stage; asking for crops takes the host path on the same server, so the two can be compared."""
    srv = server_factory(lfw_root=lfw_root, gpu_preprocess="on")
    with srv.client() as c:
        a = fg.lfw_image(lfw_root, "Colin_Powell", 1)
        b = fg.lfw_image(lfw_root, "Colin_Powell", 2)
        photo = c.post("/api/compare", files=fg.files(img1=a, img2=b))
        host = c.post("/api/compare", params={"crops": "true"}, files=fg.files(img1=a, img2=b))
        assert photo.status_code == host.status_code == 200, (photo.text, host.text)
        p, h = photo.json(), host.json()
        assert p["similarity"] == pytest.approx(h["similarity"], abs=5e-3)
        assert p["verdict"] == h["verdict"]
        for fp, fh in zip(p["faces"], h["faces"], strict=True):
            _check_face(fp)
            np.testing.assert_allclose(fp["detection"]["box"], fh["detection"]["box"], atol=1e-3)

        def photos_done() -> float:
            return fg.parse_metric(c.get("/metrics").text, "facegate_items_total", {"stage": "photo"})

        before = photos_done()
        # per-item errors keep their codes: JPEGs fail in the engine's photo stage, other bytes here
        a_bytes = a.read_bytes()
        grey_jpeg = fg.jpeg_bytes(fg.grey_image())
        bad = [a, b"", b"this is not an image", fg.png_bytes(fg.grey_image()), a_bytes[: len(a_bytes) // 2], grey_jpeg]
        res = c.post("/api/embed", files=fg.many("images", bad)).json()["results"]
        assert len(res[0]["faces"]) == 1
        codes = [x["error"]["code"] for x in res[1:]]
        assert codes == ["empty_input", "image_unreadable", "no_face", "image_unreadable", "no_face"]
        assert photos_done() - before == 3  # the three JPEGs; the PNG and the junk were decoded by the server
        r = c.post("/api/compare", files=fg.files(img1=a, img2=b"garbage"))
        fg.assert_error(r, 400, "image_unreadable")
