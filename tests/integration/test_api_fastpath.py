"""The aligned-crop fast path (api.routes.serve_embed_aligned) gives the route's own answers.

One tiny-model server answers every request twice, with the fast path and with it switched off below the app
(the route alone): the same status and JSON, and the fast path answers without FastAPI's route.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import httpx
import numpy as np
import pytest
from PIL import Image

from facegate.api.forms import aligned_images, parse_small_multipart, wants_fast_path


def _jpeg(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def crops(lfw_root: Path) -> list[bytes]:
    base = lfw_root / "lfw-deepfunneled"
    out = []
    for name in ("Colin_Powell", "Tony_Blair", "Gerhard_Schroeder"):
        rgb = cv2.imread(str(base / name / f"{name}_0001.jpg"))[69:181, 69:181, ::-1]
        out.append(_jpeg(np.ascontiguousarray(rgb)))
    return out


def _requests(crops: list[bytes], fg: SimpleNamespace) -> list[dict[str, Any]]:
    """Form bodies: fast-path ones (aligned crops) and ones FastAPI must keep (other fields, bad values)."""
    big = cv2.resize(cv2.imdecode(np.frombuffer(crops[0], np.uint8), cv2.IMREAD_COLOR), (200, 200))
    return [
        {"files": fg.many("images", crops[:1]), "data": {"aligned": "true"}},
        {"files": fg.many("images", crops), "data": {"aligned": "True", "select": "all"}},
        {"files": fg.many("images", [crops[0], b"junk", b"", fg.png_bytes(big)]), "data": {"aligned": "1"}},
        {"files": fg.many("images", crops[:1]), "data": {"aligned": "false"}},  # detection: FastAPI
        {"files": fg.many("images", crops[:1]), "data": {"aligned": "maybe"}},  # 422 from FastAPI
        {"files": fg.many("images", crops[:1]), "data": {"aligned": "true", "select": "best"}},  # 422
        {"files": fg.many("images", crops[:1]), "data": {"aligned": "true", "paths": "x.jpg"}},  # 422 / 403
        {"files": fg.many("images", crops * 22), "data": {"aligned": "true"}},  # 66 > 64: 422
        {"files": fg.many("photos", crops[:1]), "data": {"aligned": "true"}},  # no images: 400
    ]


def _answers(client: httpx.Client, requests: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    return [(r.status_code, r.json()) for r in (client.post("/api/embed", **kw) for kw in requests)]


def _pop_embeddings(answer: Any) -> list[list[float]]:
    """Take the embeddings out of an embed answer (in order), leaving the rest to compare exactly."""
    faces = [f for r in answer.get("results", []) for f in r.get("faces") or []]
    return [f.pop("embedding") for f in faces if "embedding" in f]


def test_fast_path_answers_as_the_route_does(
    server_factory: Callable[..., Any], crops: list[bytes], fg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import facegate.api.app

    srv = server_factory()
    requests = _requests(crops, fg)
    with srv.client() as c:
        got = _answers(c, requests)
        monkeypatch.setattr(facegate.api.app, "wants_fast_path", lambda scope: False)  # every request: the route
        want = _answers(c, requests)
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        # the engine may batch a request's crops differently each time, which moves an embedding's last digits
        g_emb, w_emb = _pop_embeddings(g), _pop_embeddings(w)
        assert g == w
        assert len(g_emb) == len(w_emb)
        for a, b in zip(g_emb, w_emb, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert [w[0] for w in want][:3] == [200, 200, 200]
    codes = [[x.get("error", {}).get("code") for x in want[2][1]["results"]]]
    assert codes == [[None, "image_unreadable", "empty_input", "invalid_parameter"]]  # per item, not the request


def test_the_fast_path_does_not_use_the_route(
    server_factory: Callable[..., Any], crops: list[bytes], fg: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastapi.routing

    solved: list[str] = []
    original = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kw: Any) -> Any:  # FastAPI solves a route's parameters once per request
        if kw["request"].url.path == "/api/embed":
            solved.append(kw["request"].url.path)
        return await original(*args, **kw)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    fast = server_factory()
    with fast.client() as c:
        ok = c.post("/api/embed", files=fg.many("images", crops[:2]), data={"aligned": "true"})
        assert ok.status_code == 200 and len(ok.json()["results"]) == 2
        assert solved == []
        other = c.post("/api/embed", files=fg.many("images", crops[:1]), data={"aligned": "false"})
        assert other.status_code == 200 and solved == ["/api/embed"]  # left to FastAPI
        metrics = c.get("/metrics").text
    # both counted under the route's template
    line = next(ln for ln in metrics.splitlines() if ln.startswith("facegate_requests_total") and "/api/embed" in ln)
    assert line.endswith(" 2.0"), line


def test_the_fast_path_keeps_the_access_checks_and_the_admission_bound(
    server_factory: Callable[..., Any],
    crops: list[bytes],
    fg: SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With API keys configured, an aligned-crop embed needs a read key (it once bypassed the checks), and an
    admitted one counts against the admission bound while it runs."""
    import facegate.api.app
    from facegate.api.limits import STATE_KEY
    from facegate.service.keys import KeyStore

    data = tmp_path / "keyed"
    token = KeyStore(data).create("reader", ["read"])[0]
    srv = server_factory(fg.make_settings(data))
    admitted: list[int] = []
    serve = facegate.api.app.serve_embed_aligned

    async def spying(state: Any, scope: Any, receive: Any, send: Any) -> Any:
        admitted.append(scope["state"][STATE_KEY].admitted)  # this process's Admission (api.limits)
        return await serve(state, scope, receive, send)

    monkeypatch.setattr(facegate.api.app, "serve_embed_aligned", spying)
    form = {"files": fg.many("images", crops[:1]), "data": {"aligned": "true"}}
    with srv.client() as c:
        fg.assert_error(c.post("/api/embed", **form), 401, "unauthorized")
        fg.assert_error(c.post("/api/embed", headers={"Origin": "http://[::1"}, **form), 403, "origin_not_allowed")
        assert admitted == []  # refused before the fast path
        ok = c.post("/api/embed", headers={"Authorization": f"Bearer {token}"}, **form)
    assert ok.status_code == 200 and len(ok.json()["results"]) == 1, ok.text
    assert admitted == [1]


