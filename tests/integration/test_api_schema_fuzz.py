"""Property-based tests of the HTTP API generated from its own OpenAPI document (schemathesis), against a
real server on loopback: no generated request, valid or not, gets a 5xx. A bounded slice (a few examples
per operation); ``benchmarks/fuzz_api.py`` runs the 10,000-request version."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fuzz import fuzz_api, fuzz_decoders


def test_schema_driven_requests_get_no_5xx(server_factory, fg: SimpleNamespace) -> None:
    srv = server_factory()
    with srv.client() as c:
        schema = c.get("/openapi.json").json()
        assert c.post("/api/galleries", json={"name": "fuzz"}).status_code == 201  # some requests hit a gallery
    report = fuzz_api(srv.url, schema, examples_per_operation=8, seed=1)
    assert report.requests >= 8 * len(report.per_operation) // 2, report.to_dict()
    assert len(report.per_operation) >= 12, report.per_operation
    assert report.server_errors == 0 and not report.failures, report.to_dict()
    assert any(s.startswith("4") for s in report.statuses), report.statuses
    with srv.client() as c:
        assert c.get("/healthz").status_code == 200


@pytest.mark.slow
def test_decoder_fuzz_slice() -> None:
    report = fuzz_decoders(2000, seed=3)
    assert not any(s.startswith("crash") for s in report.statuses), report.to_dict()
    assert report.statuses["ok"] > 0 and report.requests == 2000
