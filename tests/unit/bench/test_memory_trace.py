"""benchmarks/memory_trace.py: the replay of an allocator trace, on made-up events."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from memory_trace import peak_breakdown, site_of

MIB = 2**20
DET = [{"filename": "/x/torch/nn/modules/conv.py", "line": 5, "name": "forward"},
       {"filename": "/w/src/facegate/models/yunet.py", "line": 40, "name": "forward"}]  # fmt: skip
EMB = [{"filename": "/w/src/facegate/models/chunked.py", "line": 90, "name": "run_trunk"}]


def ev(action: str, addr: int, mib: float, frames: list[dict[str, object]] | None = None) -> dict[str, object]:
    return {"action": action, "addr": addr, "size": int(mib * MIB), "frames": frames or []}


def test_site_is_the_innermost_own_frame_or_the_first_or_none() -> None:
    assert site_of(DET) == "facegate/models/yunet.py:40 (forward)"
    assert site_of(DET[:1]) == "/x/torch/nn/modules/conv.py:5 (forward)"
    assert site_of([]) == "(no Python frame)"


def test_peak_is_the_live_set_at_the_largest_total_not_at_the_end() -> None:
    events = [
        ev("segment_alloc", 1, 20),
        ev("alloc", 10, 4, DET), ev("alloc", 11, 6, DET), ev("alloc", 12, 2),  # 12 MiB alive: the peak
        ev("free_requested", 10, 4), ev("free_completed", 10, 4), ev("free_completed", 11, 6),
        ev("alloc", 13, 3, EMB),  # 5 MiB alive at the end
        ev("free_completed", 999, 50),  # a block from before the trace (weights): ignored
        ev("segment_free", 1, 20), ev("segment_alloc", 2, 2),
    ]  # fmt: skip
    out = peak_breakdown(events)
    assert out["peak_mib"] == 12.0 and out["end_mib"] == 5.0
    assert out["segments_grown_mib"] == 20.0
    assert out["events"] == len(events)
    assert out["live_at_peak"] == [
        {"site": "facegate/models/yunet.py:40 (forward)", "mib": 10.0, "blocks": 2, "largest_mib": 6.0},
        {"site": "(no Python frame)", "mib": 2.0, "blocks": 1, "largest_mib": 2.0},
    ]


def test_without_free_completed_events_requested_frees_count_and_top_folds_the_rest() -> None:
    events = [ev("alloc", a, 1, [{"filename": f"/f{a}.py", "line": a, "name": "g"}]) for a in range(5)]
    events += [ev("free_requested", 0, 1)]
    out = peak_breakdown(events, top=2)
    assert out["peak_mib"] == 5.0 and out["end_mib"] == 4.0
    assert [r["site"] for r in out["live_at_peak"]][-1] == "(other sites)"
    assert out["live_at_peak"][-1]["blocks"] == 3
    assert peak_breakdown([])["peak_mib"] == 0.0
