"""benchmarks/serve_memory.py's variant syntax: Settings fields, child environment and list values."""

from __future__ import annotations

import sys
from pathlib import Path

from facegate.config import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from serve_memory import parse_variant


def test_parse_variant_splits_settings_environment_and_lists() -> None:
    fields, env = parse_variant("compile=graphs,graph_buckets=[16|64],det_graphs=false,CUDNN_CONV_WSCAP_DBG=8")
    assert fields == {"compile": "graphs", "graph_buckets": [16, 64], "det_graphs": False}
    assert env == {"CUDNN_CONV_WSCAP_DBG": "8"}
    assert Settings(device="cpu", **fields).graph_buckets == [16, 64]  # a list value reaches Settings as a list
