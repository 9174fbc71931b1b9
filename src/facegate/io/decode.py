"""Image decoding with limits and typed errors.

:func:`decode_image` turns untrusted bytes into an ``(H, W, 3) uint8`` RGB array, or raises one of
:class:`~facegate.errors.EmptyInputError`, :class:`~facegate.errors.ImageTooLargeError`,
:class:`~facegate.errors.ImageDecodeError`. No Pillow / OpenCV exception escapes.

Order of checks (cheapest first, nothing is decoded before the limits pass):

1. byte count (``max_bytes``) — before touching the data;
2. Pillow's lazy ``Image.open`` reads only the header: format (allow-list :data:`FORMATS`; EPS, PDF and
   the other exotic Pillow plugins are refused), mode, size → pixel count (``max_pixels``);
3. JPEG / PNG completeness (an EOI marker after the first scan / an intact chunk chain up to IEND), so
   a truncated upload is refused whatever the decoder and ``ImageFile.LOAD_TRUNCATED_IMAGES`` would do;
4. the full decode.

Decoders. 8-bit greyscale/RGB JPEG and opaque, single-frame greyscale/RGB PNG without ``eXIf``/XMP
data are decoded by ``cv2.imdecode(IMREAD_COLOR_RGB | IMREAD_IGNORE_ORIENTATION)``: on one shared CPU
core it measured 1.3–1.5× faster than Pillow on 250×250 LFW JPEGs and 2–2.6× on a 4000×3000 JPEG, with
bit-identical output (both use libjpeg-turbo). Everything else goes through Pillow (``img.load()`` is
forced, truncated data is an error). If OpenCV fails on the fast path, Pillow gets a second try.

Conversions:

* **EXIF orientation** is read by Pillow (EXIF or XMP) and applied by us on both paths (OpenCV is told to
  ignore it), so the result does not depend on the OpenCV version. (OpenCV 5's plain ``IMREAD_COLOR``
  applies EXIF orientation to JPEGs too, and the tests check it agrees for all eight values.)
  Unreadable EXIF means "no rotation".
* **Alpha** (RGBA, LA, PA, palette or colour-key transparency) is **composited on white**: a transparent
  background becomes white rather than whatever colour the encoder left under alpha = 0.
* **16-bit** greyscale (``I;16*``) and ``I`` images are mapped with ``round(v / 257)`` (0–65535 → 0–255);
  Pillow itself reduces 16-bit RGB to 8 bits by keeping the high byte, as OpenCV does. ``F`` (float)
  images are taken as 0–255 and clipped.
* **CMYK** (incl. Adobe-inverted CMYK JPEG) goes through Pillow's naive CMYK→RGB (no ICC profile).
* **Multi-frame** GIF / TIFF / APNG / WebP / MPO: the first frame only.

Pillow's own decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``) stays untouched: an image above
``2 × MAX_IMAGE_PIXELS`` (≈179 MP by default) raises ``DecompressionBombError`` inside ``Image.open``,
which becomes :class:`ImageTooLargeError`; below that our ``max_pixels`` decides (Pillow's
``DecompressionBombWarning`` for images above ``MAX_IMAGE_PIXELS`` is only a warning, and any image it
fires for is refused by us unless ``max_pixels`` was raised above Pillow's limit on purpose). To accept
images above ≈179 MP, raise ``PIL.Image.MAX_IMAGE_PIXELS`` at start-up.

:func:`read_image_file` adds server-side path rules; :func:`decode_jpeg_batch_cuda` decodes JPEGs with
nvJPEG (torchvision, imported lazily) and falls back to the CPU decoder.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
from PIL import (
    BmpImagePlugin,  # noqa: F401  (importing a plugin registers its format)
    GifImagePlugin,  # noqa: F401
    Image,
    ImageFile,
    JpegImagePlugin,  # noqa: F401
    MpoImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    PpmImagePlugin,  # noqa: F401
    TiffImagePlugin,  # noqa: F401
    WebPImagePlugin,  # noqa: F401
)

from facegate.errors import (
    EmptyInputError,
    FacegateError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidParameterError,
    PathNotAllowedError,
)
from facegate.io.jpeg import JpegHeader, NotPlain, read_jpeg_header

with contextlib.suppress(ImportError):  # AVIF exists in Pillow >= 11.2 when built with libavif
    from PIL import AvifImagePlugin  # noqa: F401

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Formats we let Pillow open (header sniffing, never the file name). MPO arrives through "JPEG".
FORMATS: tuple[str, ...] = tuple(
    f for f in ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "AVIF") if f in Image.OPEN
)

#: Defaults used where no Settings object is at hand (the same as ``facegate.config.Settings``).
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 40_000_000

_JPEG_FORMATS = frozenset({"JPEG", "MPO"})
# IMREAD_COLOR_RGB exists from OpenCV 4.10; older builds (pyproject allows >= 4.8) decode BGR and swap.
_CV2_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)
_CV2_FLAGS = (cv2.IMREAD_COLOR if _CV2_RGB is None else _CV2_RGB) | cv2.IMREAD_IGNORE_ORIENTATION
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")

# EXIF orientation → the transposition that undoes it (as PIL.ImageOps.exif_transpose).
_ORIENT_OPS: dict[int, str] = {
    2: "fliplr",
    3: "rot180",
    4: "flipud",
    5: "transpose",
    6: "rot_cw",  # PIL ROTATE_270
    7: "transverse",
    8: "rot_ccw",  # PIL ROTATE_90
}


# --------------------------------------------------------------------------- helpers
def _check_limits(max_bytes: int, max_pixels: int) -> None:
    for name, val in (("max_bytes", max_bytes), ("max_pixels", max_pixels)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise InvalidParameterError(f"{name} must be a positive int, got {val!r}", detail={name: str(val)})


def _too_large(unit: str, limit: int, actual: int, **extra: Any) -> ImageTooLargeError:
    return ImageTooLargeError(
        f"image has {actual} {unit}, more than the limit of {limit}",
        detail={"unit": unit, "limit": limit, "actual": actual, **extra},
    )


def _ensure_strict_truncation() -> None:
    """Keep Pillow's default of refusing truncated images (someone may have flipped the global)."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        log.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES was True; facegate resets it to False")
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def _open_header(data: bytes) -> Image.Image:
    """Pillow's lazy open (header only), with every Pillow failure converted."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        m = _BOMB_PIXELS.search(str(exc))
        actual = int(m.group(1)) if m else -1
        raise ImageTooLargeError(
            f"image is too large for the decoder: {exc}",
            detail={"unit": "pixels", "limit": 2 * (Image.MAX_IMAGE_PIXELS or 0), "actual": actual},
        ) from exc
    except Image.UnidentifiedImageError as exc:
        raise ImageDecodeError(
            f"not an image, or not a supported format ({', '.join(FORMATS)})",
            detail={"supported": list(FORMATS)},
        ) from exc
    except Exception as exc:  # SyntaxError, struct.error, OSError, ValueError, ... from plugins
        raise ImageDecodeError(f"cannot read the image header: {exc}") from exc


def _jpeg_complete(data: bytes) -> bool:
    """Whether an EOI marker follows the first SOS (start of scan) — i.e. the file is not truncated.

    Walks the marker segments up to the first SOS (EXIF thumbnails inside APP1 are skipped whole),
    then looks for ``FF D9``, which cannot occur inside entropy-coded data.
    """
    n = len(data)
    i = 2  # after SOI
    while i + 4 <= n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA:
            return data.find(b"\xff\xd9", i) != -1
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return False


def _png_complete(data: bytes) -> bool:
    """Whether the PNG chunk chain is intact from the signature to IEND (every length within the data).

    Besides catching truncation, this keeps a corrupted chunk length (e.g. 3 GB) away from OpenCV,
    whose PNG reader was measured taking 6 s on such a 162-byte file.
    """
    n = len(data)
    i = 8  # after the signature
    while i + 12 <= n:
        length = int.from_bytes(data[i : i + 4], "big")
        end = i + 12 + length
        if length > 0x7FFFFFFF or end > n:
            return False
        if data[i + 4 : i + 8] == b"IEND":
            return True
        i = end
    return False


def _check_complete(fmt: str, data: bytes) -> None:
    if (fmt in _JPEG_FORMATS and not _jpeg_complete(data)) or (fmt == "PNG" and not _png_complete(data)):
        raise ImageDecodeError(f"the {fmt} data is truncated", detail={"format": fmt})


def _orientation(img: Image.Image) -> int:
    """EXIF/XMP orientation tag (1–8), 1 when absent or unreadable."""
    try:
        value = int(img.getexif().get(0x0112, 1))
    except Exception as exc:  # malformed EXIF must not make a decodable image fail
        log.debug("ignoring unreadable EXIF: %s", exc)
        return 1
    return value if 1 <= value <= 8 else 1


def _apply_orientation(arr: np.ndarray, orientation: int) -> np.ndarray:
    """Apply an EXIF orientation to ``(H, W, C)``; returns a C-contiguous array."""
    op = _ORIENT_OPS.get(orientation)
    if op == "fliplr":
        arr = arr[:, ::-1]
    elif op == "flipud":
        arr = arr[::-1]
    elif op == "rot180":
        arr = arr[::-1, ::-1]
    elif op == "transpose":
        arr = arr.transpose(1, 0, 2)
    elif op == "transverse":
        arr = arr.transpose(1, 0, 2)[::-1, ::-1]
    elif op == "rot_cw":
        arr = np.rot90(arr, k=-1)
    elif op == "rot_ccw":
        arr = np.rot90(arr, k=1)
    return np.ascontiguousarray(arr)


def _fast_path(img: Image.Image, fmt: str, data: bytes) -> bool:
    """Whether OpenCV may decode these bytes with the same result as the Pillow path."""
    if img.mode not in ("L", "RGB"):
        return False
    if fmt in _JPEG_FORMATS:
        return True
    if fmt == "PNG":
        # Orientation can only come from an eXIf chunk or XMP; Pillow may only see those after a full
        # load, so PNGs carrying either take the Pillow path and the fast path means "no rotation".
        return (
            "transparency" not in img.info
            and not getattr(img, "is_animated", False)
            and b"eXIf" not in data
            and b"XML:com.adobe.xmp" not in data
        )
    return False


def _decode_cv2(data: bytes, size: tuple[int, int]) -> np.ndarray | None:
    """``(H, W, 3) uint8`` RGB from OpenCV (orientation ignored), or None when OpenCV declines."""
    try:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), _CV2_FLAGS)
    except cv2.error as exc:
        log.debug("cv2.imdecode failed (%s); falling back to Pillow", exc)
        return None
    if arr is None or arr.ndim != 3 or arr.shape[:2] != (size[1], size[0]) or arr.dtype != np.uint8:
        return None
    return arr if _CV2_RGB is not None else cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)


def _composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """``(H, W, 4) uint8`` → ``(H, W, 3) uint8``: ``c·a/255 + 255·(1 − a/255)``, rounded."""
    rgb = rgba[..., :3].astype(np.uint16)
    a = rgba[..., 3:4].astype(np.uint16)
    return ((rgb * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def _pil_to_rgb(img: Image.Image) -> np.ndarray:
    """Fully decode a Pillow image (first frame) to ``(H, W, 3) uint8`` RGB."""
    img.load()  # forced: truncated data raises here (LOAD_TRUNCATED_IMAGES is False)
    mode = img.mode
    if mode in _ALPHA_MODES or (mode in ("P", "L", "RGB", "1") and "transparency" in img.info):
        return _composite_on_white(np.asarray(img.convert("RGBA")))
    if mode in _SIXTEEN_BIT or mode == "I":
        v = np.asarray(img).astype(np.int64)
        grey = ((np.clip(v, 0, 65535) * 2 + 257) // 514).astype(np.uint8)  # round(v / 257)
        return np.repeat(grey[..., None], 3, axis=2)
    if mode == "F":
        grey = np.clip(np.rint(np.nan_to_num(np.asarray(img, np.float64))), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


# --------------------------------------------------------------------------- public API
#: Uploads of at most this many pixels (by their header) are small enough to decode on the caller's thread:
#: a 112×112 aligned crop decodes in ~0.1 ms, less than a round trip through a thread pool, whose
#: ``ThreadPoolExecutor.submit`` alone held 15–20 % of a front-end's GIL samples under aligned-crop load
#: (``benchmarks/frontend_gil.py``, the ``session_start`` rows of ``results/frontend_gil_cpu.json``).
INLINE_DECODE_PIXELS = 160 * 160


def decode_if_small(
    data: bytes, *, max_bytes: int, max_pixels: int, small_pixels: int = INLINE_DECODE_PIXELS
) -> np.ndarray | None:
    """:func:`decode_image` of ``data`` when its header says it has at most ``small_pixels``; ``None`` when it
    is larger or its size is not known without Pillow (then the caller decodes it elsewhere).

    Plain JPEGs and PNGs only. A plain JPEG's header is read once, for the size check and the decode.

    Raises: as :func:`decode_image`, for a small image.
    """
    if not isinstance(data, bytes) or not data or len(data) > max_bytes:
        return None
    if data[:3] == b"\xff\xd8\xff":
        try:
            hdr = read_jpeg_header(data)
        except NotPlain:
            return None
        if hdr.width * hdr.height > small_pixels:
            return None
        _check_limits(max_bytes, max_pixels)
        _ensure_strict_truncation()
        arr = _decode_plain_jpeg(data, max_pixels, hdr)
        return arr if arr is not None else decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
    png = len(data) >= 24 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    if png and int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big") <= small_pixels:
        return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
    return None


def decode_image(data: bytes, *, max_bytes: int, max_pixels: int) -> np.ndarray:
    """Decode untrusted image bytes to RGB, enforcing size limits before any pixel is decoded.

    Args:
        data: the encoded image (JPEG, PNG, GIF, BMP, TIFF, WebP, PPM, AVIF where Pillow supports it).
        max_bytes: refuse more bytes than this (checked first).
        max_pixels: refuse ``width × height`` above this (read from the header, before decoding).

    Returns:
        ``(H, W, 3) uint8`` RGB, C-contiguous, EXIF orientation applied, alpha composited on white.

    Raises:
        EmptyInputError: zero bytes.
        ImageTooLargeError: too many bytes or pixels; ``detail = {unit, limit, actual, ...}``.
        ImageDecodeError: not an image, unsupported format or mode, truncated or corrupt data.
        InvalidParameterError: ``data`` is not bytes-like or a limit is not a positive int.
    """
    _check_limits(max_bytes, max_pixels)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidParameterError(f"image data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) == 0:
        raise EmptyInputError("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise _too_large("bytes", max_bytes, len(data))
    _ensure_strict_truncation()
    arr = _decode_plain_jpeg(data, max_pixels)
    if arr is not None:
        return arr

    img = _open_header(data)
    try:
        fmt = str(img.format)
        width, height = img.size
        if width * height > max_pixels:
            raise _too_large("pixels", max_pixels, width * height, width=width, height=height)
        if width < 1 or height < 1:
            raise ImageDecodeError("the image has no pixels", detail={"width": width, "height": height})
        _check_complete(fmt, data)
        arr = _decode_cv2(data, img.size) if _fast_path(img, fmt, data) else None
        if arr is not None:  # JPEG: EXIF is in the header; fast-path PNG: no EXIF/XMP (see _fast_path)
            orientation = _orientation(img) if fmt in _JPEG_FORMATS else 1
        else:  # the first frame (Image.open leaves every multi-frame format on frame 0)
            arr = _pil_to_rgb(img)
            orientation = _orientation(img)  # after the load, so a failing load is never retried
    except FacegateError:
        raise
    except Image.DecompressionBombError as exc:  # e.g. a later GIF frame larger than the header says
        raise ImageTooLargeError(f"image is too large for the decoder: {exc}", detail={"unit": "pixels"}) from exc
    except MemoryError as exc:
        raise ImageTooLargeError("not enough memory to decode the image", detail={"unit": "pixels"}) from exc
    except Exception as exc:  # OSError("image file is truncated"), SyntaxError, ValueError, ...
        raise ImageDecodeError(f"cannot decode the {fmt} image: {exc}", detail={"format": fmt}) from exc
    finally:
        img.close()
    if arr.shape[:2] != (height, width) or arr.ndim != 3 or arr.shape[2] != 3:
        raise ImageDecodeError(
            "decoded size differs from the header", detail={"header": [height, width], "decoded": list(arr.shape)}
        )
    return _apply_orientation(arr, orientation)


def _decode_plain_jpeg(data: bytes, max_pixels: int, hdr: JpegHeader | None = None) -> np.ndarray | None:
    """:func:`decode_image` for a plain JPEG (:func:`facegate.io.jpeg.read_jpeg_header`, or ``hdr`` when the
    caller read it already) without Pillow's header parse, which cost more than decoding a 112×112 crop;
    ``None``: take the general path.

    Same limits, errors and result as the general path, which reads such files' headers the same way
    (``tests/unit/io/test_jpeg.py`` compares the two readers on every LFW image).
    """
    if hdr is None:
        try:
            hdr = read_jpeg_header(data)
        except NotPlain:
            return None
    w, h = hdr.width, hdr.height
    if w < 1 or h < 1 or (Image.MAX_IMAGE_PIXELS and w * h > 2 * Image.MAX_IMAGE_PIXELS):
        return None  # the general path gives these their answer
    if w * h > max_pixels:
        raise _too_large("pixels", max_pixels, w * h, width=w, height=h)
    if not hdr.complete:
        raise ImageDecodeError("the JPEG data is truncated", detail={"format": "JPEG"})
    arr = _decode_cv2(data, (w, h))
    return None if arr is None else _apply_orientation(arr, hdr.orientation)


def _refuse(path: str | os.PathLike[str], why: str) -> PathNotAllowedError:
    return PathNotAllowedError(f"reading {os.fspath(path)!s} is not allowed: {why}", detail={"reason": why})


def read_image_file(path: str | Path, *, allowed_roots: Sequence[Path], max_bytes: int, max_pixels: int) -> np.ndarray:
    """Read and decode a server-side image file, confined to ``allowed_roots``.

    The path (relative paths are taken from the current directory) is resolved with every symlink and
    ``..`` followed, and must then lie inside one of the (equally resolved) roots and be a regular
    file. The resolved path is opened with ``O_NOFOLLOW`` and re-checked with ``fstat`` (a file swapped
    for a symlink, FIFO or device after the check is refused, and a FIFO never blocks the open).

    Returns / raises: as :func:`decode_image`, plus :class:`PathNotAllowedError` when ``allowed_roots``
    is empty, the real path is outside every root, or it is not a regular file (including "missing",
    so the reply does not reveal what exists outside the roots). Read errors → :class:`ImageDecodeError`.
    """
    _check_limits(max_bytes, max_pixels)
    if not allowed_roots:
        raise _refuse(path, "no allowed roots are configured")
    try:
        real = Path(os.path.realpath(os.fspath(path)))
        roots = [Path(os.path.realpath(os.fspath(r))) for r in allowed_roots]
    except (OSError, ValueError, TypeError) as exc:  # embedded NUL, symlink loops, bad types
        raise _refuse(path, f"unusable path ({exc})") from exc
    if not any(real.is_relative_to(r) for r in roots):
        raise _refuse(path, "outside the allowed roots")

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        raise _refuse(path, "not a regular file") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a symlink after the check
            raise _refuse(path, "the file became a symlink") from exc
        raise ImageDecodeError(f"cannot open {real}: {exc.strerror or exc}", detail={"path": str(real)}) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "not a regular file")
        if st.st_size > max_bytes:
            raise _too_large("bytes", max_bytes, st.st_size)
        with os.fdopen(fd, "rb", closefd=True) as fh:
            fd = -1
            data = fh.read(max_bytes + 1)  # never more than the limit, even if the file grows
    except FacegateError:
        raise
    except OSError as exc:
        raise ImageDecodeError(f"cannot read {real}: {exc.strerror or exc}", detail={"path": str(real)}) from exc
    finally:
        if fd >= 0:
            os.close(fd)
    return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)


# --------------------------------------------------------------------------- GPU batch decode
@lru_cache(maxsize=1)
def gpu_decode_available() -> bool:
    """True when torchvision's nvJPEG decoder can be used (CUDA present and torchvision importable)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as exc:  # ImportError, or a torchvision/torch mismatch raising at import
        log.info("GPU JPEG decode unavailable: %s", exc)
        return False
    return True


