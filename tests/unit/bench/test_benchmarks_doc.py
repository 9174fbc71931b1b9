"""docs/benchmarks.md is what benchmarks/summarize.py writes from the committed JSON results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_docs_benchmarks_is_generated_from_the_committed_results() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "summarize.py")], capture_output=True, text=True, check=True
    ).stdout
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert out == doc, "docs/benchmarks.md is stale: run `python benchmarks/summarize.py > docs/benchmarks.md`"
