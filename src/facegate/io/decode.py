"""Image decoding with limits and typed errors: untrusted bytes → ``(H, W, 3) uint8`` RGB, or EmptyInputError,
ImageTooLargeError or ImageDecodeError (no Pillow / OpenCV exception escapes).

Nothing is decoded before the limits pass: byte count, header (format allow-list, ``max_pixels``), then JPEG /
PNG completeness. Plain JPEGs and opaque PNGs without EXIF/XMP go to OpenCV (the same pixels as Pillow, faster),
the rest to Pillow; EXIF orientation is applied on both, alpha composited on white, multi-frame files give their
first frame. :func:`decode_batch` decodes a batch with nvJPEG and falls back to the host.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import stat
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
from PIL import Image, ImageFile

from facegate.errors import (
    EmptyInputError,
    FacegateError,
    ImageDecodeError,
    ImageTooLargeError,
    InvalidParameterError,
    PathNotAllowedError,
)
from facegate.io.jpeg import JpegHeader, NotPlain, read_jpeg_header, segments

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Image.init()  # registers every plugin Pillow has (AVIF from Pillow 11.2 with libavif), so FORMATS sees them
#: Formats we let Pillow open (header sniffing, never the file name). MPO arrives through "JPEG".
FORMATS: tuple[str, ...] = tuple(
    f for f in ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "AVIF") if f in Image.OPEN
)

_JPEG_FORMATS = frozenset({"JPEG", "MPO"})
# IMREAD_COLOR_RGB exists from OpenCV 4.10; older builds (pyproject allows >= 4.8) decode BGR and swap.
_CV2_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)
_CV2_FLAGS = (cv2.IMREAD_COLOR if _CV2_RGB is None else _CV2_RGB) | cv2.IMREAD_IGNORE_ORIENTATION
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")

# EXIF orientation → what undoes it (as PIL.ImageOps.exif_transpose): swap H and W or not, then flip these axes.
_ORIENT = {2: (0, (1,)), 3: (0, (0, 1)), 4: (0, (0,)), 5: (1, ()), 6: (1, (1,)), 7: (1, (0, 1)), 8: (1, (0,))}


def _too_large(unit: str, limit: int, actual: int, **extra: Any) -> ImageTooLargeError:
    return ImageTooLargeError(
        f"image has {actual} {unit}, more than the limit of {limit}",
        detail={"unit": unit, "limit": limit, "actual": actual, **extra},
    )


def _open_header(data: bytes, max_pixels: int) -> Image.Image:
    """Pillow's lazy open (header only), with every Pillow failure converted (a decompression bomb past
    ``max_pixels`` is refused by that limit, as any other image past it)."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        m = _BOMB_PIXELS.search(str(exc))
        actual = int(m.group(1)) if m else -1
        if actual > max_pixels:
            raise _too_large("pixels", max_pixels, actual) from exc
        raise ImageTooLargeError(
            f"image is too large for the decoder: {exc}",
            detail={"unit": "pixels", "limit": 2 * (Image.MAX_IMAGE_PIXELS or 0), "actual": actual},
        ) from exc
    except Image.UnidentifiedImageError as exc:
        raise ImageDecodeError(
            f"not an image, or not a supported format ({', '.join(FORMATS)})", detail={"supported": list(FORMATS)}
        ) from exc
    except Exception as exc:  # SyntaxError, struct.error, OSError, ValueError, ... from plugins
        raise ImageDecodeError(f"cannot read the image header: {exc}") from exc


def _jpeg_complete(data: bytes) -> bool:
    """Whether ``FF D9`` (EOI, never inside entropy-coded data) follows the first scan: the file is not truncated."""
    return any(marker == 0xDA and data.find(b"\xff\xd9", i) != -1 for marker, i, _ in segments(data))


def _png_complete(data: bytes) -> bool:
    """Whether the chunk chain is intact up to IEND; also keeps a corrupt chunk length (which OpenCV's PNG reader
    takes seconds over) away from OpenCV."""
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


def _orientation(img: Image.Image) -> int:
    """EXIF/XMP orientation tag (1–8), 1 when absent or unreadable."""
    try:
        value = int(img.getexif().get(0x0112, 1))
    except Exception as exc:  # malformed EXIF must not make a decodable image fail
        log.debug("ignoring unreadable EXIF: %s", exc)
        return 1
    return value if 1 <= value <= 8 else 1


def _apply_orientation(arr: Any, orientation: int, h_axis: int = 0) -> Any:
    """Undo an EXIF orientation; a contiguous copy. ``arr``: ``(H, W, C)`` ndarray, or a ``(C, H, W)`` tensor
    with ``h_axis=1``."""
    swap, flips = _ORIENT.get(orientation, (0, ()))
    if swap:
        arr = arr.swapaxes(h_axis, h_axis + 1)
    dims = tuple(h_axis + a for a in flips)
    if isinstance(arr, np.ndarray):
        return np.ascontiguousarray(np.flip(arr, dims) if dims else arr)
    return (arr.flip(dims) if dims else arr).contiguous()