def _use_nvjpeg(device: torch.device) -> bool:
    """Whether JPEGs for ``device`` go to nvJPEG (a seam the tests replace to drive that path on CPU)."""
    return device.type == "cuda" and gpu_decode_available()


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """``(H, W, 3)`` host image → ``(3, H, W)`` contiguous on ``device`` (one blocking copy)."""
    import torch

    return torch.from_numpy(arr).permute(2, 0, 1).contiguous().to(device)


def _orient_chw(t: torch.Tensor, orientation: int) -> torch.Tensor:
    """:func:`_apply_orientation` for a ``(3, H, W)`` tensor."""
    import torch

    op = _ORIENT_OPS.get(orientation)
    if op == "fliplr":
        t = t.flip(2)
    elif op == "flipud":
        t = t.flip(1)
    elif op == "rot180":
        t = t.flip(1, 2)
    elif op == "transpose":
        t = t.transpose(1, 2)
    elif op == "transverse":
        t = t.transpose(1, 2).flip(1, 2)
    elif op == "rot_cw":
        t = torch.rot90(t, k=-1, dims=(1, 2))
    elif op == "rot_ccw":
        t = torch.rot90(t, k=1, dims=(1, 2))
    return t.contiguous()


def _gpu_candidate(data: bytes, max_bytes: int, max_pixels: int) -> tuple[int, int, int] | None:
    """``(orientation, H, W)`` when ``data`` is a complete 8-bit grey/RGB JPEG within the limits, else None.

    Plain JPEGs are read by :func:`facegate.io.jpeg.read_jpeg_header` (a few µs); every other file by
    Pillow's lazy open, which gives the same answers on plain ones (tests/unit/io/test_jpeg.py).
    """
    if not data or len(data) > max_bytes:
        return None
    try:
        hdr = read_jpeg_header(data)
    except NotPlain:
        return _gpu_candidate_pil(data, max_pixels)
    pixels = hdr.width * hdr.height
    if pixels > max_pixels or (Image.MAX_IMAGE_PIXELS and pixels > 2 * Image.MAX_IMAGE_PIXELS) or not hdr.complete:
        return None  # Pillow refuses more than twice MAX_IMAGE_PIXELS (a decompression bomb)
    return hdr.orientation, hdr.height, hdr.width


