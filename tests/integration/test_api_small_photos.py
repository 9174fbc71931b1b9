"""A 112×112 photo is a photo: only ``aligned=true`` marks an upload as an aligned crop (real default models)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np
import pytest


@pytest.mark.parametrize("gpu_preprocess", ["off", "on"])
def test_a_112_pixel_photo_is_detected_and_matches_its_source(
    server_factory: Any, lfw_root: Path, fg: SimpleNamespace, gpu_preprocess: str
) -> None:
    """Sent without ``aligned=true``, an LFW photo shrunk to 112×112 is detected by compare, embed and detect
    alike (host path and the engine's photo stage), and matches the photo it was shrunk from."""
    srv = server_factory(lfw_root=lfw_root, tiny=False, gpu_preprocess=gpu_preprocess)
    source = fg.lfw_image(lfw_root, "Colin_Powell", 1)
    rgb = cv2.cvtColor(cv2.imread(str(source)), cv2.COLOR_BGR2RGB)
    small = fg.jpeg_bytes(cv2.resize(rgb, (112, 112), interpolation=cv2.INTER_AREA), quality=95)
    with srv.client() as c:
        r = c.post("/api/compare", files=fg.files(img1=small, img2=source))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["refused"] is False, body["reason"]
        assert body["verdict"] == "match", body["similarity"]
        assert 0.9 < body["reliability"] <= 1.0  # a clear match of two good faces: the verdict is very likely right
        face = body["faces"][0]
        assert face["detection"] is not None

        det = c.post("/api/detect", files=fg.files(image=small)).json()
        emb = c.post("/api/embed", files=fg.many("images", [small])).json()["results"][0]
        assert det["width"] == det["height"] == 112 and len(det["faces"]) >= 1
        assert emb["faces"][0]["detection"] is not None
        largest = max(det["faces"], key=lambda d: (d["box"][2] - d["box"][0]) * (d["box"][3] - d["box"][1]))
        np.testing.assert_allclose(emb["faces"][0]["detection"]["box"], largest["box"], atol=0.5)
        np.testing.assert_allclose(face["detection"]["box"], largest["box"], atol=0.5)

        # the same bytes with aligned=true are taken as a crop, as the client said: no detection
        crop = c.post("/api/embed", files=fg.many("images", [small]), data={"aligned": "true"}).json()
        assert crop["results"][0]["faces"][0]["detection"] is None


def test_enrolment_has_its_own_stricter_gate_and_names_the_reasons(
    server_factory: Any, lfw_root: Path, fg: SimpleNamespace
) -> None:
    """Real models: an enrolment photo is held to the enrolment gate and the reasons' limits, and a refused one
    is listed with what to fix; a good photo enrols."""
    srv = server_factory(lfw_root=lfw_root, tiny=False)
    assert srv.state.service.pipeline.enrol_threshold > srv.state.service.pipeline.operating.quality_threshold
    source = fg.lfw_image(lfw_root, "Colin_Powell", 1)
    rgb = cv2.cvtColor(cv2.imread(str(source)), cv2.COLOR_BGR2RGB)
    tiny = fg.png_bytes(cv2.resize(rgb, (56, 56), interpolation=cv2.INTER_AREA))
    with srv.client() as c:
        assert c.post("/api/galleries", json={"name": "staff"}).status_code == 201
        r = c.post("/api/galleries/staff/subjects/colin", files=fg.many("images", [source, tiny]))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["accepted"] == 1 and [x["index"] for x in body["refused"]] == [1]
        assert body["refused"][0]["code"] == "low_quality"
        assert "px between the eyes" in body["refused"][0]["reason"], body["refused"][0]
