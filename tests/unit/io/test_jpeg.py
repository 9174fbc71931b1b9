"""facegate.io.jpeg: the marker walker answers as Pillow does, or hands the file to Pillow."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from facegate.io.decode import _gpu_candidate, _gpu_candidate_pil
from facegate.io.jpeg import NotPlain, read_jpeg_header

BIG = 10**9


def _jpeg(mode: str = "RGB", size: tuple[int, int] = (40, 30), **kw: object) -> bytes:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def _exif(orientation: int, big_endian: bool = False) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F] = "maker"  # another IFD0 entry before or after it
    return exif.tobytes(0) if not big_endian else b"Exif\x00\x00" + _tiff_mm(orientation)


def _tiff_mm(orientation: int) -> bytes:
    """A big-endian TIFF with one IFD0 entry (Pillow writes little-endian)."""
    entry = b"\x01\x12\x00\x03\x00\x00\x00\x01" + bytes([0, orientation, 0, 0])
    return b"MM\x00\x2a\x00\x00\x00\x08\x00\x01" + entry + b"\x00\x00\x00\x00"


#: An APP1 EXIF block whose IFD0 is empty.
_EMPTY_EXIF = b"Exif\x00\x00II*\x00\x08\x00\x00\x00" + b"\x00\x00" + b"\x00\x00\x00\x00"


def _segment(marker: int, body: bytes) -> bytes:
    """SOI + one marker segment (the rest of a file follows without its SOI)."""
    return b"\xff\xd8" + bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


def _both(data: bytes) -> tuple[object, object]:
    return _gpu_candidate(data, BIG, BIG), _gpu_candidate_pil(data, BIG)


@pytest.mark.parametrize("orientation", range(0, 10))
@pytest.mark.parametrize("big_endian", [False, True])
def test_exif_orientation_as_pillow(orientation: int, big_endian: bool) -> None:
    data = _jpeg(exif=_exif(orientation, big_endian))
    hdr = read_jpeg_header(data)  # plain: answered here
    assert hdr.orientation == (orientation if 1 <= orientation <= 8 else 1)
    fast, pil = _both(data)
    assert fast == pil == (hdr.orientation, 30, 40)


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("grey", _jpeg("L")),
        ("progressive", _jpeg(progressive=True)),
        ("optimised 4:4:4", _jpeg(optimize=True, subsampling=0)),
        ("big", _jpeg(size=(1200, 900))),
        ("icc", _jpeg(icc_profile=b"\x00" * 200)),
        ("comment", _jpeg(comment=b"hello")),
    ],
)
def test_plain_files_as_pillow(kind: str, data: bytes) -> None:
    hdr = read_jpeg_header(data)
    assert hdr.complete, kind
    assert _both(data)[0] == _both(data)[1] == (1, hdr.height, hdr.width)


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("cmyk", _jpeg("CMYK")),  # Adobe marker, 4 components
        ("xmp", _jpeg(xmp=b"<x:xmpmeta/>")),
        ("two exif", _segment(0xE1, _exif(8)) + _jpeg(exif=_exif(3))[2:]),
        ("png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40),
        ("garbage", b"\xff\xd8\xff\x00\x00\x00"),
        ("short exif", _segment(0xE1, b"Exif\x00\x00II") + _jpeg()[2:]),
        ("empty exif, then an orientation", _segment(0xE1, _EMPTY_EXIF) + _jpeg(exif=_exif(3))[2:]),
    ],
)
def test_other_files_go_to_pillow(kind: str, data: bytes) -> None:
    with pytest.raises(NotPlain):
        read_jpeg_header(data)
    fast, pil = _both(data)
    assert fast == pil, kind


def test_truncated_and_limits() -> None:
    data = _jpeg(size=(64, 48))
    cut = data[: len(data) - 40]
    assert not read_jpeg_header(cut).complete
    assert _gpu_candidate(cut, BIG, BIG) is None is _gpu_candidate_pil(cut, BIG)
    assert _gpu_candidate(data, BIG, 64 * 48 - 1) is None  # over max_pixels
    assert _gpu_candidate(data, len(data) - 1, BIG) is None  # over max_bytes
    assert _gpu_candidate(data, len(data), 64 * 48) == (1, 48, 64)


@pytest.mark.lfw
def test_every_lfw_photo_as_pillow(lfw_root: Path) -> None:
    """All 13,233 LFW JPEGs: the walker answers each one, as Pillow does."""
    files = sorted((lfw_root / "lfw-deepfunneled").rglob("*.jpg"))
    assert len(files) > 13000
    for f in files:
        data = f.read_bytes()
        read_jpeg_header(data)  # plain: no NotPlain
        fast, pil = _both(data)
        assert fast == pil == (1, 250, 250), f