def _gpu_candidate_pil(data: bytes, max_pixels: int) -> tuple[int, int, int] | None:
    """:func:`_gpu_candidate` by Pillow's lazy open."""
    try:
        img = _open_header(data)
    except FacegateError:
        return None
    try:
        w, h = img.size
        if img.format not in _JPEG_FORMATS or img.mode not in ("L", "RGB") or w * h > max_pixels:
            return None
        if not _jpeg_complete(data):
            return None
        return _orientation(img), h, w
    finally:
        img.close()


@dataclass(slots=True)
class DecodePlan:
    """The host half of a batch decode (:func:`plan_decode`), ready for :func:`run_decode`.

    Attributes:
        datas: the encoded images.
        device: the target device.
        gpu_items: index → ``(orientation, H, W)`` of each JPEG that goes to nvJPEG.
        done: index → ``(H, W, 3) uint8`` already decoded on the host, or the item's :class:`FacegateError`
            (which, unlike :func:`decode_jpeg_batch_cuda`'s, names no batch index: the batch is the engine's).
        max_bytes, max_pixels: the limits, for the host fallback of an item nvJPEG rejects.
    """

    datas: list[bytes]
    device: torch.device
    gpu_items: dict[int, tuple[int, int, int]]
    done: dict[int, np.ndarray | FacegateError]
    max_bytes: int
    max_pixels: int


