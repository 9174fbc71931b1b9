"""docs/benchmarks.md is what benchmarks/tables.py renders from the committed result files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tables  # noqa: E402


def test_docs_benchmarks_is_generated_from_the_committed_results() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tables.py")], capture_output=True, text=True, check=True
    ).stdout
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert out == doc, "docs/benchmarks.md is stale: run `python benchmarks/tables.py > docs/benchmarks.md`"


def test_every_result_is_named_by_benchmark_and_machine_and_gets_a_section() -> None:
    named = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    rendered = {p.name for *_, p in tables.results()}
    # the quality evaluation's files belong to docs/quality.md; every other result is a product benchmark's
    assert named - rendered == {n for n in named if n.startswith(("quality_", "lfw_cpu_fp32"))}
    doc = tables.render()
    for bench, machine, profile, path in tables.results():
        assert f"`benchmarks/results/{path.name}`" in doc
        assert bench in tables.BENCHMARKS and machine and (profile == "" or profile.replace("-", "").isalnum())


def test_a_table_records_machine_commit_and_command() -> None:
    d = {"command": "python benchmarks/x.py", "env": {"gpu": "NVIDIA H200", "cpu_count": 16, "torch": "2.11",
         "code_commit": "0123456789abcdef", "time_utc": "2026-01-01T00:00:00Z"}}  # fmt: skip
    text = tables.provenance(d)
    assert "NVIDIA H200, 16 CPU cores" in text and "`01234567`" in text and "`python benchmarks/x.py`" in text
    assert "not recorded" in tables.provenance({"env": {"git_commit": "HEAD"}})
