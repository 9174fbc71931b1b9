"""Tests of facegate.io.decode: limits, typed errors, colour modes, EXIF orientation, path rules."""

from __future__ import annotations

import contextlib
import io
import os
import struct
import sys
import types
import zlib
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from facegate.errors import (
    EmptyInputError,
    FacegateError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidParameterError,
    PathNotAllowedError,
)
from facegate.io.decode import (
    decode_batch,
    decode_if_small,
    decode_image,
    gpu_decode_available,
    read_image_file,
)

LIMITS = {"max_bytes": 1 << 26, "max_pixels": 1 << 26}


def decode_jpeg_batch_cuda(datas: list[bytes], device: str, *, return_exceptions: bool = False) -> list[object]:
    """The engine's batch decode; a failing item raises unless ``return_exceptions``."""
    out = decode_batch(datas, device, **LIMITS)
    for i, res in enumerate(out):
        if isinstance(res, FacegateError):
            res.detail.setdefault("index", i)
            if not return_exceptions:
                raise res
    return out


# --------------------------------------------------------------------------- helpers
def _pattern(h: int = 60, w: int = 90) -> np.ndarray:
    """Asymmetric RGB test card: four solid quadrants (red, green, blue, white) + a smooth ramp."""
    img = np.zeros((h, w, 3), np.uint8)
    img[: h // 2, : w // 2] = (220, 30, 30)
    img[: h // 2, w // 2 :] = (30, 200, 30)
    img[h // 2 :, : w // 2] = (30, 30, 220)
    img[h // 2 :, w // 2 :] = (240, 240, 240)
    return img


def _encode(arr: np.ndarray | Image.Image, fmt: str, **kw: object) -> bytes:
    im = arr if isinstance(arr, Image.Image) else Image.fromarray(arr)
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _png_chunk(tag: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + tag + payload + struct.pack(">I", zlib.crc32(tag + payload))


def _png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims ``width × height`` greyscale pixels (the IDAT is far too short)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def jpeg_bytes() -> bytes:
    rng = np.random.default_rng(0)
    img = cv2.resize((rng.random((30, 40, 3)) * 255).astype(np.uint8), (400, 300), interpolation=cv2.INTER_CUBIC)
    return _encode(img, "JPEG", quality=90)


@pytest.fixture(scope="module")
def png_bytes() -> bytes:
    rng = np.random.default_rng(1)
    return _encode((rng.random((120, 160, 3)) * 255).astype(np.uint8), "PNG")


# --------------------------------------------------------------------------- errors
def test_zero_bytes() -> None:
    with pytest.raises(EmptyInputError) as exc:
        decode_image(b"", **LIMITS)
    assert exc.value.code == "empty_input"


@pytest.mark.parametrize(
    "data",
    [
        bytes(np.random.default_rng(2).integers(0, 256, 5000, dtype=np.uint8)),
        b"hello, not an image",
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # EPS: Pillow could open it; we must not
        b"%PDF-1.4\n",
        b"\xff\xd8\xff\xe0" + b"\x00" * 40,  # a JPEG signature with garbage
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,
    ],
)
def test_not_an_image(data: bytes) -> None:
    with pytest.raises(ImageDecodeError) as exc:
        decode_image(data, **LIMITS)
    assert exc.value.code == "image_unreadable"


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9, 0.999])
def test_truncated_jpeg(jpeg_bytes: bytes, frac: float) -> None:
    with pytest.raises(ImageDecodeError):
        decode_image(jpeg_bytes[: int(len(jpeg_bytes) * frac)], **LIMITS)


@pytest.mark.parametrize("cut", [2, 1])
def test_jpeg_missing_eoi(jpeg_bytes: bytes, cut: int) -> None:
    with pytest.raises(ImageDecodeError):
        decode_image(jpeg_bytes[:-cut], **LIMITS)


@pytest.mark.parametrize("frac", [0.3, 0.7, 0.99])
def test_truncated_png(png_bytes: bytes, frac: float) -> None:
    with pytest.raises(ImageDecodeError):
        decode_image(png_bytes[: int(len(png_bytes) * frac)], **LIMITS)
    with pytest.raises(ImageDecodeError):
        decode_image(png_bytes[:-12], **LIMITS)  # everything but IEND


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "TIFF", "BMP"])
def test_truncated_other_formats(fmt: str) -> None:
    data = _encode(_pattern(200, 300), fmt)
    with pytest.raises(ImageDecodeError):
        decode_image(data[: len(data) // 2], **LIMITS)


def test_truncation_refused_even_if_someone_enabled_load_truncated(
    jpeg_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ImageDecodeError):
        decode_image(jpeg_bytes[: len(jpeg_bytes) // 2], **LIMITS)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    gif = _encode(_pattern(200, 300), "GIF")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ImageDecodeError):
        decode_image(gif[: len(gif) // 2], **LIMITS)


def test_trailing_bytes_after_jpeg_are_fine(jpeg_bytes: bytes) -> None:
    a = decode_image(jpeg_bytes, **LIMITS)
    np.testing.assert_array_equal(decode_image(jpeg_bytes + b"\x00trailer" * 10, **LIMITS), a)


def test_too_many_bytes(jpeg_bytes: bytes) -> None:
    with pytest.raises(ImageTooLargeError) as exc:
        decode_image(jpeg_bytes, max_bytes=len(jpeg_bytes) - 1, max_pixels=1 << 26)
    assert exc.value.detail == {"unit": "bytes", "limit": len(jpeg_bytes) - 1, "actual": len(jpeg_bytes)}
    assert decode_image(jpeg_bytes, max_bytes=len(jpeg_bytes), max_pixels=1 << 26).shape == (300, 400, 3)


def test_too_many_pixels_checked_from_header_before_decoding() -> None:
    data = _png_header_only(8000, 8000)  # 64 MP in ~100 bytes; its IDAT could never decode
    assert len(data) < 200
    with pytest.raises(ImageTooLargeError) as exc:
        decode_image(data, max_bytes=1 << 20, max_pixels=40_000_000)
    assert exc.value.detail["limit"] == 40_000_000
    assert exc.value.detail["actual"] == 64_000_000
    assert (exc.value.detail["width"], exc.value.detail["height"]) == (8000, 8000)
    # within the limit the same bytes reach the decoder, which then refuses the bogus data
    with pytest.raises(ImageDecodeError):
        decode_image(_png_header_only(300, 200), max_bytes=1 << 20, max_pixels=1 << 20)


def test_pillow_decompression_bomb_error_becomes_ours() -> None:
    data = _png_header_only(50_000, 50_000)  # 2.5 GP: above 2 × Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageTooLargeError) as exc:
        decode_image(data, max_bytes=1 << 20, max_pixels=1_000_000_000)
    assert exc.value.detail["actual"] == 2_500_000_000


def test_a_decompression_bomb_is_refused_by_the_configured_pixel_limit() -> None:
    """Past Pillow's own bomb limit the answer still names ``max_pixels`` (it named Pillow's 178956970 and its
    "could be decompression bomb DOS attack" text), as for any image past the limit."""
    with pytest.raises(ImageTooLargeError) as exc:
        decode_image(_png_header_only(50_000, 50_000), max_bytes=1 << 20, max_pixels=40_000_000)
    assert exc.value.detail == {"unit": "pixels", "limit": 40_000_000, "actual": 2_500_000_000}
    assert exc.value.message == "image has 2500000000 pixels, more than the limit of 40000000"


def test_pixel_limit_is_exact() -> None:
    data = _encode(_pattern(60, 90), "PNG")
    assert decode_image(data, max_bytes=1 << 20, max_pixels=60 * 90).shape == (60, 90, 3)
    with pytest.raises(ImageTooLargeError):
        decode_image(data, max_bytes=1 << 20, max_pixels=60 * 90 - 1)


def test_bad_arguments(jpeg_bytes: bytes) -> None:
    with pytest.raises(InvalidParameterError):
        decode_image("not bytes", **LIMITS)  # type: ignore[arg-type]
    assert decode_image(bytearray(jpeg_bytes), **LIMITS).shape == (300, 400, 3)


# --------------------------------------------------------------------------- colour modes
def _rgba(alpha: int) -> np.ndarray:
    return np.dstack([_pattern(), np.full((60, 90), alpha, np.uint8)])


MODE_CASES: dict[str, tuple[bytes, np.ndarray, int]] = {}  # name → (bytes, expected RGB, tolerance)


def _mode_cases() -> dict[str, tuple[bytes, np.ndarray, int]]:
    if MODE_CASES:
        return MODE_CASES
    rgb = _pattern()
    grey = np.asarray(Image.fromarray(rgb).convert("L"))
    grey3 = np.repeat(grey[..., None], 3, 2)
    pal = Image.fromarray(rgb).quantize(colors=4, dither=Image.Dither.NONE)  # 4 colours: exact
    pal_rgb = np.asarray(pal.convert("RGB"))
    clear = np.asarray(pal) == np.asarray(pal)[0, 0]
    half = _rgba(128)
    half_exp = ((rgb.astype(np.uint16) * 128 + 255 * 127 + 127) // 255).astype(np.uint8)
    bw = (grey > 100).astype(np.uint8) * 255
    cmyk = Image.fromarray(rgb).convert("CMYK")
    cmyk_rgb = np.asarray(cmyk.convert("RGB"))
    MODE_CASES.update(
        {
            "RGB png": (_encode(rgb, "PNG"), rgb, 0),
            "RGB jpeg": (_encode(rgb, "JPEG", quality=95, subsampling=0), rgb, 12),
            "L png": (_encode(grey, "PNG"), grey3, 0),
            "L jpeg": (_encode(grey, "JPEG", quality=95), grey3, 12),
            "1 png": (_encode(Image.fromarray(bw).convert("1"), "PNG"), np.repeat(bw[..., None], 3, 2), 0),
            "P png": (_encode(pal, "PNG"), pal_rgb, 0),
            "P gif": (_encode(pal, "GIF"), pal_rgb, 0),
            "RGBA opaque png": (_encode(_rgba(255), "PNG"), rgb, 0),
            "RGBA half png": (_encode(half, "PNG"), half_exp, 0),
            "RGBA clear png": (_encode(_rgba(0), "PNG"), np.full_like(rgb, 255), 0),
            "RGBA half webp": (_encode(half, "WEBP", lossless=True), half_exp, 1),
            "LA png": (
                _encode(Image.fromarray(np.dstack([grey, np.zeros_like(grey)]), "LA"), "PNG"),
                np.full_like(rgb, 255),
                0,
            ),
            "P transparent png": (
                _encode(pal, "PNG", transparency=int(np.asarray(pal)[0, 0])),  # top-left colour → clear
                np.where(clear[..., None], 255, pal_rgb).astype(np.uint8),
                0,
            ),
            "I;16 png": (_encode(Image.fromarray(grey.astype(np.uint16) * 257), "PNG"), grey3, 0),
            "I;16 tiff": (_encode(Image.fromarray(grey.astype(np.uint16) * 257), "TIFF"), grey3, 0),
            "F tiff": (_encode(Image.fromarray(grey.astype(np.float32)), "TIFF"), grey3, 0),
            "CMYK jpeg": (_encode(cmyk, "JPEG", quality=95), cmyk_rgb, 12),
            "CMYK tiff": (_encode(cmyk, "TIFF"), cmyk_rgb, 0),
            "RGB bmp": (_encode(rgb, "BMP"), rgb, 0),
            "RGB tiff": (_encode(rgb, "TIFF", compression="tiff_deflate"), rgb, 0),
            "RGB webp": (_encode(rgb, "WEBP", lossless=True), rgb, 0),
            "RGB ppm": (_encode(rgb, "PPM"), rgb, 0),
        }
    )
    # 16-bit RGB PNG (Pillow and OpenCV both keep the high byte)
    rgb16 = rgb.astype(np.uint16) * 257 + 3
    ok, enc = cv2.imencode(".png", np.ascontiguousarray(rgb16[..., ::-1]))
    assert ok
    MODE_CASES["RGB16 png"] = (enc.tobytes(), rgb, 0)
    return MODE_CASES


@pytest.mark.parametrize("name", list(_mode_cases()))
def test_colour_modes(name: str) -> None:
    data, expected, tol = _mode_cases()[name]
    out = decode_image(data, **LIMITS)
    assert out.dtype == np.uint8 and out.shape == expected.shape and out.flags.c_contiguous
    diff = np.abs(out.astype(np.int16) - expected.astype(np.int16))
    assert diff.max() <= tol, f"{name}: max diff {diff.max()}"


@pytest.mark.parametrize("fmt", ["GIF", "TIFF", "PNG", "WEBP"])
def test_multi_frame_first_frame(fmt: str) -> None:
    frames = [Image.fromarray(np.full((20, 30, 3), v, np.uint8)) for v in (10, 200, 90)]
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], **({"lossless": True} if fmt == "WEBP" else {}))
    out = decode_image(buf.getvalue(), **LIMITS)
    assert out.shape == (20, 30, 3)
    assert np.abs(out.astype(int) - 10).max() <= 1


def test_jpeg_fast_path_matches_pillow(lfw_root: Path) -> None:
    files = sorted((lfw_root / "lfw-deepfunneled").glob("B*/*_0001.jpg"))[:40]
    assert files
    for f in files:
        data = f.read_bytes()
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        np.testing.assert_array_equal(decode_image(data, **LIMITS), ref)


# --------------------------------------------------------------------------- EXIF orientation
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_jpeg(orientation: int) -> None:
    data = _encode(_pattern(), "JPEG", quality=95, exif=_exif(orientation))
    out = decode_image(data, **LIMITS)
    ref = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    np.testing.assert_array_equal(out, ref)
    # OpenCV, left to itself, applies EXIF orientation too (IMREAD_COLOR default) and agrees
    cv = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
    np.testing.assert_array_equal(out, cv)


def test_exif_orientation_6_rotates_clockwise() -> None:
    """Orientation 6: the stored image must be turned 90° clockwise to display upright."""
    img = _pattern()  # red top-left, green top-right, blue bottom-left, white bottom-right
    for fmt, kw in (("JPEG", {"quality": 95}), ("PNG", {}), ("WEBP", {"lossless": True})):
        out = decode_image(_encode(img, fmt, exif=_exif(6), **kw), **LIMITS)
        assert out.shape == (90, 60, 3), fmt
        expected = np.rot90(img, k=-1)
        assert np.abs(out.astype(int) - expected.astype(int)).mean() < 3, fmt
        assert out[5, -5, 0] > 200 and out[5, -5, 1] < 60  # red now top-right
        assert out[5, 5, 2] > 200 and out[5, 5, 0] < 60  # blue now top-left


def test_tiff_orientation_tag() -> None:
    img = _pattern()
    im = Image.fromarray(img)
    buf = io.BytesIO()
    im.save(buf, "TIFF", tiffinfo={274: 8})
    np.testing.assert_array_equal(decode_image(buf.getvalue(), **LIMITS), np.rot90(img, k=1))


def test_corrupt_exif_is_ignored() -> None:
    data = _encode(_pattern(), "JPEG", quality=95, exif=b"Exif\x00\x00" + b"\x13" * 30)
    assert decode_image(data, **LIMITS).shape == (60, 90, 3)


# --------------------------------------------------------------------------- server-side paths
@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    data = _encode(_pattern(), "PNG")
    (root / "sub" / "ok.png").write_bytes(data)
    (outside / "secret.png").write_bytes(data)
    (root / "empty.png").write_bytes(b"")
    (root / "escape.png").symlink_to(outside / "secret.png")
    (root / "inner_link.png").symlink_to(root / "sub" / "ok.png")
    (root / "dirlink").symlink_to(outside, target_is_directory=True)
    return {"root": root, "outside": outside}


def _read(path: Path | str, roots: list[Path], **kw: int) -> np.ndarray:
    return read_image_file(path, allowed_roots=roots, **{**LIMITS, **kw})


def test_path_inside_root(tree: dict[str, Path]) -> None:
    root = tree["root"]
    assert _read(root / "sub" / "ok.png", [root]).shape == (60, 90, 3)
    assert _read(str(root / "sub" / ".." / "sub" / "ok.png"), [root]).shape == (60, 90, 3)
    assert _read(root / "inner_link.png", [root]).shape == (60, 90, 3)  # symlink staying inside
    assert _read(root / "sub" / "ok.png", [tree["outside"], root]).shape == (60, 90, 3)


def test_path_rules_refuse(tree: dict[str, Path]) -> None:
    root, outside = tree["root"], tree["outside"]
    refused = [
        (root / "sub" / "ok.png", []),  # no roots configured
        (outside / "secret.png", [root]),
        (root / "escape.png", [root]),  # symlink escaping the root
        (root / "dirlink" / "secret.png", [root]),  # directory symlink escaping
        (str(root / ".." / "outside" / "secret.png"), [root]),  # '..' escaping
        (root / "sub", [root]),  # a directory
        (root / "missing.png", [root]),
        (outside / "missing.png", [root]),
        (Path(str(root) + "2") / "x.png", [root]),  # prefix is not containment
        ("bad\x00path", [root]),
    ]
    for path, roots in refused:
        with pytest.raises(PathNotAllowedError):
            _read(path, roots)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_path_fifo_refused_without_blocking(tree: dict[str, Path]) -> None:
    fifo = tree["root"] / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(PathNotAllowedError):
        _read(fifo, [tree["root"]])


def test_path_size_and_io_errors(tree: dict[str, Path]) -> None:
    root = tree["root"]
    with pytest.raises(EmptyInputError):
        _read(root / "empty.png", [root])
    with pytest.raises(ImageTooLargeError) as exc:
        _read(root / "sub" / "ok.png", [root], max_bytes=100)
    assert exc.value.detail["unit"] == "bytes" and exc.value.detail["limit"] == 100
    (root / "junk.png").write_bytes(b"junk" * 10)
    with pytest.raises(ImageDecodeError):
        _read(root / "junk.png", [root])
    if sys.platform != "win32" and os.geteuid() != 0:
        locked = root / "locked.png"
        locked.write_bytes(_encode(_pattern(), "PNG"))
        locked.chmod(0)
        with pytest.raises(ImageDecodeError):
            _read(locked, [root])


# --------------------------------------------------------------------------- batch decode (GPU or fallback)
def test_batch_decode_cpu_fallback(jpeg_bytes: bytes, png_bytes: bytes) -> None:
    rotated = _encode(_pattern(), "JPEG", quality=95, exif=_exif(6))
    datas = [jpeg_bytes, png_bytes, rotated]
    out = decode_jpeg_batch_cuda(datas, "cpu")
    for data, t in zip(datas, out, strict=True):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape[0] == 3
        np.testing.assert_array_equal(t.permute(1, 2, 0).numpy(), decode_image(data, **LIMITS))
    with pytest.raises(ImageDecodeError) as exc:
        decode_jpeg_batch_cuda([jpeg_bytes, jpeg_bytes[:500]], "cpu")
    assert exc.value.detail["index"] == 1
    mixed = decode_jpeg_batch_cuda([b"", jpeg_bytes], "cpu", return_exceptions=True)
    assert isinstance(mixed[0], EmptyInputError) and isinstance(mixed[1], torch.Tensor)
    if not torch.cuda.is_available():
        assert gpu_decode_available() is False


def test_batch_decode_nvjpeg_logic_with_a_fake_decoder(monkeypatch: pytest.MonkeyPatch, jpeg_bytes: bytes) -> None:
    """Drive the nvJPEG branch on the CPU: a stand-in ``nvjpeg_decode`` that, like nvJPEG, ignores EXIF
    orientation and fails the whole batch when one image fails."""
    from facegate.io import decode as mod

    calls: list[int] = []

    def fake_nvjpeg_decode(inp: object, device: object) -> object:
        items = inp if isinstance(inp, list) else [inp]
        calls.append(len(items))
        out = []
        for t in items:
            raw = t.numpy().tobytes()
            if b"FAILNV" in raw:
                raise RuntimeError("nvjpeg: unsupported")
            arr = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
            out.append(torch.from_numpy(arr).permute(2, 0, 1))
        return out if isinstance(inp, list) else out[0]

    monkeypatch.setattr(mod, "nvjpeg_decode", fake_nvjpeg_decode)
    monkeypatch.setattr(mod, "_use_nvjpeg", lambda device: True)

    rotated = [_encode(_pattern(), "JPEG", quality=95, exif=_exif(o)) for o in (3, 6, 8)]
    failing = _encode(_pattern(), "JPEG", quality=95, comment=b"FAILNV")
    datas = [jpeg_bytes, _encode(_pattern(), "PNG"), *rotated, failing, jpeg_bytes[:700]]
    out = decode_jpeg_batch_cuda(datas, "cpu", return_exceptions=True)
    assert calls[0] == 5  # the 4 complete JPEGs + the failing one went in one batch (PNG and truncated did not)
    assert calls[1:] == [1] * 5  # the batch failed → one by one
    assert isinstance(out[-1], ImageDecodeError) and out[-1].detail["index"] == 6
    for data, t in zip(datas[:-1], out[:-1], strict=True):
        np.testing.assert_array_equal(t.permute(1, 2, 0).numpy(), decode_image(data, **LIMITS))


def test_nvjpeg_decodes_with_its_own_stream_current_and_hands_outputs_to_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pytorch/vision#9606: with the caller's stream current, the CUDA decoder may overwrite memory that
    kernels queued there still read. The decode must run with another stream current, then the caller's
    stream waits for it and owns the outputs (their memory is recycled only after its work on them)."""
    import facegate.io.decode as mod

    events: list[tuple[str, object]] = []
    current = ["caller"]

    class FakeStream:
        def __init__(self, device: object = None) -> None:
            self.name = "decode"

        def wait_stream(self, other: FakeStream) -> None:
            events.append((f"{self.name} waits for", other.name))

    caller = FakeStream()
    caller.name = "caller"

    @contextlib.contextmanager
    def stream_ctx(s: FakeStream) -> Iterator[None]:
        current.append(s.name)
        yield
        current.pop()

    class Out:
        def record_stream(self, s: FakeStream) -> None:
            events.append(("record", s.name))

    def fake_decode_jpeg(inp: object, mode: object = None, device: object = None) -> object:
        events.append(("decode with current", current[-1]))
        return [Out(), Out()] if isinstance(inp, list) else Out()

    tv, tv_io = types.ModuleType("torchvision"), types.ModuleType("torchvision.io")
    tv_io.decode_jpeg = fake_decode_jpeg  # type: ignore[attr-defined]
    tv_io.ImageReadMode = types.SimpleNamespace(RGB="RGB")  # type: ignore[attr-defined]
    tv.io = tv_io  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.io", tv_io)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mod, "_decode_streams", {})

    out = mod.nvjpeg_decode([torch.zeros(4, dtype=torch.uint8)] * 2, torch.device("cuda"))
    assert len(out) == 2
    assert events == [
        ("decode with current", "decode"),
        ("caller waits for", "decode"),
        ("record", "caller"),
        ("record", "caller"),
    ]
    mod.nvjpeg_decode(torch.zeros(4, dtype=torch.uint8), torch.device("cuda:0"))
    assert len(mod._decode_streams) == 1  # one decode stream per device, made once


@pytest.mark.gpu
def test_batch_decode_cuda_matches_cpu(jpeg_bytes: bytes, png_bytes: bytes) -> None:
    if not gpu_decode_available():
        pytest.skip("torchvision nvJPEG decode not available")
    grey = _encode(np.asarray(Image.fromarray(_pattern()).convert("L")), "JPEG", quality=95)
    rotated = [_encode(_pattern(), "JPEG", quality=95, exif=_exif(o)) for o in range(1, 9)]
    datas = [jpeg_bytes, png_bytes, grey, jpeg_bytes[:1000], *rotated]
    out = decode_jpeg_batch_cuda(datas, "cuda", return_exceptions=True)
    assert isinstance(out[3], ImageDecodeError)
    diffs = {}
    for i, (data, t) in enumerate(zip(datas, out, strict=True)):
        if i == 3:
            continue
        assert isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dtype == torch.uint8
        ref = decode_image(data, **LIMITS)
        got = t.permute(1, 2, 0).cpu().numpy()
        assert got.shape == ref.shape, i  # orientation applied: the shape of every rotated variant matches
        diffs[i] = float(np.abs(got.astype(int) - ref.astype(int)).mean())
    print("mean abs diff per item:", {k: round(v, 3) for k, v in diffs.items()})  # shown with -s
    # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's; on this hard-edged synthetic
    # pattern the first H200 run measured a mean difference of 5.03 grey levels for item 0. A wrong
    # orientation or channel order gives tens of levels.
    assert max(diffs.values()) < 8.0, diffs


def test_errors_are_facegate_errors_only() -> None:
    """Fuzz: random mutations of valid files never leak a third-party exception."""
    rng = np.random.default_rng(3)
    seeds = [
        _encode(_pattern(), "JPEG"),
        _encode(_pattern(), "PNG"),
        _encode(_pattern(), "GIF"),
        _encode(_pattern(), "TIFF"),
        _encode(_pattern(), "WEBP"),
        _encode(_pattern(), "BMP"),
    ]
    for seed in seeds:
        for _ in range(40):
            buf = bytearray(seed)
            for pos in rng.integers(0, len(buf), int(rng.integers(1, 8))):
                buf[pos] = int(rng.integers(0, 256))
            try:
                out = decode_image(bytes(buf), max_bytes=1 << 16, max_pixels=1 << 16)
            except FacegateError:
                continue
            assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3


def test_decode_if_small_decodes_small_jpegs_and_pngs_and_leaves_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    from facegate.io import decode as dec

    arr = _pattern(60, 90)
    for data in (_encode(arr, "JPEG", quality=90), _encode(arr, "PNG")):
        got = decode_if_small(data, **LIMITS)
        assert got is not None and got.shape == (60, 90, 3)
        np.testing.assert_array_equal(got, decode_image(data, **LIMITS))
    with monkeypatch.context() as m:
        m.setattr(dec, "INLINE_DECODE_PIXELS", 60 * 90 - 1)
        assert decode_if_small(_encode(arr, "JPEG", quality=90), **LIMITS) is None
    assert decode_if_small(_png_header_only(4000, 3000), **LIMITS) is None  # header only: nothing is decoded
    assert decode_if_small(_encode(arr, "BMP"), **LIMITS) is None  # other formats: unknown, so the pool decodes them
    assert decode_if_small(b"\xff\xd8\xff\xe0garbage", **LIMITS) is None
    assert decode_if_small(b"", **LIMITS) is None
    with pytest.raises(ImageTooLargeError):  # a small image keeps decode_image's limits
        decode_if_small(_encode(arr, "JPEG", quality=90), max_bytes=LIMITS["max_bytes"], max_pixels=100)


def test_plain_jpeg_fast_path_equals_the_pillow_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from facegate.io import decode as dec

    lfw = os.environ.get("FACEGATE_LFW_ROOT")  # 20 LFW photos too, where the data is
    lfw_or_none = Path(lfw) if lfw and (Path(lfw) / "lfw-deepfunneled").is_dir() else None
    files = [_encode(_pattern(), "JPEG", quality=95, exif=_exif(o)) for o in range(1, 9)]
    files.append(_encode(Image.fromarray(_pattern()[..., 0]), "JPEG", quality=90))  # greyscale
    files.append(_encode(_pattern(300, 200), "JPEG", quality=80, progressive=True))
    if lfw_or_none is not None:
        files += [p.read_bytes() for p in sorted((lfw_or_none / "lfw-deepfunneled").glob("A*/*_0001.jpg"))[:20]]
    for f in files:  # all take it
        hdr = dec._plain_jpeg_header(f, LIMITS["max_pixels"])
        assert hdr is not None and dec._decode_cv2(f, (hdr.width, hdr.height)) is not None
    fast = [decode_image(f, **LIMITS) for f in files]
    monkeypatch.setattr(dec, "_plain_jpeg_header", lambda data, max_pixels: None)
    for f, a in zip(files, fast, strict=True):
        np.testing.assert_array_equal(decode_image(f, **LIMITS), a)


def test_plain_jpeg_fast_path_keeps_the_limits_and_truncation_errors(jpeg_bytes: bytes) -> None:
    with pytest.raises(ImageTooLargeError) as ei:
        decode_image(jpeg_bytes, max_bytes=LIMITS["max_bytes"], max_pixels=10)
    assert ei.value.detail["unit"] == "pixels" and ei.value.detail["limit"] == 10
    with pytest.raises(ImageDecodeError, match="truncated"):
        decode_image(jpeg_bytes[:-40], **LIMITS)
