"""benchmarks/serve_memory.py's variant syntax: Settings fields, child environment and list values."""

from __future__ import annotations

import sys
from pathlib import Path

from facegate.config import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from serve_memory import parse_variant


def test_parse_variant_splits_settings_environment_and_lists() -> None:
    fields, env = parse_variant("compile=graphs,profile=low-memory,CUDNN_CONV_WSCAP_DBG=8")
    assert fields == {"compile": "graphs", "profile": "low-memory"}
    assert env == {"CUDNN_CONV_WSCAP_DBG": "8"}
    assert Settings(device="cpu", **fields).profile == "low-memory"
    assert parse_variant("a=[16|64]")[0] == {"a": [16, 64]}  # a list value stays a list
