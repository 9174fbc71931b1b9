"""CI gate: cross-request batching must keep paying off on the CPU (benchmarks/cpu_smoke.py).

The first test is the gate itself (≈12 s): two FaceServices, batching on and off, 32 concurrent aligned-embed
clients each, interleaved rounds; it fails when the on/off items/s ratio drops below 1.5× or the engine
stops forming batches. The others show that the gate catches such a regression (a run where both arms are
unbatched fails it) and that each criterion of :func:`check` is applied.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "cpu_smoke.py"


@pytest.fixture(scope="module")
def smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location("facegate_cpu_smoke", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def test_batching_pays_off_on_cpu(smoke: ModuleType) -> None:
    res = smoke.measure(concurrency=32, duration_s=0.5, rounds=6)
    failures = smoke.check(res)
    assert failures == [], f"{failures}; result: {res.to_dict()}"
    assert len(res.on_items_s) == len(res.off_items_s) == 6
    assert res.ratio >= smoke.MIN_RATIO
    assert res.on_mean_batch >= smoke.MIN_BATCH and res.off_mean_batch == 1.0
    assert res.errors == 0


def test_gate_fails_when_batching_stops(smoke: ModuleType) -> None:
    res = smoke.measure(concurrency=32, duration_s=0.3, rounds=2, on_batching=False)
    failures = smoke.check(res)
    assert res.on_mean_batch == 1.0
    assert any("mean batch size with batching" in f for f in failures), failures


def test_check_applies_each_criterion(smoke: ModuleType) -> None:
    good = smoke.SmokeResult(32, 0.5, 3, 2, "tiny", [300.0] * 3, [100.0] * 3)
    good.on_median, good.off_median, good.ratio = 300.0, 100.0, 3.0
    good.on_mean_batch, good.off_mean_batch = 20.0, 1.0
    assert smoke.check(good) == []

    slow = smoke.SmokeResult(**{**good.to_dict(), "ratio": 1.2})
    assert any("ratio 1.20 < 1.50" in f for f in smoke.check(slow))

    unbatched_off = smoke.SmokeResult(**{**good.to_dict(), "off_mean_batch": 2.5})
    assert any("without batching" in f for f in smoke.check(unbatched_off))

    errors = smoke.SmokeResult(**{**good.to_dict(), "errors": 3})
    assert any("3 requests failed" in f for f in smoke.check(errors))
