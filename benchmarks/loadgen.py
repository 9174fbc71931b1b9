"""Closed-loop HTTP load generator for a running facegate server (``python benchmarks/loadgen.py --help``).

``concurrency`` clients share one HTTP client (``rawhttp.py`` beside it, or httpx), each sending when answered,
for ``duration_s`` or ``n_requests`` after ``warmup`` unrecorded ones. Kinds: ``compare`` (two pool images),
``embed`` (``images_per_request`` photos), ``embed_aligned`` (112×112 crops). Latencies (send to full body) are
over 2xx answers; other statuses and transport errors count in ``errors``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import mimetypes
import platform
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
import numpy as np

from facegate.errors import EmptyInputError, EngineClosedError, InvalidParameterError
from rawhttp import RawClient, TransportError, encode_multipart, encode_request

log = logging.getLogger(__name__)

BenchKind = Literal["compare", "embed_aligned", "embed"]
KINDS: tuple[str, ...] = get_args(BenchKind)
Transport = Literal["raw", "httpx"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
#: what a request that got no response raises (counted by class name)
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, TransportError)
#: ``send(i)`` → ``(status, body)`` of request number ``i``
Sender = Callable[[int], Awaitable[tuple[int, bytes]]]
IMAGE_SUFFIXES: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})

#: an image for the pool: ``(file name, bytes, MIME type)``
ImageItem = tuple[str, bytes, str]


@dataclass(frozen=True, slots=True)
class BenchResult:
    """One run: ``n`` requests answered, ``n_ok`` 2xx; latencies in ms over the 2xx (``None`` without);
    ``errors`` by status or transport error; ``item_errors``: per-image codes in 2xx embed answers."""

    n: int
    n_ok: int
    elapsed_s: float
    req_s: float
    ok_req_s: float
    images_s: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    max_ms: float | None
    errors: dict[str, int] = field(default_factory=dict)
    item_errors: dict[str, int] = field(default_factory=dict)
    error_samples: dict[str, list[str]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 3)
        return out

    def summary(self) -> str:
        def fmt(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1f}"

        errs = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"{self.settings.get('kind')} c={self.settings.get('concurrency')}: {self.n} requests in "
            f"{self.elapsed_s:.2f} s = {self.req_s:.1f} req/s ({self.images_s:.1f} images/s); latency ms "
            f"p50 {fmt(self.p50_ms)} p95 {fmt(self.p95_ms)} p99 {fmt(self.p99_ms)}; errors: {errs}"
        )


def collect_images(paths: Sequence[Path | str], *, limit: int | None = None) -> list[Path]:
    """Files and folders (recursively, by image suffix) → a sorted list of at most ``limit`` image files."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found.extend(sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in IMAGE_SUFFIXES))
        elif p.is_file():
            found.append(p)
        else:
            raise InvalidParameterError(f"image path does not exist: {p}", detail={"path": str(p)})
        if limit is not None and len(found) >= limit:
            break
    found = found[:limit]
    if not found:
        raise EmptyInputError("no images found for the benchmark", detail={"paths": [str(p) for p in paths]})
    return found


def _load_pool(images: Sequence[Path | str | bytes] | bytes) -> list[ImageItem]:
    """Read the images into memory once: ``[(name, bytes, mime)]``."""
    if isinstance(images, bytes | bytearray):
        images = [bytes(images)]
    pool: list[ImageItem] = []
    for i, item in enumerate(images):
        if isinstance(item, bytes | bytearray):
            data = bytes(item)
            name = f"image{i}.jpg" if data[:3] == b"\xff\xd8\xff" else f"image{i}.png"
        else:
            path = Path(item)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise InvalidParameterError(f"cannot read image {path}: {exc}", detail={"path": str(path)}) from exc
            name = path.name
        if not data:
            raise EmptyInputError(f"image {i} is empty")
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        pool.append((name, data, mime))
    if not pool:
        raise EmptyInputError("the benchmark needs at least one image")
    return pool


class _RequestMaker:
    """Builds the i-th request of a kind, cycling through the image pool."""

    def __init__(self, kind: BenchKind, pool: list[ImageItem], images_per_request: int, crops: bool) -> None:
        self.kind = kind
        self.pool = pool
        self.k = images_per_request
        self.crops = crops
        self._cache: dict[tuple[str, int], bytes] = {}

    @property
    def images_per_request(self) -> int:
        return 2 if self.kind == "compare" else self.k

    def __call__(self, i: int) -> dict[str, Any]:
        """Keyword arguments for ``client.post`` of request number ``i``."""
        n = len(self.pool)
        if self.kind == "compare":
            a, b = self.pool[(2 * i) % n], self.pool[(2 * i + 1) % n]
            params = {"crops": "true"} if self.crops else None
            return {"url": "/api/compare", "files": [("img1", a), ("img2", b)], "params": params}
        files = [("images", self.pool[(i * self.k + j) % n]) for j in range(self.k)]
        data = {"aligned": "true" if self.kind == "embed_aligned" else "false"}
        return {"url": "/api/embed", "files": files, "data": data}

    def encoded(self, i: int, host: str) -> bytes:
        """Request number ``i`` as HTTP/1.1 bytes for ``host`` (cached: requests repeat with the pool)."""
        n = len(self.pool)
        key = (host, (2 * i) % n if self.kind == "compare" else (i * self.k) % n)
        data = self._cache.get(key)
        if data is None:
            kw = self(i)
            body, ctype = encode_multipart(kw.get("data"), kw["files"])
            data = encode_request("POST", host, kw["url"], params=kw.get("params"), body=body, content_type=ctype)
            self._cache[key] = data
        return data


