"""benchmarks/serve_memory.py's variant syntax, and session 13's memory tables (benchmarks/summary_memory.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from facegate.config import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from serve_memory import parse_variant
from summary_memory import _failure, graph_probe, http_memory, memory_variants, threads_probe, trace_peaks


def test_parse_variant_splits_settings_environment_and_lists() -> None:
    fields, env = parse_variant("compile=graphs,profile=low-memory,flip_tta=false,CUDNN_CONV_WSCAP_DBG=8")
    assert fields == {"compile": "graphs", "profile": "low-memory", "flip_tta": False}
    assert env == {"CUDNN_CONV_WSCAP_DBG": "8"}
    assert Settings(device="cpu", **fields).profile == "low-memory"
    assert parse_variant("a=[16|64]")[0] == {"a": [16, 64]}


def test_failure_names_the_frame_or_the_refused_setting() -> None:
    oom = (
        'Traceback (most recent call last):\n  File "/work/main/src/facegate/models/detector.py", line 296, in '
        "_to_input\n    return x.contiguous()\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."
    )
    assert _failure(oom) == "out of memory in `models/detector.py` (_to_input)"
    refused = "pydantic_core.ValidationError: 1 validation error for Settings\ngraph_buckets\n  Input should be a list"
    assert _failure(refused).startswith("not run: the settings refused `graph_buckets`")
    assert _failure("frame #21: Py_FinalizeEx + 0xad").startswith("crashed at interpreter exit")


def test_memory_table_has_a_row_per_variant_of_each_run() -> None:
    table = memory_variants((("41", "serve_memory_gpu_run41.json"),)).splitlines()
    assert len(table) == 2 + 7  # header, rule, seven variants
    assert table[2].startswith("| 41 | 7b9153b | `compile=graphs` | +24 / +454 / +552 | 450 | +102 |")


def test_session14_tables_read_the_committed_runs() -> None:
    probe = graph_probe("serve_memory_gpu_run45.json").splitlines()
    assert len(probe) == 2 + 2 * 9  # two environments, the bare row and eight steps each
    assert "| default | elementwise graph 2 | 742 (+0) | 62 | +68 |" in probe  # a second capture adds nothing
    http = http_memory((("51", "http_gpu_run51_lowmem.json"),)).splitlines()
    assert http[2].startswith("| 51 | 3a760b1 | facegate_lowmem | +48 / +76 | 38 / 46 |")
    trace = trace_peaks((("51", "serve_memory_gpu_run51.json"),)).splitlines()
    assert len(trace) == 2 + 3  # detect, embed, embed at every size
    assert all("| 14.6 |" in row or "| detect | 4.0 |" in row for row in trace[2:])  # the budget held at every size


def test_session15_tables_read_the_committed_runs() -> None:
    threads = threads_probe("serve_memory_gpu_run52.json").splitlines()
    assert len(threads) == 2 + 1 + 11  # header, rule, bare row, eleven steps
    assert "| live thread 3 conv only | 958 (+8) | 120 (+0) | +8 |" in threads
    assert "| first side stream | 1124 (+70) | 152 (+0) | +70 |" in threads
    assert "| second side stream | 1178 (+0) | 206 (+0) | +0 |" in threads
    http = http_memory((("52", "http_gpu_run52_lowmem.json"),)).splitlines()
    rows = {row.split(" | ")[2]: row for row in http[2:]}
    assert "| +48 / +52 | 38 / 42 |" in rows["facegate_lowmem"]  # one device thread: within 60 MiB
    assert "| +48 / +76 | 38 / 46 |" in rows["facegate_lowmem_perstage"]
    assert "| +132 / +138 | 120 / 126 |" in rows["facegate_lowmem_irse"]