def _fast_path(img: Image.Image, fmt: str, data: bytes) -> bool:
    """Whether OpenCV may decode these bytes with the same result as the Pillow path."""
    if img.mode not in ("L", "RGB"):
        return False
    if fmt in _JPEG_FORMATS:
        return True
    # a PNG's orientation comes from eXIf or XMP, which Pillow may only see after a full load: those take Pillow
    return (
        fmt == "PNG"
        and "transparency" not in img.info
        and not getattr(img, "is_animated", False)
        and b"eXIf" not in data
        and b"XML:com.adobe.xmp" not in data
    )


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


def _pil_to_rgb(img: Image.Image) -> np.ndarray:
    """Fully decode a Pillow image (first frame) to ``(H, W, 3) uint8`` RGB."""
    img.load()  # forced: truncated data raises here (LOAD_TRUNCATED_IMAGES is False)
    mode = img.mode
    if mode in _ALPHA_MODES or (mode in ("P", "L", "RGB", "1") and "transparency" in img.info):
        rgba = np.asarray(img.convert("RGBA"), np.uint16)  # composited on white: c·a/255 + 255·(1 − a/255), rounded
        rgb, a = rgba[..., :3], rgba[..., 3:4]
        return ((rgb * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)
    if mode in _SIXTEEN_BIT or mode == "I":
        v = np.asarray(img).astype(np.int64)
        grey = ((np.clip(v, 0, 65535) * 2 + 257) // 514).astype(np.uint8)  # round(v / 257)
        return np.repeat(grey[..., None], 3, axis=2)
    if mode == "F":
        grey = np.clip(np.rint(np.nan_to_num(np.asarray(img, np.float64))), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


#: Uploads of at most this many pixels (by their header) decode on the caller's thread: an aligned crop decodes
#: faster than a round trip through a thread pool.
INLINE_DECODE_PIXELS = 160 * 160


def decode_if_small(data: bytes, *, max_bytes: int, max_pixels: int) -> np.ndarray | None:
    """:func:`decode_image` of a plain JPEG or PNG of at most :data:`INLINE_DECODE_PIXELS` (by its header), else
    ``None``."""
    if not isinstance(data, bytes) or len(data) > max_bytes:
        return None
    try:
        hdr = read_jpeg_header(data)
        pixels = hdr.width * hdr.height
    except NotPlain:  # a PNG's size is in its IHDR chunk; anything else is not small by this rule
        if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
            return None
        pixels = int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big")
    return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels) if pixels <= INLINE_DECODE_PIXELS else None


def decode_image(data: bytes, *, max_bytes: int, max_pixels: int) -> np.ndarray:
    """Untrusted image bytes → ``(H, W, 3) uint8`` RGB, C-contiguous, EXIF orientation applied; ImageTooLargeError
    names ``{unit, limit, actual}``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidParameterError(f"image data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) == 0:
        raise EmptyInputError("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise _too_large("bytes", max_bytes, len(data))
    if ImageFile.LOAD_TRUNCATED_IMAGES:  # Pillow's default refuses truncated images; a library may have flipped it
        log.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES was True; facegate resets it to False")
        ImageFile.LOAD_TRUNCATED_IMAGES = False
    hdr = _plain_jpeg_header(data, max_pixels)  # a plain JPEG goes to OpenCV without Pillow's header parse
    if hdr is not None and (arr := _decode_cv2(data, (hdr.width, hdr.height))) is not None:
        return _apply_orientation(arr, hdr.orientation)

    img = _open_header(data, max_pixels)
    try:
        fmt = str(img.format)
        width, height = img.size
        if width * height > max_pixels:
            raise _too_large("pixels", max_pixels, width * height, width=width, height=height)
        if (fmt in _JPEG_FORMATS and not _jpeg_complete(data)) or (fmt == "PNG" and not _png_complete(data)):
            raise ImageDecodeError(f"the {fmt} data is truncated", detail={"format": fmt})
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


def _plain_jpeg_header(data: bytes, max_pixels: int) -> JpegHeader | None:
    """The header of a plain JPEG within ``max_pixels`` and complete (else ImageTooLargeError, ImageDecodeError);
    ``None``: not plain, or a decompression bomb (Pillow's path gives those their answer)."""
    try:
        hdr = read_jpeg_header(data)
    except NotPlain:
        return None
    w, h = hdr.width, hdr.height
    if Image.MAX_IMAGE_PIXELS and w * h > 2 * Image.MAX_IMAGE_PIXELS:
        return None
    if w * h > max_pixels:
        raise _too_large("pixels", max_pixels, w * h, width=w, height=h)
    if not hdr.complete:
        raise ImageDecodeError("the JPEG data is truncated", detail={"format": "JPEG"})
    return hdr


def _refuse(path: str | os.PathLike[str], why: str) -> PathNotAllowedError:
    return PathNotAllowedError(f"reading {os.fspath(path)!s} is not allowed: {why}", detail={"reason": why})


def read_image_file(path: str | Path, *, allowed_roots: Sequence[Path], max_bytes: int, max_pixels: int) -> np.ndarray:
    """:func:`decode_image` of a server-side file whose real path lies inside ``allowed_roots``, opened with
    ``O_NOFOLLOW`` and re-checked with ``fstat`` (a file swapped for a symlink or FIFO is refused). A missing file
    is PathNotAllowedError too: the answer does not reveal what exists."""
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
    except OSError as exc:  # the refusals above are FacegateErrors, not OSErrors: they pass
        raise ImageDecodeError(f"cannot read {real}: {exc.strerror or exc}", detail={"path": str(real)}) from exc
    finally:
        if fd >= 0:
            os.close(fd)
    return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)


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
    """Whether JPEGs for ``device`` go to nvJPEG (the tests replace it and :func:`nvjpeg_decode` to drive that
    path on the CPU)."""
    return device.type == "cuda" and gpu_decode_available()


def _gpu_candidate(data: bytes, max_bytes: int, max_pixels: int) -> tuple[int, int, int] | None:
    """``(orientation, H, W)`` when ``data`` is a complete 8-bit grey/RGB JPEG within the limits, else None."""
    if not data or len(data) > max_bytes:
        return None
    try:
        hdr = _plain_jpeg_header(data, max_pixels)
    except FacegateError:  # the host path gives it its answer
        return None
    return _gpu_candidate_pil(data, max_pixels) if hdr is None else (hdr.orientation, hdr.height, hdr.width)


def _gpu_candidate_pil(data: bytes, max_pixels: int) -> tuple[int, int, int] | None:
    """:func:`_gpu_candidate` by Pillow's lazy open."""
    try:
        img = _open_header(data, max_pixels)
    except FacegateError:
        return None
    try:
        w, h = img.size
        if img.format not in _JPEG_FORMATS or img.mode not in ("L", "RGB") or w * h > max_pixels:
            return None
        return (_orientation(img), h, w) if _jpeg_complete(data) else None
    finally:
        img.close()


_decode_streams: dict[int, Any] = {}
_decode_streams_lock = threading.Lock()


def nvjpeg_decode(data: Any, device: torch.device) -> Any:
    """``torchvision.io.decode_jpeg(data, RGB, device)`` on a decode-only CUDA stream: the decoder allocates on the
    current stream but writes from nvJPEG's without waiting, overwriting freed blocks the caller's kernels still
    read (pytorch/vision#9606). The caller's stream waits for the decode stream and owns the outputs."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

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


def decode_batch(datas: Sequence[bytes], device: str | torch.device, *, max_bytes: int, max_pixels: int) -> list[Any]:
    """Per item a ``(3, H, W) uint8`` RGB tensor on ``device`` or its FacegateError (never raises for a bad item).
    Complete 8-bit JPEGs within the limits go to one batched nvJPEG call on CUDA, retried one by one if rejected;
    the rest (PNG, CMYK, out of limits, broken; all of them off CUDA) and what nvJPEG fails on decode on the host."""
    import torch

    dev = torch.device(device)
    out: list[Any] = [None] * len(datas)
    gpu_items: dict[int, tuple[int, int, int]] = {}
    if _use_nvjpeg(dev):
        for i, data in enumerate(datas):
            if (info := _gpu_candidate(bytes(data), max_bytes, max_pixels)) is not None:
                gpu_items[i] = info
    if gpu_items:
        raw = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in gpu_items]
        try:
            decoded = nvjpeg_decode(raw, dev)
        except Exception as exc:  # nvJPEG refuses the whole batch if one image fails
            log.debug("batched nvJPEG decode failed (%s); retrying one by one", exc)
            decoded = []
            for r in raw:
                try:
                    decoded.append(nvjpeg_decode(r, dev))
                except Exception as exc1:
                    log.debug("nvJPEG failed on one image (%s); host fallback", exc1)
                    decoded.append(None)
        for (i, (orient, h, w)), t in zip(gpu_items.items(), decoded, strict=True):
            if t is not None and tuple(t.shape) == (3, h, w):
                out[i] = _apply_orientation(t, orient, h_axis=1)
    for i, data in enumerate(datas):  # the rest on the host, as (3, H, W) on the device: one blocking copy each
        if out[i] is None:
            try:
                arr = decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
                out[i] = torch.from_numpy(arr).permute(2, 0, 1).contiguous().to(dev)
            except FacegateError as exc:
                out[i] = exc
    return out