#: Error bodies kept per error kind, and their length.
ERROR_SAMPLES = 3
ERROR_SAMPLE_BYTES = 400


@dataclass
class _Recorder:
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: dict[str, list[str]] = field(default_factory=dict)
    item_errors: Counter[str] = field(default_factory=Counter)
    n: int = 0
    first_send: float | None = None
    last_done: float = 0.0


def _count_item_errors(content: bytes, rec: _Recorder) -> None:
    try:
        body = json.loads(content)
    except ValueError:
        rec.item_errors["invalid_json"] += 1
        return
    for item in body.get("results", []) if isinstance(body, dict) else []:
        if isinstance(item, dict) and "error" in item:
            err = item["error"]
            rec.item_errors[str(err.get("code", "unknown")) if isinstance(err, dict) else "unknown"] += 1


async def _phase(
    send: Sender,
    make: _RequestMaker,
    concurrency: int,
    n_requests: int | None,
    duration_s: float | None = None,
    start_index: int = 0,
    progress: Any | None = None,
) -> _Recorder:
    """Run ``concurrency`` closed-loop workers until ``n_requests`` were sent or ``duration_s`` passed."""
    rec = _Recorder()
    issued = 0
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s
    check_items = make.kind != "compare"

    async def worker() -> None:
        nonlocal issued
        while True:
            if n_requests is not None and issued >= n_requests:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            i = start_index + issued
            issued += 1
            t_send = time.perf_counter()
            if rec.first_send is None:
                rec.first_send = t_send
            try:
                status, content = await send(i)
                key = None if 200 <= status < 300 else str(status)
            except TRANSPORT_ERRORS as exc:  # transport failures are results, not crashes
                content, key = b"", type(exc).__name__
            t_done = time.perf_counter()
            rec.n += 1
            rec.last_done = max(rec.last_done, t_done)
            if key is None:
                rec.latencies_s.append(t_done - t_send)
                if check_items:
                    _count_item_errors(content, rec)
            else:
                rec.errors[key] += 1
                samples = rec.error_samples.setdefault(key, [])
                if len(samples) < ERROR_SAMPLES:
                    samples.append(content[:ERROR_SAMPLE_BYTES].decode("utf-8", errors="replace"))
            if progress is not None:
                progress.update(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rec


async def _wait_ready(base_url: str, timeout_s: float) -> None:
    """Poll ``GET /readyz`` until 200; EngineClosedError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with RawClient(base_url, timeout_s=min(timeout_s, 10.0)) as client:
        while True:
            try:
                resp = await client.get("/readyz")
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise EngineClosedError(
                    f"server at {base_url} not ready after {timeout_s:.0f} s ({last})",
                    detail={"url": base_url, "last": last},
                )
            await asyncio.sleep(0.25)


@contextlib.asynccontextmanager
async def open_sender(
    base_url: str, make: _RequestMaker, *, transport: Transport, concurrency: int, timeout_s: float
) -> AsyncIterator[Sender]:
    """A :data:`Sender` for ``transport`` with room for ``concurrency`` requests in flight; closed on exit."""
    if transport == "raw":
        async with RawClient(base_url, timeout_s=timeout_s) as raw:

            async def send_raw(i: int) -> tuple[int, bytes]:
                resp = await raw.request(make.encoded(i, raw.host_header))
                return resp.status_code, resp.content

            yield send_raw
        return
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        async def send_httpx(i: int) -> tuple[int, bytes]:
            resp = await client.post(**make(i))
            return resp.status_code, resp.content

        yield send_httpx


def _validate(
    kind: str, concurrency: int, duration_s: float | None, n_requests: int | None, warmup: int, k: int, transport: str
) -> None:
    problems = {
        f"kind must be one of {list(KINDS)}, got {kind!r}": kind not in KINDS,
        f"transport must be one of {list(TRANSPORTS)}, got {transport!r}": transport not in TRANSPORTS,
        "concurrency must be >= 1": concurrency < 1,
        "give exactly one of duration_s or n_requests": (duration_s is None) == (n_requests is None),
        "duration_s must be > 0": duration_s is not None and not duration_s > 0,
        "n_requests must be >= 1": n_requests is not None and n_requests < 1,
        "warmup must be >= 0": warmup < 0,
        "images_per_request must be >= 1": k < 1,
    }
    for message, bad in problems.items():
        if bad:
            raise InvalidParameterError(message)


async def arun_http_bench(
    base_url: str,
    *,
    kind: BenchKind,
    images: Sequence[Path | str | bytes] | bytes,
    concurrency: int = 8,
    duration_s: float | None = None,
    n_requests: int | None = None,
    warmup: int = 0,
    images_per_request: int = 1,
    crops: bool = False,
    timeout_s: float = 60.0,
    wait_ready_s: float = 0.0,
    progress: bool = False,
    transport: Transport = "raw",
) -> BenchResult:
    """Load-test the server at ``base_url`` with ``concurrency`` closed-loop clients.

    ``images``: files or encoded bytes, cycled through; exactly one of ``duration_s`` and ``n_requests``;
    ``timeout_s``: per request (a timeout is an error); ``wait_ready_s`` > 0: first poll ``/readyz`` that long.
    Raises InvalidParameterError / EmptyInputError for bad arguments, EngineClosedError when never ready.
    """
    _validate(kind, concurrency, duration_s, n_requests, warmup, images_per_request, transport)
    pool = _load_pool(images)
    make = _RequestMaker(kind, pool, images_per_request, crops)
    base_url = base_url.rstrip("/")
    if wait_ready_s > 0:
        await _wait_ready(base_url, wait_ready_s)
    opened = open_sender(base_url, make, transport=transport, concurrency=concurrency, timeout_s=timeout_s)
    async with opened as send:
        if warmup:
            log.info("warm-up: %d requests at concurrency %d", warmup, concurrency)
            wrec = await _phase(send, make, concurrency, warmup)
            if wrec.errors:
                log.warning("warm-up errors: %s", dict(wrec.errors))
        from tqdm.auto import tqdm

        desc = f"bench {kind} c={concurrency}"
        with tqdm(total=n_requests, desc=desc, unit="req", file=sys.stderr, disable=not progress) as bar:
            rec = await _phase(send, make, concurrency, n_requests, duration_s, warmup, bar)

    elapsed = max(rec.last_done - rec.first_send, 1e-9) if rec.first_send is not None else 0.0
    lat_ms = np.asarray(rec.latencies_s, dtype=np.float64) * 1000.0
    n_ok = int(lat_ms.size)

    p50, p95, p99 = np.percentile(lat_ms, [50, 95, 99]).tolist() if n_ok else (None, None, None)
    rate = 1 / elapsed if elapsed else 0.0
    settings: dict[str, Any] = {
        "url": base_url,
        "kind": kind,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "n_requests": n_requests,
        "warmup": warmup,
        "images_per_request": make.images_per_request,
        "crops": crops,
        "n_images": len(pool),
        "image_bytes_mean": round(sum(len(p[1]) for p in pool) / len(pool), 1),
        "timeout_s": timeout_s,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "transport": transport,
        "client": client_description(transport),
    }
    return BenchResult(
        n=rec.n,
        n_ok=n_ok,
        elapsed_s=elapsed,
        req_s=rec.n * rate,
        ok_req_s=n_ok * rate,
        images_s=n_ok * make.images_per_request * rate,
        p50_ms=p50,
        p95_ms=p95,
        p99_ms=p99,
        mean_ms=float(lat_ms.mean()) if n_ok else None,
        max_ms=float(lat_ms.max()) if n_ok else None,
        errors=dict(sorted(rec.errors.items())),
        item_errors=dict(sorted(rec.item_errors.items())),
        error_samples=dict(sorted(rec.error_samples.items())),
        settings=settings,
    )


def client_description(transport: Transport) -> str:
    """What sent the requests, for result records."""
    what = "rawhttp.py" if transport == "raw" else f"httpx {httpx.__version__}"
    return f"{what}, python {platform.python_version()}"


def run_http_bench(base_url: str, **kw: Any) -> BenchResult:
    return asyncio.run(arun_http_bench(base_url, **kw))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/loadgen.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:7860", help="server base URL")
    p.add_argument("--kind", choices=KINDS, default="compare")
    p.add_argument("--images", type=Path, nargs="+", required=True, help="image files and/or folders")
    p.add_argument("--max-images", type=int, default=256, help="pool size limit")
    p.add_argument("--concurrency", "-c", type=int, default=8)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--duration", dest="duration_s", type=float, help="seconds to run (default 10)")
    g.add_argument("--requests", "-n", dest="n_requests", type=int, help="number of requests to send")
    p.add_argument("--warmup", type=int, default=16, help="unrecorded warm-up requests")
    p.add_argument("--images-per-request", type=int, default=1, help="images per /api/embed request")
    p.add_argument("--crops", action="store_true", help="compare with crops=true")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=60.0)
    p.add_argument("--wait-ready", dest="wait_ready_s", type=float, default=30.0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--transport", choices=TRANSPORTS, default="raw", help="HTTP client (raw: lean, default)")
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the JSON result (and write ``--out``); 0 when a request succeeded."""
    kw = vars(build_parser().parse_args(argv))
    images, out = collect_images(kw.pop("images"), limit=kw.pop("max_images")), kw.pop("out")
    if kw["duration_s"] is None and kw["n_requests"] is None:
        kw["duration_s"] = 10.0
    result = run_http_bench(kw.pop("url"), images=images, **kw)
    text = json.dumps(result.to_dict(), indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    log.info("%s", result.summary())
    print(text)  # CLI output
    return 0 if result.n_ok > 0 else 1


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
