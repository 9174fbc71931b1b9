"""Which allocations make up a CUDA memory peak: a replay of PyTorch's allocator trace.

``torch.cuda.memory._record_memory_history()`` records every allocation and free of the caching allocator
with the Python frames that made it; ``torch.cuda.memory._snapshot()["device_traces"][device]`` returns
them as a list of events (``action``, ``addr``, ``size``, ``frames``). :func:`peak_breakdown` replays such a
list: it finds the moment the memory allocated *during the trace* peaked, and groups the blocks alive at
that moment by the first frame in facegate's own code (``site``). Blocks allocated before the trace started
(the weights) are not part of it; their frees are ignored. It also reports how far the allocator's reserved
segments grew during the trace, which is what the driver (nvidia-smi) sees of it.

Used by ``benchmarks/serve_memory.py --trace`` (on the GPU); pure Python, tested on the CPU with made-up
traces (tests/unit/bench/test_memory_trace.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

MIB = 2**20
SEGMENT_GROW = ("segment_alloc", "segment_map")
SEGMENT_SHRINK = ("segment_free", "segment_unmap")


def site_of(frames: Sequence[dict[str, Any]], own: str = "/facegate/") -> str:
    """``path:line (function)`` of the innermost frame in ``own`` code (the path from ``facegate/`` on), else
    of the innermost frame; ``(no Python frame)`` for an allocation made from C++ alone (e.g. a workspace)."""
    if not frames:
        return "(no Python frame)"
    mine = next((f for f in frames if own in str(f.get("filename", ""))), frames[0])
    path = str(mine.get("filename", "?"))
    if own in path:
        path = own.strip("/") + "/" + path.split(own, 1)[1]
    return f"{path}:{mine.get('line', '?')} ({mine.get('name', '?')})"


def peak_breakdown(events: Sequence[dict[str, Any]], *, top: int = 12) -> dict[str, Any]:
    """Replay allocator ``events`` (oldest first) and describe the peak of what they allocated.

    Returns ``peak_mib`` (bytes allocated during the trace and alive at the peak), ``end_mib`` (alive at the
    end), ``segments_grown_mib`` (the largest growth of reserved segments over the trace's start),
    ``events`` (how many), and ``live_at_peak``: at most ``top`` sites by size, each with ``mib``,
    ``blocks`` and ``largest_mib``, plus a row ``(other sites)`` for the rest.
    """
    frees = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"

    def replay(stop: int | None) -> tuple[int, int, dict[int, tuple[int, str]], int]:
        live: dict[int, tuple[int, str]] = {}
        total = peak = peak_at = seg = seg_peak = 0
        for i, e in enumerate(events):
            if stop is not None and i > stop:
                break
            action, addr, size = e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0))
            if action == "alloc":
                live[addr] = (size, site_of(e.get("frames") or []))
                total += size
                if total > peak:
                    peak, peak_at = total, i
            elif action == frees and addr in live:
                total -= live.pop(addr)[0]
            elif action in SEGMENT_GROW:
                seg += size
                seg_peak = max(seg_peak, seg)
            elif action in SEGMENT_SHRINK:
                seg -= size
        return peak, peak_at, live, seg_peak

    peak, peak_at, end_live, seg_peak = replay(None)
    live = replay(peak_at)[2] if events else {}
    sites: dict[str, list[int]] = {}
    for size, site in live.values():
        sites.setdefault(site, []).append(size)
    rows = sorted(sites.items(), key=lambda kv: -sum(kv[1]))

    def row(site: str, sizes: list[int]) -> dict[str, Any]:
        return {"site": site, "mib": round(sum(sizes) / MIB, 2), "blocks": len(sizes),
                "largest_mib": round(max(sizes) / MIB, 2)}  # fmt: skip

    out = [row(s, sizes) for s, sizes in rows[:top]]
    rest = [size for _, sizes in rows[top:] for size in sizes]
    if rest:
        out.append(row("(other sites)", rest))
    return {
        "peak_mib": round(peak / MIB, 2),
        "end_mib": round(sum(s for s, _ in end_live.values()) / MIB, 2),
        "segments_grown_mib": round(seg_peak / MIB, 2),
        "events": len(events),
        "live_at_peak": out,
    }


@contextmanager
def traced(sink: dict[str, Any], name: str, *, top: int = 12) -> Iterator[None]:
    """Record PyTorch's CUDA allocator while the block runs and put ``peak_breakdown`` of it in
    ``sink[name]`` (device 0's trace; Python frames only). CUDA only."""
    import torch

    mem: Any = torch.cuda.memory
    torch.cuda.synchronize()
    mem._record_memory_history(max_entries=500_000, stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        snap: Callable[[], dict[str, Any]] = mem._snapshot
        traces = snap().get("device_traces") or [[]]
        sink[name] = peak_breakdown(traces[0], top=top)
    finally:
        mem._record_memory_history(enabled=None)