def test_which_requests_qualify() -> None:
    def scope(path: str = "/api/embed", ctype: bytes = b"multipart/form-data; boundary=x", n: int = 10) -> dict:
        return {"method": "POST", "path": path, "headers": [(b"content-type", ctype), (b"content-length", b"%d" % n)]}

    assert wants_fast_path(scope())
    assert not wants_fast_path(scope(path="/api/compare"))
    assert not wants_fast_path(scope(ctype=b"application/json"))
    assert not wants_fast_path(scope(n=1 << 30))

    def form(*parts: tuple[str, str, bytes]) -> object:
        body = b"".join(
            b'--x\r\nContent-Disposition: form-data; name="%s"%s\r\n\r\n%s\r\n'
            % (n.encode(), b'; filename="%s"' % f.encode() if f else b"", v)
            for n, f, v in parts
        )
        return parse_small_multipart(body + b"--x--\r\n", "multipart/form-data; boundary=x")

    img = ("images", "a.jpg", b"\xff\xd8")
    assert len(aligned_images(form(img, img, ("aligned", "", b"yes")), 64) or []) == 2
    assert aligned_images(form(img, ("aligned", "", b"true")), 1) is not None
    assert aligned_images(form(img, img, ("aligned", "", b"true")), 1) is None  # over the limit
    assert aligned_images(form(img), 64) is None  # not aligned
    assert aligned_images(form(img, ("aligned", "", b"true"), ("aligned", "", b"true")), 64) is None
    assert aligned_images(form(("images", "", b"text"), ("aligned", "", b"true")), 64) is None  # not a file