def plan_decode(
    datas: Sequence[bytes],
    device: str | torch.device = "cuda",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> DecodePlan:
    """Host half of a batch decode: header checks, and host decoding of everything nvJPEG will not get.

    JPEGs that pass the checks of :func:`_gpu_candidate` are left for nvJPEG when :func:`_use_nvjpeg` says
    so; every other item (PNG, CMYK, out of limits, broken, all of them off CUDA) is decoded here by
    :func:`decode_image`, or keeps its error. Never raises for a bad item.
    """
    import torch

    _check_limits(max_bytes, max_pixels)
    dev = torch.device(device)
    gpu_items: dict[int, tuple[int, int, int]] = {}
    use_nvjpeg = _use_nvjpeg(dev)
    host: list[int] = []
    for i, data in enumerate(datas):
        info = _gpu_candidate(bytes(data), max_bytes, max_pixels) if use_nvjpeg else None
        if info is not None:
            gpu_items[i] = info
        else:
            host.append(i)

    def one(i: int) -> np.ndarray | FacegateError:
        try:
            return decode_image(datas[i], max_bytes=max_bytes, max_pixels=max_pixels)
        except FacegateError as exc:
            return exc

    done: dict[int, np.ndarray | FacegateError] = {i: one(i) for i in host}
    return DecodePlan(list(datas), dev, gpu_items, done, max_bytes, max_pixels)


_decode_streams: dict[int, Any] = {}
_decode_streams_lock = threading.Lock()


def nvjpeg_decode(data: Any, device: torch.device) -> Any:
    """``torchvision.io.decode_jpeg(data, RGB, device)`` with a CUDA stream of its own current.

    torchvision's CUDA decoder allocates its outputs on the caller's current stream, then writes them
    from nvJPEG's own stream without waiting for the caller's (nvJPEG's hardware engine does not keep
    stream order either). The caching allocator hands out a block as soon as it was freed on the current
    stream, while kernels queued there may still read it; the decoder then overwrites memory those kernels
    are about to read (pytorch/vision#9606: 199 of 200 iterations corrupted in its reproducer, none with
    another stream current). With two engine processes on one GPU, a few compare requests in thousands were
    answered "no face found" without this, never with one engine.

    With a stream current that only decodes, the outputs come from that stream's blocks; the caller's
    stream then waits for it and the outputs are marked as used by the caller's stream, so their memory
    goes back to the decode stream only after the caller's work on them is done.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    if device.type != "cuda":  # a stand-in decoder (tests)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _decode_streams_lock:
        side = _decode_streams.get(index)
        if side is None:
            side = _decode_streams[index] = torch.cuda.Stream(device=index)
    caller = torch.cuda.current_stream(index)
    with torch.cuda.stream(side):
        out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    caller.wait_stream(side)
    for t in out if isinstance(out, list) else [out]:
        t.record_stream(caller)
    return out


def run_decode(plan: DecodePlan) -> list[Any]:
    """Device half of a batch decode: one batched nvJPEG call, then host results copied to the device.

    Returns one ``(3, H, W) uint8`` RGB tensor on ``plan.device`` per item, or the item's
    :class:`FacegateError`. If nvJPEG rejects the batch, its items are retried one by one; an item that
    still fails (or decodes to an unexpected shape) is decoded on the host.
    """
    import torch

    out: list[Any] = [None] * len(plan.datas)
    done = dict(plan.done)
    if plan.gpu_items:
        idx = list(plan.gpu_items)
        raw = [torch.frombuffer(bytearray(plan.datas[i]), dtype=torch.uint8) for i in idx]
        try:
            decoded = nvjpeg_decode(raw, plan.device)
        except Exception as exc:  # nvJPEG refuses the whole batch if one image fails
            log.debug("batched nvJPEG decode failed (%s); retrying one by one", exc)
            decoded = []
            for r in raw:
                try:
                    decoded.append(nvjpeg_decode(r, plan.device))
                except Exception as exc1:
                    log.debug("nvJPEG failed on one image (%s); host fallback", exc1)
                    decoded.append(None)
        for i, t in zip(idx, decoded, strict=True):
            orient, h, w = plan.gpu_items[i]
            if t is not None and tuple(t.shape) == (3, h, w):
                out[i] = _orient_chw(t, orient)
                continue
            try:
                done[i] = decode_image(plan.datas[i], max_bytes=plan.max_bytes, max_pixels=plan.max_pixels)
            except FacegateError as exc:
                done[i] = exc
    for i, res in done.items():
        out[i] = res if isinstance(res, FacegateError) else _to_device(res, plan.device)
    return out


def decode_jpeg_batch_cuda(
    datas: list[bytes],
    device: str | torch.device = "cuda",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    return_exceptions: bool = False,
) -> list[Any]:
    """Decode a batch of images onto ``device``, with nvJPEG for JPEGs when it is available.

    Every item gets the same limits, orientation and colour handling as :func:`decode_image`. JPEGs
    that pass the header checks go to one batched ``torchvision.io.decode_jpeg(device=...)`` call; if
    nvJPEG rejects the batch, they are retried one by one, and any that still fail — like every
    non-JPEG, CMYK or out-of-limits item, and everything when :func:`gpu_decode_available` is False or
    ``device`` is not CUDA — are decoded on the CPU by :func:`decode_image` and copied to ``device``.
    ``run_decode(plan_decode(...))``: the serving engine calls the two halves on different threads.

    Args:
        datas: encoded images.
        device: target device.
        max_bytes, max_pixels: limits as in :func:`decode_image`.
        return_exceptions: when True a failing item's slot holds its :class:`FacegateError` instead of
            the call raising the first one.

    Returns:
        One ``(3, H, W) uint8`` tensor on ``device`` per input (RGB), or errors (``return_exceptions``).

    Raises:
        FacegateError: the first item's error (``detail['index']`` names it) unless ``return_exceptions``.
    """
    out = run_decode(plan_decode(datas, device, max_bytes=max_bytes, max_pixels=max_pixels))
    for i, res in enumerate(out):
        if isinstance(res, FacegateError):
            res.detail.setdefault("index", i)
            if not return_exceptions:
                raise res
    return out
