"""facegate.pipeline.photo_select: the photo stage's NMS, largest-face choice and alignment on the device.

On the CPU the stage runs the same tensor code (``gpu_preprocess="on"``); the answers must be the host path's.
The CUDA run is in test_photo.py's GPU test.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from facegate.config import Settings
from facegate.errors import EmptyInputError, NoFaceError
from facegate.models.nms import nms_rows
from facegate.pipeline import photo_select
from facegate.pipeline.photo import PhotoStage
from facegate.pipeline.photo_select import _greedy_nms
from facegate.pipeline.pipeline import FacePipeline
from facegate.pipeline.results import PhotoFaces

LIMITS = {"max_bytes": 1 << 24, "max_pixels": 1 << 24}


def _boxes(rng: np.random.Generator, n: int, c: int) -> np.ndarray:
    """``(n, c, 4)`` xyxy boxes in clusters (so that NMS has work, with chains of suppressions)."""
    centre = rng.uniform(20, 200, (n, 1, 2)) + rng.normal(0, 6, (n, c, 2))
    size = rng.uniform(10, 60, (n, c, 2))
    return np.concatenate([centre - size / 2, centre + size / 2], -1)


def test_device_nms_equals_the_host_rule() -> None:
    """Converged rows equal nms_rows; a chain needs one Jacobi step per link, and a short budget says so."""
    rng = np.random.default_rng(3)
    boxes = _boxes(rng, 64, 40)
    counts = rng.integers(0, 41, 64)
    valid = np.arange(40)[None] < counts[:, None]
    want = nms_rows(boxes, valid, 0.3)
    keep, converged = _greedy_nms(torch.from_numpy(boxes), torch.from_numpy(valid), 0.3, 40)
    assert bool(converged.all())
    np.testing.assert_array_equal(keep.numpy(), want)
    # a chain: box k overlaps k+1 only, so keeping 0 frees 1's suppression of 2, and so on down the chain
    chain = np.array([[[10.0 * k, 0, 10.0 * k + 20, 10] for k in range(12)]])  # IoU of neighbours 1/3
    ones = np.ones((1, 12), bool)
    want = nms_rows(chain, ones, 0.3)
    assert want[0].tolist() == [k % 2 == 0 for k in range(12)]
    _, ok_short = _greedy_nms(torch.from_numpy(chain), torch.from_numpy(ones), 0.3, 3)
    long, ok_long = _greedy_nms(torch.from_numpy(chain), torch.from_numpy(ones), 0.3, 12)
    assert not bool(ok_short[0]) and bool(ok_long[0])
    np.testing.assert_array_equal(long.numpy(), want)


@pytest.fixture(scope="module")
def pipes() -> tuple[FacePipeline, FacePipeline]:
    """The pipeline twice (CPU): the host rule below and the device selection share its models."""
    dev = FacePipeline.from_settings(Settings(device="cpu", gpu_preprocess="on"))
    return dev, dev


def _run(pipe: FacePipeline, datas: list[bytes]) -> list[object]:
    stage = PhotoStage(pipe, **LIMITS)
    payloads = [np.frombuffer(d, np.uint8) for d in datas]
    return stage.execute(stage.prepare(payloads))


def _host_rule(pipe: FacePipeline, datas: list[bytes]) -> list[object]:
    """The reference: the stage's own decode and detector canvases, then NMS, the largest face and the
    alignment on the host (the rule the stage falls back to for photos the device cannot settle exactly)."""
    from facegate.errors import FacegateError
    from facegate.pipeline import photo as ph
    from facegate.pipeline.pipeline import select_faces
    from facegate.types import Detection, FaceSelect

    stage = PhotoStage(pipe, **LIMITS)
    prepared = stage.prepare([np.frombuffer(d, np.uint8) for d in datas])
    out: list[object] = [t if isinstance(t, FacegateError) else None for t in prepared.decoded]
    chosen: dict[int, Detection] = {}
    found = pipe.detector.finish_many(prepared.det_pending)
    for (idx, _), per_batch in zip(prepared.det_batches, found, strict=True):
        for i, dets in zip(idx, per_batch, strict=True):
            try:
                chosen[i] = select_faces(dets, FaceSelect.LARGEST)[0]
            except FacegateError as exc:
                out[i] = exc
    if chosen:
        crops, owners = ph._warp({i: prepared.photos[i] for i in chosen}, chosen, pipe.photo_warp_bytes)
        crops = crops.contiguous()
        res = torch.cat([pipe.recognize(crops).float(), ph.crop_stats_torch(crops)], 1)  # as the stage packs it
        for r, i in enumerate(owners):
            out[i] = ph._photo_faces(chosen[i], res[r].cpu().numpy())
    return out


def _lfw(lfw_root: Path, n: int) -> list[bytes]:
    base = lfw_root / "lfw-deepfunneled"
    people = sorted(p.name for p in base.iterdir() if p.is_dir())
    files = [base / p / f"{p}_0001.jpg" for p in people]
    return [f.read_bytes() for f in files if f.is_file()][:n]


def _decode(data: bytes) -> np.ndarray:
    from facegate.io.decode import decode_image

    return decode_image(data, **LIMITS)


def _same(a: object, b: object) -> None:
    """The same answer: the same error class, or the same detection and (nearly) the same embedding."""
    if not isinstance(b, PhotoFaces):
        assert type(a) is type(b), (a, b)
        return
    assert isinstance(a, PhotoFaces), a
    da, db = a.detections[0], b.detections[0]
    if db is None:
        assert da is None
    else:
        assert da is not None
        np.testing.assert_array_equal(da.box, db.box)
        np.testing.assert_array_equal(da.landmarks, db.landmarks)
        assert da.score == db.score
    cos = float(a.embedding[0] @ b.embedding[0]) / float(
        np.linalg.norm(a.embedding[0]) * np.linalg.norm(b.embedding[0])
    )
    assert cos > 0.9999, cos
    assert abs(float(a.quality[0]) - float(b.quality[0])) < 1e-3


def test_device_selection_gives_the_host_paths_answers(
    pipes: tuple[FacePipeline, FacePipeline], lfw_root: Path
) -> None:
    """LFW photos (several faces in some), photos without a face (one of 112×112), errors: the same answers; then with a
    candidate budget of 1, every photo with more candidates takes the host path and still gets its answer."""
    import io

    from PIL import Image

    host, dev = pipes
    rng = np.random.default_rng(5)
    buf = io.BytesIO()
    Image.fromarray(np.full((240, 320, 3), 128, np.uint8)).save(buf, "JPEG")
    crop = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(crop, "PNG")
    datas = [*_lfw(lfw_root, 24), buf.getvalue(), crop.getvalue(), b""]
    want = _host_rule(host, datas)
    got = _run(dev, datas)
    assert isinstance(got[24], NoFaceError) and isinstance(got[26], EmptyInputError)
    assert isinstance(got[25], NoFaceError)  # a 112×112 photo of noise is detected, and holds no face
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    # two photo sizes in one detector batch (both pad to 256×256), interleaved: each size's rows are gathered by
    # index, not sliced
    import cv2

    cut = cv2.imencode(".jpg", cv2.imdecode(np.frombuffer(datas[1], np.uint8), 1)[:240])[1].tobytes()
    mixed = [datas[0], cut, datas[2], cut, datas[3]]
    assert len(dev.detector.preprocess([_decode(d) for d in mixed])) == 5
    for a, b in zip(_run(dev, mixed), _host_rule(host, mixed), strict=True):
        _same(a, b)
    # a candidate budget of 1: photos with more candidates are not exact and take the host path
    default = dev._photo_select_post
    assert default is not None
    dev._photo_select_post = functools.partial(default, candidates=1)
    try:
        pending = dev.detector.enqueue_many(
            [dev.detector.preprocess([_decode(d) for d in datas[:24]])],
            keep_on_device=True,
            post=dev._photo_select_post,
            post_args=[photo_select.geometry(dev.detector.preprocess([_decode(d) for d in datas[:24]]))],
        )
        assert pending.post_out is not None and not bool(pending.post_out[0][1][:, 1].all())  # some not exact
        again = _run(dev, datas)
    finally:
        dev._photo_select_post = default
    for a, b in zip(again, want, strict=True):
        _same(a, b)
