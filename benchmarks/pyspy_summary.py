"""Summarise a ``py-spy record --subprocesses --gil -f raw`` file: where each process holds the GIL.

``scripts/gpu-photo.sh`` records the facegate_mp server under HTTP load this way (the benchmark starts the
server under py-spy, ``FACEGATE_BENCH_WRAP``). Per process: samples, and per thread entry point the share
of samples. For the engine process (the one running ``engine_main``) also the functions with the most
samples, inclusive and as the innermost frame. Only samples of threads holding the GIL are in the file,
so a share is a share of the GIL's busy time.

    python benchmarks/pyspy_summary.py RAW.txt [--skip-startup] [--out SUMMARY.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

_PROCESS = re.compile(r'^process (\d+):"(.*?)"$', re.S)
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^():]+)(?::\d+)?\)$")

#: Frames of the engine process's start-up (model loading, warm-up, graph capture): dropped with --skip-startup.
STARTUP = ("warmup", "from_settings", "capture", "FaceService.build", "build (service.py", "_find_and_load")


def _split_frames(stack: str) -> list[str]:
    """``;``-separated frames; a ``process N:"command"`` frame may itself contain ``;`` (``python -c "a; b"``)."""
    frames: list[str] = []
    for piece in stack.split(";"):
        if frames and frames[-1].startswith("process ") and not frames[-1].endswith('"'):
            frames[-1] += ";" + piece
        else:
            frames.append(piece)
    return frames


def parse(text: str) -> list[tuple[int, str, list[str], int]]:
    """``(pid, command, frames outermost first, count)`` per distinct stack.

    With ``--subprocesses`` each stack starts with ``process PID:"command"`` frames, one per level of the
    process tree; the innermost one is the process the frames after it ran in.
    """
    out: list[tuple[int, str, list[str], int]] = []
    pending = ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        head, _, count = pending.rpartition(" ")
        if not count.isdigit() or not head.startswith("process "):
            continue
        pending = ""
        frames = _split_frames(head)
        procs = [k for k, f in enumerate(frames) if f.startswith("process ")]
        m = _PROCESS.match(frames[procs[-1]]) if procs else None
        if m is None:
            continue
        out.append((int(m.group(1)), m.group(2), frames[procs[-1] + 1 :], int(count)))
    return out


def short(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m.group('func')} ({Path(m.group('file')).name})" if m else frame


_BOOT = ("Thread.", "_bootstrap", "<module>", "spawn_main", "_main (spawn", "BaseProcess.", "run (process")


def entry_point(frames: list[str]) -> str:
    """The thread's entry: the first frame after the bootstrap frames (and after ``engine_main``'s)."""
    names = [short(f) for f in frames]
    for k, s in enumerate(names):
        if s.startswith(_BOOT):
            continue
        if s.startswith("engine_main") and k + 1 < len(names):
            return f"{s} > {names[k + 1]}"
        return s
    return names[-1] if names else "?"


def summarise(records: list[tuple[int, str, list[str], int]], skip_startup: bool) -> dict[str, Any]:
    by_pid: dict[int, list[tuple[list[str], int]]] = defaultdict(list)
    commands: dict[int, str] = {}
    for pid, cmd, frames, n in records:
        by_pid[pid].append((frames, n))
        commands[pid] = cmd
    procs: list[dict[str, Any]] = []
    for pid, stacks in by_pid.items():
        engine = any("engine_main" in f for frames, _ in stacks for f in frames)
        if engine and skip_startup:
            stacks = [(fr, n) for fr, n in stacks if not any(k in f for f in fr for k in STARTUP)]
        total = sum(n for _, n in stacks)
        threads: Counter[str] = Counter()
        inner: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        for frames, n in stacks:
            threads[entry_point(frames)] += n
            if frames:
                inner[short(frames[-1])] += n
            for s in {short(f) for f in frames}:
                inclusive[s] += n
        row: dict[str, Any] = {
            "pid": pid,
            "command": commands[pid][:160],
            "engine": engine,
            "samples": total,
            "threads": [{"entry": k, "share": round(v / total, 4)} for k, v in threads.most_common(8)] if total else [],
        }
        if engine and total:
            row["innermost"] = [{"frame": k, "share": round(v / total, 4)} for k, v in inner.most_common(40)]
            row["inclusive"] = [{"frame": k, "share": round(v / total, 4)} for k, v in inclusive.most_common(60)]
        procs.append(row)
    procs.sort(key=lambda r: -r["samples"])
    return {"processes": procs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="py-spy's raw output (.txt or .txt.gz)")
    ap.add_argument("--skip-startup", action="store_true", help="drop the engine's start-up stacks")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.raw.suffix == ".gz":  # the committed raw files are gzipped
        with gzip.open(a.raw, "rt", errors="replace") as fh:
            raw = fh.read()
    else:
        raw = a.raw.read_text(errors="replace")
    summary = summarise(parse(raw), a.skip_startup)
    summary["source"] = a.raw.name
    text = json.dumps(summary, indent=1)
    if a.out:
        a.out.write_text(text)
    for p in summary["processes"]:
        print(f"pid {p['pid']} engine={p['engine']} samples={p['samples']} {p['command'][:80]!r}")
        for t in p["threads"][:5]:
            print(f"    thread {t['entry']}: {t['share']:.1%}")
        for key in ("inclusive", "innermost"):
            for r in p.get(key, [])[:25]:
                print(f"      {key} {r['share']:.1%} {r['frame']}")


if __name__ == "__main__":
    main()
