"""Hypothesis fuzzing of the decoders, the multipart reader and the bounded JSON parser (a bounded slice for
CI; ``benchmarks/fuzz_api.py`` runs 100,000 decoder inputs).

Each must either return a well-formed result or raise one of facegate's input errors (a 4xx): anything
else (an IndexError, a MemoryError, a crash) is a bug.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from facegate.api.forms import parse_small_multipart
from facegate.api.limits import loads_limited
from facegate.config import Limits
from facegate.errors import InputError
from facegate.io.decode import decode_if_small, decode_image

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_BYTES, MAX_PIXELS = 1 << 20, 1 << 20


def _seed_images() -> list[bytes]:
    import cv2
    from PIL import Image

    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)
    out = []
    for ext in (".jpg", ".png", ".bmp", ".webp"):
        ok, buf = cv2.imencode(ext, img)
        assert ok
        out.append(buf.tobytes())
    for mode in ("L", "RGBA", "P", "I;16", "CMYK"):
        b = io.BytesIO()
        Image.new(mode, (9, 7)).save(b, format="TIFF" if mode in ("I;16", "CMYK") else "PNG")
        out.append(b.getvalue())
    b = io.BytesIO()
    Image.new("RGB", (5, 5)).save(b, format="GIF")
    out.append(b.getvalue())
    return out


SEEDS = _seed_images()


@st.composite
def mutated_image(draw: st.DrawFn) -> bytes:
    """A valid small image with bytes flipped, cut, or spliced (headers are where parsers go wrong)."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "header"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(max_size=64))
        else:  # the size fields of the first 64 bytes
            p = draw(st.integers(0, min(63, len(data) - 1)))
            data[p] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80]))
    return bytes(data)


def check_decode(data: bytes) -> None:
    """The decoders' contract on one input."""
    for fn in (decode_image, decode_if_small):
        try:
            arr = fn(data, max_bytes=MAX_BYTES, max_pixels=MAX_PIXELS)
        except InputError:
            continue
        if arr is None:  # decode_if_small: not small, decoded elsewhere
            continue
        assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3
        assert arr.shape[0] * arr.shape[1] <= MAX_PIXELS


@FUZZ
@given(st.one_of(mutated_image(), st.binary(max_size=2048)))
def test_decoders_never_crash(data: bytes) -> None:
    check_decode(data)


@st.composite
def multipart_body(draw: st.DrawFn) -> tuple[bytes, str]:
    boundary = draw(st.sampled_from(["b", "----x", "a" * 70]))
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.text(max_size=8))
        head = f'Content-Disposition: form-data; name="{name}"'
        if draw(st.booleans()):
            head += f'; filename="{draw(st.text(max_size=8))}"'
        parts.append(head.encode("utf-8", "surrogatepass") + b"\r\n\r\n" + draw(st.binary(max_size=64)))
    body = (
        b"".join(b"--" + boundary.encode() + b"\r\n" + p + b"\r\n" for p in parts)
        + b"--"
        + boundary.encode()
        + b"--\r\n"
    )
    if draw(st.booleans()):  # damage it
        pos = draw(st.integers(0, len(body)))
        body = body[:pos] + draw(st.binary(max_size=16)) + body[pos + draw(st.integers(0, 8)) :]
    return body, f"multipart/form-data; boundary={boundary}"


@FUZZ
@given(multipart_body())
def test_multipart_reader_never_crashes(case: tuple[bytes, str]) -> None:
    body, ctype = case
    form = parse_small_multipart(body, ctype)
    assert form is None or all(isinstance(k, str) for k, _ in form.multi_items())


JSON_TEXT = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300), JSON_TEXT.map(repr)))
def test_bounded_json_never_crashes(text: str | bytes) -> None:
    limits = Limits(json_max_bytes=1024, json_max_depth=4, json_max_number_digits=10)
    with contextlib.suppress(InputError):
        loads_limited(text, limits)


def test_bounded_json_cases() -> None:
    limits = Limits()
    assert loads_limited('{"a": [1, 2.5, "x", {"b": null}]}', limits) == {"a": [1, 2.5, "x", {"b": None}]}
    assert loads_limited('"[[[{{"', limits) == "[[[{{"  # brackets inside strings do not count as depth
    for bad in ("[" * 100_000, '"\\ud800"', '{"\\udfff": 1}', "9" * 5000, "NaN", "-Infinity", b"\xff", "[1,]"):
        try:
            loads_limited(bad, limits)
        except InputError as exc:
            assert exc.code in ("invalid_parameter", "body_too_large")
        else:
            raise AssertionError(f"accepted {bad[:20]!r}")
