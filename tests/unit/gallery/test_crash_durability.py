"""kill -9 during bulk enrolment: nothing acknowledged is lost and the database stays intact.

A short run of the soak in ``benchmarks/kill9_enrol.py`` (whose 50-trial run is committed as
``benchmarks/results/kill9_enrol-cpu2.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
kill9_enrol = pytest.importorskip("kill9_enrol")


@pytest.mark.slow
def test_kill_9_during_bulk_enrolment_loses_nothing_acknowledged(tmp_path: Path) -> None:
    out = kill9_enrol.soak(tmp_path / "g.sqlite3", trials=10)
    assert out["acknowledged"] > 10
    assert out["lost_acknowledged"] == out["missing_from_feed"] == out["corrupt_checks"] == 0, out
