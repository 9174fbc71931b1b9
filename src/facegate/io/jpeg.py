"""A JPEG marker walker: size, components, EXIF orientation and completeness of a plain JPEG, in µs (Pillow's lazy
open costs far more). Plain: 8-bit, 1 or 3 components, at most one EXIF block with a SHORT orientation, no XMP,
Adobe, MPO or unknown marker; anything else raises :class:`NotPlain` and the caller asks Pillow.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
#: Segments skipped without a look inside: tables, restart interval, comments, APP0 (JFIF) and the APPn
#: that Pillow does not interpret for size, mode or orientation.
_SKIP = frozenset({0xC4, 0xCC, 0xDB, 0xDD, 0xFE, 0xE0, 0xE3, 0xE4, 0xE5, 0xE6, 0xE7, 0xE8, 0xE9, 0xEA})
_XMP = b"http://ns.adobe.com/xap/1.0/"


class NotPlain(Exception):  # noqa: N818 - an answer, not an error
    """The file is not a plain JPEG as this module defines it: ask Pillow instead."""


@dataclass(frozen=True, slots=True)
class JpegHeader:
    """Frame size in pixels (before orientation), EXIF orientation 1–8 (1 when absent or out of range, as Pillow
    reads it), and whether an EOI follows the first scan (not truncated)."""

    height: int
    width: int
    orientation: int
    complete: bool


def _exif_orientation(tiff: bytes) -> int:
    """The orientation tag (0x0112) of IFD0 of an EXIF block's TIFF data; 1 when there is none."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        raise NotPlain("short EXIF or unknown byte order")
    order = "<" if tiff[:2] == b"II" else ">"
    magic, ifd = struct.unpack_from(order + "HI", tiff, 2)
    if magic != 42 or ifd < 8 or ifd + 2 > len(tiff):
        raise NotPlain("EXIF magic or IFD0 offset")
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    for e in range(ifd + 2, ifd + 2 + 12 * count, 12):
        if e + 12 > len(tiff):
            raise NotPlain("EXIF IFD0 entry out of range")
        tag, kind, n, value = struct.unpack_from(order + "HHIH", tiff, e)
        if tag != 0x0112:
            continue
        if kind != 3 or n != 1:
            raise NotPlain("EXIF orientation is not one SHORT")
        return value if 1 <= value <= 8 else 1
    return 1


def segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """``(marker, start, end)`` of each marker segment after SOI (``data[start]`` its ``FF``), up to and including
    the first SOS (whatever its length field says); it stops early at a byte that is not a marker or a segment that
    runs past the end."""
    n, i = len(data), 2
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        end = i + 2 + length
        if marker != 0xDA and (length < 2 or end > n):
            return
        yield marker, i, end
        if marker == 0xDA:
            return
        i = end


def read_jpeg_header(data: bytes) -> JpegHeader:
    """Walk ``data``'s marker segments from SOI to the first SOS; NotPlain for anything but a plain JPEG."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        raise NotPlain("no SOI")
    frame: tuple[int, int] | None = None
    orientation: int | None = None
    for marker, i, end in segments(data):
        length = end - i - 2
        if marker == 0xDA:
            if frame is None or length < 2 or end > len(data):
                raise NotPlain("scan before the frame header, or past the end")
            return JpegHeader(*frame, orientation or 1, data.find(b"\xff\xd9", i) != -1)
        if marker in _SOF:
            if frame is not None or length < 8:
                raise NotPlain("second or short frame header")
            precision, comps = data[i + 4], data[i + 9]
            h, w = (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8]
            if precision != 8 or comps not in (1, 3) or h == 0 or w == 0:
                raise NotPlain("not 8-bit grey/YCbCr, or a size to come later (DNL)")
            frame = (h, w)
        elif marker == 0xE1:
            body = data[i + 4 : end]
            if body.startswith(b"Exif\x00\x00"):
                if orientation is not None:
                    raise NotPlain("two EXIF blocks")
                orientation = _exif_orientation(body[6:])
            elif body.startswith(_XMP):
                raise NotPlain("XMP (may carry the orientation)")
        elif marker == 0xE2:
            if data[i + 4 : i + 8] == b"MPF\x00":
                raise NotPlain("MPO index")
        elif marker not in _SKIP and not 0xEB <= marker <= 0xED and marker != 0xEF:
            raise NotPlain(f"marker {marker:#04x}")  # Adobe (APP14), JPGn, DNL, DHP, EXP, ...
    raise NotPlain("no scan, a byte that is not a marker, or a segment past the end")
