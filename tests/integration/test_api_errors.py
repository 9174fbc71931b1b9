"""Every error code over real HTTP: status, JSON envelope, no traceback, and the server stays up."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest


def _alive(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}


def test_input_errors(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    good = fg.lfw_image(lfw_root, "Colin_Powell", 1).read_bytes()
    grey = fg.png_bytes(fg.grey_image())

    def compare(a: bytes, b: bytes) -> httpx.Response:
        return client.post("/api/compare", files=fg.files(img1=a, img2=b))

    err = fg.assert_error(compare(b"", good), 400, "empty_input")
    assert err["detail"]["field"] == "img1" and err["detail"]["filename"] == "img1.jpg"
    err = fg.assert_error(compare(good, b"GIF89a but not really an image"), 400, "image_unreadable")
    assert err["detail"]["field"] == "img2"  # which photo to retake or rescan
    fg.assert_error(compare(good, good[: len(good) // 2]), 400, "image_unreadable")  # truncated JPEG
    assert fg.assert_error(compare(good, grey), 422, "no_face")["detail"]["field"] == "img2"
    assert fg.assert_error(compare(grey, good), 422, "no_face")["detail"]["field"] == "img1"
    fg.assert_error(client.post("/api/detect", files=fg.files(image=b"")), 400, "empty_input")
    _alive(client)


def test_too_large(client: httpx.Client, fg: SimpleNamespace) -> None:
    limit = fg.TEST_MAX_UPLOAD_BYTES
    # one part just over the per-image limit: refused while reading the upload
    err = fg.assert_error(
        client.post("/api/detect", files=fg.files(image=b"\xff" * (limit + 1))), 413, "image_too_large"
    )
    assert err["detail"]["limit"] == limit
    # a body far over what the route can take: refused from Content-Length, before parsing
    big = client.post("/api/detect", files=fg.files(image=b"\x00" * (4 * limit)))
    err = fg.assert_error(big, 413, "image_too_large")
    assert err["detail"]["bytes"] > err["detail"]["limit"]

    # the same without Content-Length (chunked): counted while streaming
    def chunks() -> Iterator[bytes]:
        yield (
            b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n"
        )
        for _ in range(8):
            yield b"\x00" * limit
        yield b"\r\n--xyz--\r\n"

    r = client.post("/api/detect", content=chunks(), headers={"content-type": "multipart/form-data; boundary=xyz"})
    fg.assert_error(r, 413, "image_too_large")

    # small bytes, too many pixels (a uniform 1000×1001 PNG compresses to a few kB)
    wide = fg.png_bytes(np.full((1001, 1000, 3), 90, np.uint8))
    assert len(wide) < limit
    fg.assert_error(client.post("/api/detect", files=fg.files(image=wide)), 413, "image_too_large")
    # a route that takes no image: its body is not an image
    big_json = b'{"name": "' + b"x" * 1_100_000 + b'"}'
    r = client.post("/api/galleries", content=big_json, headers={"content-type": "application/json"})
    fg.assert_error(r, 413, "body_too_large")
    _alive(client)


def test_an_image_past_the_pixel_limit_is_refused_alone(
    client: httpx.Client, lfw_root: Path, fg: SimpleNamespace
) -> None:
    """A decompression bomb (a ~100 kB PNG of 110 Mpx, past the request's pixel budget on its own) is refused as
    that image, by the per-image limit, with its size: embed's other image still gets its face."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (11_000, 10_000)).save(buf, "PNG")
    bomb = buf.getvalue()
    assert len(bomb) < fg.TEST_MAX_UPLOAD_BYTES
    good = fg.lfw_image(lfw_root, "Colin_Powell", 1).read_bytes()
    r = client.post("/api/embed", files=fg.many("images", [good, bomb]))
    assert r.status_code == 200, r.text
    first, second = r.json()["results"]
    assert first["faces"] and second["error"]["code"] == "image_too_large"
    assert second["error"]["detail"]["limit"] == fg.TEST_MAX_PIXELS
    err = fg.assert_error(client.post("/api/detect", files=fg.files(image=bomb)), 413, "image_too_large")
    assert err["detail"]["actual"] == 110_000_000 and err["detail"]["limit"] == fg.TEST_MAX_PIXELS
    _alive(client)


def test_parameter_errors(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    good = fg.lfw_image(lfw_root, "Colin_Powell", 1)
    # a missing part, an out-of-range query, a bad enum: FastAPI validation → 422 invalid_parameter
    err = fg.assert_error(client.post("/api/compare", files=fg.files(img1=good)), 422, "invalid_parameter")
    assert any("img2" in e["loc"] for e in err["detail"]["errors"])
    client.post("/api/galleries", json={"name": "params"})
    fg.assert_error(
        client.post("/api/galleries/params/search", params={"k": 0}, files=fg.files(image=good)),
        422,
        "invalid_parameter",
    )
    fg.assert_error(
        client.post("/api/embed", files=fg.many("images", [good]), data={"select": "biggest"}),
        422,
        "invalid_parameter",
    )
    fg.assert_error(client.post("/api/embed", data={"select": "all"}), 400, "empty_input")  # no images at all
    too_many = fg.many("images", [b"x"] * 65)
    fg.assert_error(client.post("/api/embed", files=too_many), 422, "invalid_parameter")
    fg.assert_error(client.post("/api/galleries", json={"name": "bad name!"}), 422, "invalid_parameter")
    fg.assert_error(client.post("/api/galleries", json={}), 422, "invalid_parameter")
    fg.assert_error(
        client.post("/api/galleries", content=b"{not json", headers={"content-type": "application/json"}),
        422,
        "invalid_parameter",
    )
    # JSON sent without its Content-Type (curl -d sends a form's): the error says which header to send
    r = client.post(
        "/api/galleries", content=b'{"name": "g"}', headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert "Content-Type: application/json" in fg.assert_error(r, 422, "invalid_parameter")["message"], r.text
    fg.assert_error(
        client.post("/api/galleries/params/subjects/s1", files=fg.many("images", [good]), data={"meta": "[1,2]"}),
        422,
        "invalid_parameter",
    )
    fg.assert_error(client.get("/api/nothing-here"), 404, "not_found")
    fg.assert_error(client.put("/api/compare"), 405, "method_not_allowed")
    _alive(client)


def test_gallery_errors(
    client: httpx.Client, tiny_server: SimpleNamespace, lfw_root: Path, fg: SimpleNamespace
) -> None:
    good = fg.lfw_image(lfw_root, "Colin_Powell", 1)
    fg.assert_error(client.post("/api/galleries/nope/search", files=fg.files(image=good)), 404, "gallery_not_found")
    fg.assert_error(client.get("/api/galleries/nope/subjects"), 404, "gallery_not_found")
    fg.assert_error(client.delete("/api/galleries/nope"), 404, "gallery_not_found")
    fg.assert_error(
        client.post("/api/galleries/nope/subjects/s1", files=fg.many("images", [good])), 404, "gallery_not_found"
    )
    assert client.post("/api/galleries", json={"name": "dup"}).status_code == 201
    fg.assert_error(client.post("/api/galleries", json={"name": "dup"}), 409, "gallery_exists")
    fg.assert_error(client.delete("/api/galleries/dup/subjects/ghost"), 404, "subject_not_found")
    # templates of unequal lengths: the import's 422, as for rows of the wrong dimension
    dim = next(g["dim"] for g in client.get("/api/galleries").json()["galleries"] if g["name"] == "dup")
    for rows in ([[1.0] * dim, [1.0]], [[1.0], [1.0] * dim]):
        body = {"subject_ids": ["a", "b"], "embeddings": rows}
        err = fg.assert_error(client.post("/api/galleries/dup/templates", json=body), 422, "invalid_parameter")
        assert err["detail"]["field"] == "embeddings"
    # a gallery of another model (made directly in the store): searching it with sface embeddings → 409
    tiny_server.state.gallery.store.create_gallery("other-model", "irse64_rts", 512)
    err = fg.assert_error(
        client.post("/api/galleries/other-model/search", files=fg.files(image=good)), 409, "dimension_mismatch"
    )
    assert err["detail"]["gallery_model"] == "irse64_rts"
    _alive(client)


def test_paths_outside_allowed_roots(client: httpx.Client, lfw_root: Path, fg: SimpleNamespace) -> None:
    inside = str(fg.lfw_image(lfw_root, "Colin_Powell", 1))
    for outside in (
        "/etc/passwd",
        str(lfw_root / "pairs.txt"),
        str(lfw_root / "lfw-deepfunneled" / ".." / "pairs.txt"),
    ):
        r = client.post("/api/embed", data={"paths": [inside, outside]})
        fg.assert_error(r, 403, "path_not_allowed")
    fg.assert_error(client.post("/api/embed", data={"paths": ["relative/x.jpg"]}), 403, "path_not_allowed")
    _alive(client)


def test_no_paths_without_allowed_roots(server_factory, lfw_root: Path, fg: SimpleNamespace) -> None:
    srv = server_factory(allowed_roots=[])
    with srv.client() as c:
        r = c.post("/api/embed", data={"paths": [str(fg.lfw_image(lfw_root, "Colin_Powell", 1))]})
        fg.assert_error(r, 403, "path_not_allowed")


def test_queue_full_and_deadline(server_factory, lfw_root: Path, fg: SimpleNamespace) -> None:
    """A one-slot queue answers 503 queue_full + Retry-After; a short deadline answers 504."""
    data = fg.lfw_image(lfw_root, "Colin_Powell", 1).read_bytes()
    srv = server_factory(max_queue=1, max_batch_size=1, max_wait_ms=0.0)

    async def burst(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/api/detect", files=fg.files(image=data)) for _ in range(n)))

    rs = asyncio.run(burst(24))
    codes = sorted({r.status_code for r in rs})
    assert 200 in codes and 503 in codes, codes
    full = [r for r in rs if r.status_code == 503]
    fg.assert_error(full[0], 503, "queue_full")
    assert int(full[0].headers["retry-after"]) >= 1

    slow = server_factory(request_timeout_s=0.05, max_wait_ms=400.0, max_batch_size=64)
    with slow.client() as c:
        fg.assert_error(c.post("/api/detect", files=fg.files(image=data)), 504, "deadline_exceeded")
        _alive(c)


def test_unexpected_exception_is_a_clean_500(server_factory, lfw_root: Path, fg: SimpleNamespace, caplog) -> None:
    """A non-facegate exception inside a route: JSON 500 internal_error, traceback only in the log."""
    srv = server_factory()
    service = srv.state.service

    async def broken_detect(image: np.ndarray) -> list:
        raise RuntimeError("simulated bug deep inside")

    service.detect = broken_detect  # fault injection on the real service instance
    with srv.client() as c, caplog.at_level("ERROR", logger="facegate.api.app"):
        r = c.post("/api/detect", files=fg.files(image=fg.lfw_image(lfw_root, "Colin_Powell", 1)))
        err = fg.assert_error(r, 500, "internal_error")
        assert "simulated bug" not in r.text
        assert err["detail"] == {}
        _alive(c)
        m = c.get("/metrics").text
        assert fg.parse_metric(m, "facegate_requests_total", {"route": "POST /api/detect", "status": "500"}) == 1
    assert any("simulated bug deep inside" in (rec.exc_text or "") for rec in caplog.records)


@pytest.mark.slow
def test_model_error_at_startup(server_factory, tmp_path: Path, fg: SimpleNamespace) -> None:
    """Weights that cannot be loaded: /healthz 200, /readyz 503, API 500 model_error (clean JSON)."""
    bad = tmp_path / "missing_pytorch_model.pt"
    srv = server_factory(tiny=False, ready=False, rts_checkpoint=bad)
    with srv.client() as c:
        for _ in range(600):
            if srv.state.load_error is not None:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert srv.state.load_error is not None
        assert c.get("/healthz").status_code == 200
        err = fg.assert_error(c.get("/readyz"), 503, "engine_closed")
        assert err["detail"]["cause"]["code"] == srv.state.load_error.code
        r = c.post("/api/compare", files=fg.files(img1=b"x", img2=b"y"))
        assert r.status_code == 500
        assert r.json()["error"]["code"] == srv.state.load_error.code
        assert "Traceback" not in r.text


@pytest.mark.slow
def test_serve_exits_when_models_cannot_load(tmp_path: Path, fg: SimpleNamespace) -> None:
    """`facegate serve` (→ run(settings)) with unloadable weights stops and exits 1 with a JSON error (a file that
    is not there is bad input instead: exit 2, tests/unit/test_cli.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACEGATE_")}
    (broken := tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    cmd = [
        sys.executable, "-m", "facegate", "serve", "--port", str(fg.free_port()), "--device", "cpu",
        "--data-dir", str(tmp_path / "data"), "--rts-checkpoint", str(broken),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=180, check=False)
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1, stderr[-3000:]
    last = [line for line in stderr.splitlines() if line.startswith("{")][-1]
    err = json.loads(last)["error"]
    assert err["code"] in {"model_error", "weights_not_found", "checkpoint_mismatch"}, err
    assert "Traceback" not in stderr


def test_every_error_class_maps_to_the_documented_status() -> None:
    """serving.errors is the one mapping; every class of the tree resolves to the status of the contract."""
    import facegate.errors as E
    from facegate.api.errors import facegate_error_response

    expected = {
        E.EmptyInputError: 400, E.ImageDecodeError: 400, E.InputError: 400, E.ImageTooLargeError: 413,
        E.NoFaceError: 422, E.QualityRejectedError: 422, E.InvalidParameterError: 422,
        E.PathNotAllowedError: 403, E.GalleryNotFoundError: 404, E.SubjectNotFoundError: 404,
        E.GalleryExistsError: 409, E.DimensionMismatchError: 409, E.QueueFullError: 503,
        E.DeadlineExceededError: 504, E.EngineClosedError: 503, E.ModelError: 500, E.WeightsNotFoundError: 500,
        E.WeightsIntegrityError: 500, E.CheckpointError: 500, E.GalleryError: 500, E.EngineError: 503,
        E.GalleryUnavailableError: 503, E.ErasureIncompleteError: 503, E.ServerError: 500,
        E.BodyTooLargeError: 413, E.UnauthorizedError: 401, E.ForbiddenError: 403, E.OriginNotAllowedError: 403,
        E.HostNotAllowedError: 400, E.RateLimitedError: 429, E.OverloadedError: 503, E.KeysFileError: 500,
        E.FacegateError: 500,
    }  # fmt: skip
    classes = [getattr(E, n) for n in E.__all__ if issubclass(getattr(E, n), E.FacegateError)]
    assert set(classes) <= set(expected), set(classes) - set(expected)
    for cls, status in expected.items():
        exc = cls("x", retry_after_s=2.5) if cls in (E.QueueFullError, E.OverloadedError) else cls("x")
        assert facegate_error_response(exc).status_code == status, cls
