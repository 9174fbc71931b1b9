"""Read your writes across front-ends: an enrolment answered by one front-end is found by the very next
search through the other, and a deleted subject is never returned (a short run of
``benchmarks/gallery_visibility.py``, whose 1M-subject, 1,000-trial run is committed)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
vis = pytest.importorskip("gallery_visibility")


@pytest.mark.lfw
def test_an_enrolment_through_one_front_end_is_found_through_the_other(lfw_root: Path, tmp_path: Path) -> None:
    photos = vis.lfw_photos(lfw_root, 4)
    proc, url = vis.start(tmp_path, 2, "cpu")
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/api/galleries", json={"name": "g"})
            assert r.status_code == 201, r.text
            emb = []
            for ph in photos:
                r = c.post("/api/embed", files={"images": ("p.jpg", ph)})
                emb.append(r.json()["results"][0]["faces"][0]["embedding"])
            t = np.random.default_rng(0).standard_normal((1000, r.json()["dim"]))
            t /= np.linalg.norm(t, axis=1, keepdims=True)
            for s in range(0, 1000, 50):  # 50 templates a request: a JSON body is at most 256 KiB
                body = {"subject_ids": [f"s{i}" for i in range(s, s + 50)], "embeddings": t[s : s + 50].tolist()}
                assert c.post("/api/galleries/g/templates", json=body).json() == {"imported": 50}
        a, b, pa, pb = vis.two_front_ends(url)
        try:
            _, found, stale = vis.trials(a, b, photos, emb, 20)
            assert pa != pb and [vis.front_end_pid(a), vis.front_end_pid(b)] == [pa, pb]
        finally:
            a.close()
            b.close()
        assert (found, stale) == (20, 0)
    finally:
        vis.stop(proc)
