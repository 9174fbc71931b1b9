"""Galleries over HTTP: lifecycle, enrolment refusals, the quality gate, and a restart with real models."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from facegate.config import Settings
from facegate.tuning import make_plan

GALLERY_KEYS = {"name", "model", "dim", "subjects", "created_at"}
SUBJECT_KEYS = {"subject_id", "n_embeddings", "template_quality", "meta", "created_at", "updated_at"}


def test_gallery_lifecycle(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    img = lambda name, n=1: fg.lfw_image(lfw_root, name, n)  # noqa: E731
    r = client.post("/api/galleries", json={"name": "staff"})
    assert r.status_code == 201, r.text
    g = r.json()
    assert set(g) == GALLERY_KEYS
    assert (g["name"], g["model"], g["dim"], g["subjects"]) == ("staff", "sface-tiny", 128, 0)
    assert "staff" in [x["name"] for x in client.get("/api/galleries").json()["galleries"]]

    r = client.post(
        "/api/galleries/staff/subjects/colin",
        files=fg.many("images", [img("Colin_Powell", 1), img("Colin_Powell", 2)]),
        data={"meta": '{"team": "state", "n": 1}'},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == 2 and body["refused"] == []
    assert set(body["subject"]) == SUBJECT_KEYS
    assert body["subject"]["subject_id"] == "colin" and body["subject"]["n_embeddings"] == 2
    assert body["subject"]["meta"] == {"team": "state", "n": 1}
    assert 0.0 <= body["subject"]["template_quality"] <= 1.0
    r = client.post("/api/galleries/staff/subjects/tony", files=fg.many("images", [img("Tony_Blair", 1)]))
    assert r.status_code == 200 and r.json()["subject"]["meta"] == {}
    # adding images to an existing subject appends embeddings
    r = client.post("/api/galleries/staff/subjects/colin", files=fg.many("images", [img("Colin_Powell", 3)]))
    assert r.json()["subject"]["n_embeddings"] == 3
    assert r.json()["subject"]["meta"] == {"team": "state", "n": 1}  # meta kept when not given

    page = client.get("/api/galleries/staff/subjects").json()
    assert page["total"] == 2 and [s["subject_id"] for s in page["subjects"]] == ["colin", "tony"]
    page = client.get("/api/galleries/staff/subjects", params={"offset": 1, "limit": 1}).json()
    assert page["total"] == 2 and [s["subject_id"] for s in page["subjects"]] == ["tony"]
    gal = next(x for x in client.get("/api/galleries").json()["galleries"] if x["name"] == "staff")
    assert gal["subjects"] == 2

    # tony's template is the single embedding of Tony_Blair_0001: searching with that photo scores ~1
    r = client.post("/api/galleries/staff/search", params={"k": 5}, files=fg.files(image=img("Tony_Blair", 1)))
    assert r.status_code == 200, r.text
    s = r.json()
    assert set(s) == {"face", "refused", "reason", "hits", "threshold", "fmr", "fpir", "n", "extrapolated"}
    assert s["n"] == 2 and [h["rank"] for h in s["hits"]] == [1, 2]
    assert s["fpir"] == pytest.approx(1 - (1 - s["fmr"]) ** 2, rel=1e-6) and s["fpir"] <= 1e-2 * 1.001
    assert s["refused"] is False and s["reason"] is None
    assert s["face"]["quality"]["accepted"] is True
    assert s["hits"][0]["subject_id"] == "tony" and len(s["hits"]) == 2
    assert s["hits"][0]["score"] == pytest.approx(1.0, abs=1e-4) and s["hits"][0]["match"] is True
    assert all(h["match"] == (h["score"] >= s["threshold"]) for h in s["hits"])
    assert s["hits"][0]["score"] >= s["hits"][1]["score"]
    r1 = client.post("/api/galleries/staff/search", params={"k": 1}, files=fg.files(image=img("Tony_Blair", 1)))
    assert len(r1.json()["hits"]) == 1
    lax = client.post("/api/galleries/staff/search", params={"fpir": 0.5}, files=fg.files(image=img("Tony_Blair", 1)))
    assert lax.status_code == 200 and lax.json()["threshold"] <= s["threshold"]
    bad = client.post("/api/galleries/staff/search", params={"fpir": 2}, files=fg.files(image=img("Tony_Blair", 1)))
    assert bad.status_code == 422 and "error" in bad.json()

    m = client.get("/metrics").text
    assert (
        fg.parse_metric(m, "facegate_gallery_subjects") == 2
    )  # the total: names only with security.metrics_gallery_labels
    assert 'gallery="staff"' not in m

    assert client.delete("/api/galleries/staff/subjects/tony").json() == {"deleted": "tony"}
    s = client.post("/api/galleries/staff/search", files=fg.files(image=img("Tony_Blair", 1))).json()
    assert [h["subject_id"] for h in s["hits"]] == ["colin"]
    assert client.get("/api/galleries/staff/subjects").json()["total"] == 1

    assert client.delete("/api/galleries/staff").json() == {"deleted": "staff"}
    assert "staff" not in [x["name"] for x in client.get("/api/galleries").json()["galleries"]]
    fg.assert_error(client.get("/api/galleries/staff/subjects"), 404, "gallery_not_found")


def test_enrolment_reports_refused_images(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    assert client.post("/api/galleries", json={"name": "partial"}).status_code == 201
    parts = [fg.lfw_image(lfw_root, "Donald_Rumsfeld", 1), b"not an image", fg.png_bytes(fg.grey_image())]
    r = client.post("/api/galleries/partial/subjects/donald", files=fg.many("images", parts))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["accepted"] == 1 and body["subject"]["n_embeddings"] == 1
    assert [(x["index"], x["code"]) for x in body["refused"]] == [(1, "image_unreadable"), (2, "no_face")]
    assert all(x["reason"] for x in body["refused"])
    # nothing usable at all: the first image's error, with the list of refusals
    r = client.post("/api/galleries/partial/subjects/nobody", files=fg.many("images", [b"junk"]))
    err = fg.assert_error(r, 400, "image_unreadable")
    assert err["detail"]["refused"][0]["index"] == 0
    fg.assert_error(
        client.post("/api/galleries/partial/subjects/bad%20id", files=fg.many("images", parts[:1])),
        422,
        "invalid_parameter",
    )


def test_quality_gate(client: httpx.Client, server_factory, lfw_root: Path, fg: SimpleNamespace) -> None:
    """With the gate between two faces' scores: compare refuses, enrolment refuses, search refuses."""
    candidates = [fg.lfw_image(lfw_root, p, n) for p in fg.PEOPLE for n in (1, 2)]
    res = client.post("/api/embed", files=fg.many("images", candidates)).json()["results"]
    scores = [x["faces"][0]["quality"]["score"] for x in res]
    hi_i, lo_i = int(np.argmax(scores)), int(np.argmin(scores))
    assert scores[hi_i] - scores[lo_i] > 1e-4, scores
    good, poor = candidates[hi_i], candidates[lo_i]
    gate = (scores[hi_i] + scores[lo_i]) / 2

    # the enrolment gate is stricter by default; here it is the verify gate, so one face passes both
    srv = server_factory(quality_threshold=gate, quality={"enrol_gate": gate}, allowed_roots=[lfw_root])
    with srv.client() as c:
        r = c.post("/api/compare", files=fg.files(img1=good, img2=poor)).json()
        assert r["refused"] is True and r["verdict"] == "refused"
        assert r["similarity"] is None and r["match"] is None
        assert r["reason"] and "img2" in r["reason"] and "img1" not in r["reason"]
        q1, q2 = r["faces"][0]["quality"], r["faces"][1]["quality"]
        assert q1["accepted"] is True and q2["accepted"] is False and q2["reason"]
        assert q1["threshold"] == pytest.approx(gate) and q2["score"] < gate <= q1["score"]
        ok = c.post("/api/compare", files=fg.files(img1=good, img2=good)).json()
        assert ok["refused"] is False and ok["verdict"] == "match"

        assert c.post("/api/galleries", json={"name": "gate"}).status_code == 201
        r = c.post("/api/galleries/gate/subjects/a", files=fg.many("images", [good, poor]))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["accepted"] == 1 and body["subject"]["n_embeddings"] == 1
        assert [(x["index"], x["code"]) for x in body["refused"]] == [(1, "low_quality")]
        err = fg.assert_error(
            c.post("/api/galleries/gate/subjects/b", files=fg.many("images", [poor])), 422, "low_quality"
        )
        assert err["detail"]["refused"] == [
            {"index": 0, "reason": err["detail"]["refused"][0]["reason"], "code": "low_quality"}
        ]
        fg.assert_error(c.get("/api/galleries/gate/subjects/b"), 405, "method_not_allowed")
        assert c.get("/api/galleries/gate/subjects").json()["total"] == 1

        s = c.post("/api/galleries/gate/search", files=fg.files(image=poor)).json()
        assert s["refused"] is True and s["hits"] == [] and s["reason"]
        assert s["face"]["quality"]["accepted"] is False
        s = c.post("/api/galleries/gate/search", files=fg.files(image=good)).json()
        assert s["refused"] is False and s["hits"][0]["subject_id"] == "a"

        m = c.get("/metrics").text
        for reason in ("compare_low_quality", "enrol_low_quality", "search_low_quality"):
            assert fg.parse_metric(m, "facegate_refusals_total", {"reason": reason}) >= 1, reason
        assert fg.parse_metric(m, "facegate_quality_score_count") >= 8

    # enrol_requires_quality=False: a low-quality face is enrolled
    lax = server_factory(quality_threshold=gate, enrol_requires_quality=False)
    with lax.client() as c:
        assert c.post("/api/galleries", json={"name": "lax"}).status_code == 201
        r = c.post("/api/galleries/lax/subjects/b", files=fg.many("images", [poor]))
        assert r.status_code == 200 and r.json()["accepted"] == 1 and r.json()["refused"] == []

    # between the gates: the verify gate accepts the face, enrolment refuses it and names the enrolment gate
    strict = server_factory(quality_threshold=scores[lo_i] / 2, quality={"enrol_gate": gate})
    with strict.client() as c:
        assert c.post("/api/compare", files=fg.files(img1=poor, img2=poor)).json()["refused"] is False
        assert c.post("/api/galleries", json={"name": "strict"}).status_code == 201
        r = c.post("/api/galleries/strict/subjects/b", files=fg.many("images", [poor]))
        err = fg.assert_error(r, 422, "low_quality")
        assert "enrolment gate" in err["detail"]["refused"][0]["reason"], err


