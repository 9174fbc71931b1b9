"""The gallery API on a real PostgreSQL server, template import over HTTP, and a store that is down."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest


def test_postgres_gallery_with_template_import(
    postgres_url: str, server_factory, tmp_path: Path, lfw_root: Path, fg: SimpleNamespace
) -> None:
    srv = server_factory(fg.make_settings(tmp_path / "d", lfw_root, gallery_url=postgres_url))
    with srv.client() as c:
        assert c.post("/api/galleries", json={"name": "staff"}).status_code == 201
        dim = c.get("/api/galleries").json()["galleries"][0]["dim"]
        photo = fg.lfw_image(lfw_root, "Tony_Blair", 1)
        r = c.post("/api/galleries/staff/subjects/tony", files=fg.many("images", [photo]))
        assert r.status_code == 200, r.text
        rng = np.random.default_rng(0)
        emb = rng.standard_normal((100, dim)).tolist()
        r = c.post(
            "/api/galleries/staff/templates", json={"subject_ids": [f"s{i}" for i in range(100)], "embeddings": emb}
        )
        assert r.status_code == 200 and r.json() == {"imported": 100}, r.text
        s = c.post("/api/galleries/staff/search", params={"k": 3}, files=fg.files(image=photo)).json()
        assert s["n"] == 101 and s["hits"][0]["subject_id"] == "tony" and s["hits"][0]["rank"] == 1
        assert s["hits"][0]["score"] == pytest.approx(1.0, abs=2e-3)
        bad = c.post("/api/galleries/staff/templates", json={"subject_ids": ["x"], "embeddings": [[1.0, 2.0]]})
        fg.assert_error(bad, 422, "invalid_parameter")
        assert c.delete("/api/galleries/staff/subjects/tony").status_code == 200
        s = c.post("/api/galleries/staff/search", params={"k": 3}, files=fg.files(image=photo)).json()
        assert "tony" not in [h["subject_id"] for h in s["hits"]] and s["n"] == 100


def test_unreachable_store_gives_503_on_gallery_routes_only(
    server_factory, tmp_path: Path, lfw_root: Path, fg: SimpleNamespace
) -> None:
    url = "postgresql://nobody@127.0.0.1:1/none"  # nothing listens on port 1
    srv = server_factory(fg.make_settings(tmp_path / "d", lfw_root, gallery_url=url, gallery_open_retry_s=1.0))
    with srv.client() as c:
        pair = fg.files(img1=fg.lfw_image(lfw_root, "Colin_Powell", 1), img2=fg.lfw_image(lfw_root, "Tony_Blair", 1))
        t0 = time.monotonic()
        assert c.post("/api/compare", files=pair).status_code == 200
        assert time.monotonic() - t0 < 30
        fg.assert_error(c.get("/api/galleries"), 503, "gallery_unavailable")
        fg.assert_error(c.post("/api/galleries", json={"name": "g"}), 503, "gallery_unavailable")


def test_photo_search_is_one_engine_trip(server_factory, tmp_path: Path, lfw_root: Path, fg: SimpleNamespace) -> None:
    """With the engine's photo stage (gpu_preprocess=on, here on the CPU) a JPEG probe is decoded, detected,
    embedded and searched by the engine's photo_search stage: one trip, no separate search call."""
    srv = server_factory(fg.make_settings(tmp_path / "d", lfw_root, gpu_preprocess="on"))
    with srv.client() as c:
        assert c.post("/api/galleries", json={"name": "staff"}).status_code == 201
        photo = fg.lfw_image(lfw_root, "Colin_Powell", 1)
        assert c.post("/api/galleries/staff/subjects/colin", files=fg.many("images", [photo])).status_code == 200
        s = c.post("/api/galleries/staff/search", files=fg.files(image=photo)).json()
        assert s["hits"][0]["subject_id"] == "colin" and s["n"] == 1
        m = c.get("/metrics").text
        assert fg.parse_metric(m, "facegate_items_total", {"stage": "photo_search"}) == 1
        assert fg.parse_metric(m, "facegate_items_total", {"stage": "search"}) == 0
        fg.assert_error(
            c.post("/api/galleries/staff/search", params={"fpir": 0}, files=fg.files(image=photo)),
            422,
            "invalid_parameter",
        )
        # a blurred probe: the photo_search stage gives the crop-based reasons as embedding the photo does
        import cv2

        sharp = cv2.cvtColor(cv2.imread(str(photo)), cv2.COLOR_BGR2RGB)
        blurred = fg.jpeg_bytes(cv2.GaussianBlur(sharp, (0, 0), sigmaX=5.0))
        embedded = c.post("/api/embed", files=fg.many("images", [blurred])).json()["results"][0]["faces"][0]
        codes = [r["code"] for r in embedded["quality"]["reasons"]]
        assert "blur" in codes
        s = c.post("/api/galleries/staff/search", files=fg.files(image=blurred)).json()
        assert s["refused"] is True and s["hits"] == [] and "blur" in s["reason"]
        assert [r["code"] for r in s["face"]["quality"]["reasons"]] == codes


