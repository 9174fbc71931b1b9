"""facegate.api.forms: the small-body multipart reader answers as Starlette's parser, or hands over."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from facegate.api.forms import MAX_FIELDS, MAX_FILES, MAX_PART_SIZE, parse_small_multipart, read_form

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from rawhttp import encode_multipart

JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 3 + b"\r\n--not-the-boundary\r\n"


def _httpx_body(data: dict[str, str], files: list[tuple[str, tuple[str, bytes, str]]]) -> tuple[bytes, str]:
    req = httpx.Request("POST", "http://x/api/embed", data=data, files=files)
    return req.read(), req.headers["content-type"]


async def _starlette_form(body: bytes, ctype: str, fast: bool = False) -> FormData:
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}
    request = Request(scope, receive)
    return await (read_form(request) if fast else request.form())


async def _snapshot(form: FormData) -> list[tuple]:
    out = []
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            data = await value.read()
            meta = (value.filename, value.content_type, value.size, sorted(value.headers.items()))
            out.append((key, "file", meta, data))
        else:
            out.append((key, "field", value))
    return out


BODIES = {
    "httpx_fields_and_files": _httpx_body(
        {"aligned": "true", "select": "largest"},
        [("images", ("a.jpg", JPEG, "image/jpeg")), ("images", ("b.png", b"\x89PNG" + JPEG, "image/png"))],
    ),
    "rawhttp": encode_multipart({"aligned": "false"}, [("img1", ("x.jpg", JPEG, "image/jpeg"))], "bnd123"),
    "utf8_names_and_empty_file": _httpx_body({"notes": "naïve ✓"}, [("images", ("Łódź é.jpg", b"", "image/jpeg"))]),
    "fields_only": encode_multipart({"paths": "/a.jpg", "select": "all"}, [], "b0"),
}


@pytest.mark.parametrize("case", sorted(BODIES))
def test_same_form_as_starlette(case: str) -> None:
    body, ctype = BODIES[case]
    fast = parse_small_multipart(body, ctype)
    assert fast is not None, "a plain body must be answered here"
    want = asyncio.run(_snapshot(asyncio.run(_starlette_form(body, ctype))))
    assert asyncio.run(_snapshot(fast)) == want
    assert asyncio.run(_snapshot(asyncio.run(_starlette_form(body, ctype, fast=True)))) == want


def test_files_are_read_inline() -> None:
    body, ctype = BODIES["rawhttp"]
    form = parse_small_multipart(body, ctype)
    assert form is not None
    upload = form["img1"]
    assert isinstance(upload, UploadFile) and upload._in_memory  # no thread-pool hop per read


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b"preamble\r\n" + b,  # a preamble before the first delimiter
        lambda b: b.replace(b"\r\n", b"\n"),  # bare LF line ends
        lambda b: b.replace(b"Content-Disposition", b"X-Other", 1),  # a part without a disposition
        lambda b: b.replace(b'name="aligned"', b'filename="x"', 1),  # a disposition without a name
        lambda b: b[: len(b) // 2],  # truncated
    ],
    ids=["preamble", "lf", "no_disposition", "no_name", "truncated"],
)
def test_unusual_bodies_go_to_starlette(mangle) -> None:  # type: ignore[no-untyped-def]
    body, ctype = BODIES["rawhttp"]
    assert parse_small_multipart(mangle(body), ctype) is None


def test_limits_and_charset_go_to_starlette() -> None:
    body = BODIES["httpx_fields_and_files"][0]
    files = [("images", ("a.jpg", b"x", "image/jpeg"))]
    assert parse_small_multipart(*_httpx_body({}, files * MAX_FILES)) is not None
    assert parse_small_multipart(*_httpx_body({}, files * (MAX_FILES + 1))) is None
    fields = {f"f{i}": "x" for i in range(MAX_FIELDS)}
    assert parse_small_multipart(*encode_multipart(fields, [], "b1")) is not None
    assert parse_small_multipart(*encode_multipart({**fields, "one_more": "x"}, [], "b1")) is None
    assert parse_small_multipart(*encode_multipart({"a": "x" * MAX_PART_SIZE}, [], "b1")) is not None
    assert parse_small_multipart(*encode_multipart({"a": "x" * (MAX_PART_SIZE + 1)}, [], "b1")) is None
    cs_body, cs_type = encode_multipart({"_charset_": "latin-1", "a": "x"}, [], "b1")
    assert parse_small_multipart(*encode_multipart({"charset": "latin-1", "a": "x"}, [], "b1")) is not None
    assert parse_small_multipart(cs_body, cs_type) is None  # a multipart body, refused for its _charset_ alone
    assert parse_small_multipart(body, "multipart/form-data") is None  # no boundary


def test_the_request_falls_back_to_starlette_over_the_cached_body() -> None:
    body, ctype = BODIES["httpx_fields_and_files"]
    with_preamble = b"a preamble\r\n" + body  # RFC 2046 allows one; neither parser reads it
    assert parse_small_multipart(with_preamble, ctype) is None
    for fast in (False, True):  # the same answer from Starlette's parser, over the cached body
        with pytest.raises(MultiPartException, match="Invalid multipart data"):
            asyncio.run(_starlette_form(with_preamble, ctype, fast))
    wrong_boundary = b"--bnd\r\n" + body.split(b"\r\n", 1)[1]  # a different boundary than the header says
    for fast in (False, True):
        with pytest.raises(MultiPartException):
            asyncio.run(_starlette_form(wrong_boundary, ctype, fast))


def test_a_charset_other_than_utf8_goes_to_starlette() -> None:
    """Starlette decodes names and values in the Content-Type's charset: the fast parser reads UTF-8 alone."""
    body, ctype = BODIES["utf8_names_and_empty_file"]
    assert parse_small_multipart(body, ctype + "; charset=UTF-8") is not None
    latin = ctype + "; charset=latin-1"
    assert parse_small_multipart(body, latin) is None
    want = asyncio.run(_snapshot(asyncio.run(_starlette_form(body, latin))))
    assert want[0] == ("notes", "field", "naïve ✓".encode().decode("latin-1"))
    assert asyncio.run(_snapshot(asyncio.run(_starlette_form(body, latin, fast=True)))) == want
