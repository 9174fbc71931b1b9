"""Schema-driven HTTP fuzzing (schemathesis) and decoder fuzzing, shared by the tests and ``benchmarks/fuzz_api.py``.

:func:`fuzz_api`: requests for every operation of a server's own OpenAPI document; no answer may be a 5xx.
:func:`fuzz_decoders`: random and mutated images; each decode gives ``(H, W, 3) uint8`` or an InputError.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class FuzzReport:
    """Requests (or decoder inputs) made, counts per status (or outcome), up to 20 reproducers of contract
    violations (curl commands, input hex prefixes), requests per operation, and wall seconds."""

    requests: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    per_operation: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.isdigit() and int(s) >= 500)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "statuses": dict(sorted(self.statuses.items())),
            "server_errors": self.server_errors,
            "failures": self.failures,
            "per_operation": self.per_operation,
            "seconds": round(self.seconds, 2),
        }


def fuzz_api(
    base_url: str,
    schema: dict[str, Any],
    *,
    examples_per_operation: int,
    headers: dict[str, str] | None = None,
    seed: int = 0,
    timeout_s: float = 30.0,
) -> FuzzReport:
    """Send ``examples_per_operation`` generated requests to every operation of ``schema`` at ``base_url``."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable

    api = schemathesis.openapi.from_dict(schema)
    report = FuzzReport()
    t0 = time.perf_counter()
    session = requests.Session()
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for result, mode in ((r, m) for r in api.get_all_operations() for m in modes):
        op = result.ok()
        name = f"{op.method.upper()} {op.path} ({mode.value})"
        before = report.requests

        @hseed(seed)
        @settings(
            max_examples=examples_per_operation,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            try:
                response = case.call(base_url=base_url, headers=headers, session=session, timeout=timeout_s)
                status = str(response.status_code)
            except requests.RequestException as exc:
                status = f"transport:{type(exc).__name__}"
            report.requests += 1
            report.statuses[status] += 1
            broken = not status.isdigit() or int(status) >= 500
            if broken and len(report.failures) < 20:
                report.failures.append(f"{status}: {case.as_curl_command()}"[:2000])

        with contextlib.suppress(Unsatisfiable):  # nothing negative to generate without parameters
            run()
        report.per_operation[name] = report.requests - before
    report.seconds = time.perf_counter() - t0
    return report


def fuzz_decoders(n: int, *, seed: int = 0, max_pixels: int = 1 << 20) -> FuzzReport:
    """Feed ``n`` random or mutated images to ``decode_image`` and to ``decode_if_small`` (each input to both;
    ``statuses`` counts the outcomes of the ``2 n`` calls)."""
    import io

    import cv2
    import numpy as np
    from PIL import Image

    from facegate.errors import InputError
    from facegate.io.decode import decode_if_small, decode_image

    rng = np.random.default_rng(seed)
    seeds: list[bytes] = []
    img = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
    for ext in (".jpg", ".png", ".bmp", ".webp", ".tiff"):
        ok, buf = cv2.imencode(ext, img)
        if ok:
            seeds.append(buf.tobytes())
    for mode, fmt in (("L", "PNG"), ("RGBA", "PNG"), ("P", "PNG"), ("I;16", "TIFF"), ("CMYK", "JPEG"), ("RGB", "GIF")):
        b = io.BytesIO()
        Image.new(mode, (9, 7)).save(b, format=fmt)
        seeds.append(b.getvalue())
    report = FuzzReport()
    t0 = time.perf_counter()
    for i in range(n):
        if i % 10 == 0:
            data = rng.bytes(int(rng.integers(0, 512)))
        else:
            buf = bytearray(seeds[int(rng.integers(0, len(seeds)))])
            for _ in range(int(rng.integers(1, 9))):
                kind = int(rng.integers(0, 4))
                pos = int(rng.integers(0, len(buf))) if buf else 0
                if not buf:
                    break
                if kind == 0:
                    buf[pos] = int(rng.integers(0, 256))
                elif kind == 1:
                    del buf[pos:]
                elif kind == 2:
                    buf[pos:pos] = rng.bytes(int(rng.integers(1, 64)))
                else:
                    p = int(rng.integers(0, min(64, len(buf))))
                    buf[p] = int(rng.choice([0, 0xFF, 0x7F, 0x80]))
            data = bytes(buf)
        report.requests += 1
        for fn in (decode_image, decode_if_small):
            try:
                arr = fn(data, max_bytes=1 << 22, max_pixels=max_pixels)
            except InputError as exc:
                report.statuses[exc.code] += 1
                continue
            except Exception as exc:  # the contract is broken: record a reproducer
                report.statuses[f"crash:{type(exc).__name__}"] += 1
                if len(report.failures) < 20:
                    report.failures.append(f"{fn.__name__} {type(exc).__name__}: {exc}; input {data[:64].hex()}")
                continue
            if arr is None:
                report.statuses["deferred"] += 1
            elif arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3:
                report.statuses["ok"] += 1
            else:
                report.statuses["crash:bad_array"] += 1
    report.seconds = time.perf_counter() - t0
    return report