def test_batch_enrolment_over_http(client, lfw_root: Path, fg: SimpleNamespace) -> None:
    """Several subjects in one request; a broken photo is refused with its subject, the others enrolled."""
    import json

    assert client.post("/api/galleries", json={"name": "batch"}).status_code == 201
    photos = [
        fg.lfw_image(lfw_root, "Colin_Powell", 1),
        fg.lfw_image(lfw_root, "Colin_Powell", 2),
        fg.lfw_image(lfw_root, "Tony_Blair", 1),
        b"not an image",
    ]
    ids = ["colin", "colin", "tony", "ghost"]
    r = client.post(
        "/api/galleries/batch/enrolments", files=fg.many("images", photos), data={"subject_ids": json.dumps(ids)}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert {s["subject_id"]: s["n_embeddings"] for s in out["enrolled"]} == {"colin": 2, "tony": 1}
    assert [(x["index"], x["subject_id"]) for x in out["refused"]] == [(3, "ghost")]
    bad = client.post(
        "/api/galleries/batch/enrolments", files=fg.many("images", photos[:1]), data={"subject_ids": "[1, 2]"}
    )
    fg.assert_error(bad, 422, "invalid_parameter")
    assert client.delete("/api/galleries/batch").status_code == 200


def test_template_import_takes_its_documented_10000_rows(client, fg: SimpleNamespace) -> None:
    """The import route has a body limit of its own that fits 10,000 templates; past it an early 413, and
    every other JSON route keeps the small limit."""
    from facegate.api.limits import IMPORT_MAX_ROWS, import_max_bytes
    from facegate.config import Settings

    assert client.post("/api/galleries", json={"name": "big"}).status_code == 201
    info = client.get("/api/galleries").json()["galleries"][0]
    settings = Settings(model=info["model"])
    rng = np.random.default_rng(3)
    emb = rng.standard_normal((IMPORT_MAX_ROWS, info["dim"]))
    body = {"subject_ids": [f"subject-{i:06d}@example.org" for i in range(IMPORT_MAX_ROWS)], "embeddings": emb.tolist()}
    raw = json.dumps(body).encode()
    assert len(raw) > 100 * settings.limits.json_max_bytes  # far past the limit of other JSON routes
    r = client.post("/api/galleries/big/templates", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json() == {"imported": IMPORT_MAX_ROWS}, r.text
    assert client.get("/api/galleries").json()["galleries"][0]["subjects"] == IMPORT_MAX_ROWS
    # one byte past the limit: 413 from the declared length, before the body is read
    cap = import_max_bytes(settings)
    over = b'{"subject_ids": ["a"], "embeddings": [[' + b"0" * (cap - 40) + b"]]}"
    assert len(over) > cap
    r = client.post("/api/galleries/big/templates", content=over, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["detail"]["limit"] == cap, r.text
    # a streamed body (no declared length) is cut off at the limit as it arrives
    chunks = (over[i : i + (1 << 20)] for i in range(0, len(over), 1 << 20))
    r = client.post("/api/galleries/big/templates", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["detail"]["limit"] == cap, r.text
    small = json.dumps({"name": "x" * (settings.limits.json_max_bytes + 10)})
    r = client.post("/api/galleries", content=small, headers={"content-type": "application/json"})
    fg.assert_error(r, 413, "body_too_large")