def test_a_busy_gallery_file_degrades_then_recovers(
    server_factory, tmp_path: Path, lfw_root: Path, fg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the gallery's SQLite write lock past gallery_open_retry_s at start-up: the server
    is ready and compares, gallery routes answer 503 gallery_unavailable, and once the lock is released the
    background retry opens the gallery."""
    import sqlite3
    import time

    from facegate.api import app as app_mod
    from facegate.gallery.sqlite import SQLiteGalleryStore

    monkeypatch.setattr(app_mod, "GALLERY_REOPEN_S", 0.2)
    data = tmp_path / "busy"
    SQLiteGalleryStore(data / "gallery.sqlite3").close()
    holder = sqlite3.connect(data / "gallery.sqlite3", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        srv = server_factory(fg.make_settings(data, lfw_root, gallery_open_retry_s=0.2))
        with srv.client() as c:
            assert c.get("/readyz").status_code == 200
            pair = fg.files(
                img1=fg.lfw_image(lfw_root, "Colin_Powell", 1), img2=fg.lfw_image(lfw_root, "Tony_Blair", 1)
            )
            assert c.post("/api/compare", files=pair).status_code == 200
            err = fg.assert_error(c.get("/api/galleries"), 503, "gallery_unavailable")
            assert err["detail"]["cause"]["detail"]["sqlite_errorname"] == "SQLITE_BUSY"
            holder.execute("COMMIT")
            deadline = time.monotonic() + 30
            while (r := c.get("/api/galleries")).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert r.status_code == 200 and r.json()["galleries"] == [], r.text
            assert c.post("/api/galleries", json={"name": "staff"}).status_code == 201
            assert srv.state.gallery_error is None
    finally:
        holder.close()


@pytest.mark.slow
def test_restart_keeps_the_gallery_real_models(tmp_path: Path, lfw_root: Path, fg: SimpleNamespace) -> None:
    """`run(settings)` in a child process with the real default models; the gallery survives a restart."""
    img = lambda name, n=1: fg.lfw_image(lfw_root, name, n)  # noqa: E731
    first = fg.ServeProcess(tmp_path)
    try:
        ready = first.wait_ready()
        precision = make_plan(Settings(device="cpu")).precision  # bf16 on a CPU with AMX, else fp32
        assert ready == {"status": "ready", "model": "sface", "device": "cpu", "precision": precision}
        with first.client() as c:
            # the real model separates people: same person matches, different people do not
            same = c.post("/api/compare", files=fg.files(img1=img("Colin_Powell", 1), img2=img("Colin_Powell", 3)))
            diff = c.post("/api/compare", files=fg.files(img1=img("Colin_Powell", 1), img2=img("Tony_Blair", 1)))
            assert same.json()["verdict"] == "match", same.text
            assert diff.json()["verdict"] == "no_match", diff.text
            assert same.json()["similarity"] > diff.json()["similarity"] + 0.2

            assert c.post("/api/galleries", json={"name": "people"}).status_code == 201
            for sid, name in (("colin", "Colin_Powell"), ("tony", "Tony_Blair"), ("george", "George_W_Bush")):
                r = c.post(
                    f"/api/galleries/people/subjects/{sid}", files=fg.many("images", [img(name, 1), img(name, 2)])
                )
                assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
            before = c.post(
                "/api/galleries/people/search", params={"k": 3}, files=fg.files(image=img("Colin_Powell", 4))
            )
            assert before.status_code == 200, before.text
            hits_before = before.json()["hits"]
            assert hits_before[0]["subject_id"] == "colin" and hits_before[0]["match"] is True
            assert all(not h["match"] for h in hits_before[1:])
    finally:
        rc = first.stop()
    # graceful shutdown: uvicorn runs the lifespan's shutdown, then re-raises SIGTERM (rc -15) or exits 0
    assert rc in (0, -signal.SIGTERM), first.log()[-3000:]
    assert "facegate stopped" in first.log() and "Traceback" not in first.log()

    second = fg.ServeProcess(tmp_path)
    try:
        second.wait_ready()
        with second.client() as c:
            gal = c.get("/api/galleries").json()["galleries"]
            assert [(g["name"], g["subjects"]) for g in gal] == [("people", 3)]
            after = c.post(
                "/api/galleries/people/search", params={"k": 3}, files=fg.files(image=img("Colin_Powell", 4))
            )
            hits_after = after.json()["hits"]
            assert [h["subject_id"] for h in hits_after] == [h["subject_id"] for h in hits_before]
            for a, b in zip(hits_after, hits_before, strict=True):
                assert a["score"] == pytest.approx(b["score"], abs=1e-6)
                assert a["match"] == b["match"]
    finally:
        assert second.stop() in (0, -signal.SIGTERM)


def test_names_a_url_path_cannot_carry_are_refused(
    client: httpx.Client, fg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'.' and '..' are dot-segments: browsers, curl and httpx resolve them away, so DELETE
    /api/galleries/g/subjects/.. reaches DELETE /api/galleries/g (the whole gallery). They are refused as new
    gallery names and subject ids; one already stored can still be deleted (percent-encoded)."""
    for name in (".", ".."):
        fg.assert_error(client.post("/api/galleries", json={"name": name}), 422, "invalid_parameter")
    assert client.post("/api/galleries", json={"name": "dots"}).status_code == 201
    row = [1.0] + [0.0] * 127
    for sid in (".", ".."):
        r = client.post("/api/galleries/dots/templates", json={"subject_ids": [sid], "embeddings": [row]})
        fg.assert_error(r, 422, "invalid_parameter")
        ids = {"subject_ids": f'["{sid}"]'}
        r = client.post("/api/galleries/dots/enrolments", files=fg.many("images", [b"x"]), data=ids)
        fg.assert_error(r, 422, "invalid_parameter")
        r = client.post(f"/api/galleries/dots/subjects/{sid.replace('.', '%2E')}", files=fg.many("images", [b"x"]))
        fg.assert_error(r, 422, "invalid_parameter")
    assert client.get("/api/galleries/dots/subjects").json()["total"] == 0
    # names with dots that are not dot-segments stay valid
    r = client.post("/api/galleries/dots/templates", json={"subject_ids": ["...", "a.b"], "embeddings": [row, row]})
    assert r.status_code == 200, r.text
    # a '..' stored before this rule: still deletable, percent-encoded, and only it goes
    from facegate.gallery import base

    with monkeypatch.context() as m:
        m.setattr(base, "DOT_SEGMENTS", frozenset())
        r = client.post("/api/galleries/dots/templates", json={"subject_ids": [".."], "embeddings": [row]})
        assert r.status_code == 200, r.text
    assert client.delete("/api/galleries/dots/subjects/%2E%2E").json() == {"deleted": ".."}
    assert [s["subject_id"] for s in client.get("/api/galleries/dots/subjects").json()["subjects"]] == ["...", "a.b"]
    assert client.delete("/api/galleries/dots").status_code == 200


def test_a_vanishingly_small_fpir_is_answered_not_a_500(
    tiny_server, client: httpx.Client, lfw_root: Path, fg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fpir=5e-324 passes the route's (0, 1) check; at n > 1 its FMR* underflows to 0, which crashed the
    threshold of a model with an impostor table (sface's: the default model)."""
    from facegate.service.fpir import ImpostorTail

    tail = ImpostorTail.load("sface", fallback=(0.0, 1.0))
    assert tail.basis == "lfw_impostors"  # sface's table, not the fallback
    monkeypatch.setattr(tiny_server.state.gallery, "tail", tail)
    assert client.post("/api/galleries", json={"name": "tiny-fpir"}).status_code == 201
    rows = np.eye(2, 128).tolist()
    r = client.post("/api/galleries/tiny-fpir/templates", json={"subject_ids": ["a", "b"], "embeddings": rows})
    assert r.status_code == 200, r.text
    probe = fg.files(image=fg.lfw_image(lfw_root, "Colin_Powell", 1))
    r = client.post("/api/galleries/tiny-fpir/search?fpir=5e-324", files=probe)
    assert r.status_code == 200, r.text
    assert r.json()["threshold"] == 1.0 and r.json()["extrapolated"] is True and r.json()["n"] == 2
    assert client.delete("/api/galleries/tiny-fpir").status_code == 200
