"""What idle thread pools cost a serving process: CPU time per small operation, by thread count.

A server calls small operations one at a time with gaps between them (one face warp per request). After
each parallel call, OpenCV's and OpenMP's worker threads wait actively for more work, so the process burns
CPU time that does no work. For each thread count, this times ``--calls`` calls of the operation, each
followed by a ``--gap-ms`` sleep, in a fresh process, and reports the process CPU time per call next to the
wall time spent inside the call.

Operations: ``cv2_warp`` (``cv2.warpAffine`` of a 250×250 photo into a 112×112 crop, what alignment does
per face) and ``torch_fill`` (``torch.zeros`` of one 16-photo detector batch, 16×256×256×3 uint8).

  python benchmarks/cpu_pool_spin.py --out benchmarks/results/cpu_pool_spin.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json

CHILD = r"""
import json, sys, time
import cv2, numpy as np, torch
op, n, calls, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) / 1000
cv2.setNumThreads(n); torch.set_num_threads(n)
img = np.random.default_rng(0).integers(0, 255, (250, 250, 3), dtype=np.uint8)
M = np.array([[0.5, 0.1, 10], [-0.1, 0.5, 20]], np.float32)
fn = {"cv2_warp": lambda: cv2.warpAffine(img, M, (112, 112)),
      "torch_fill": lambda: torch.zeros((16, 256, 256, 3), dtype=torch.uint8)}[op]
def run(k):
    c0, inside = time.process_time(), 0.0
    for _ in range(k):
        t = time.perf_counter(); fn(); inside += time.perf_counter() - t
        time.sleep(gap)
    return time.process_time() - c0, inside
run(max(10, calls // 10))
cpu, inside = run(calls)
print(json.dumps({"cpu_ms_per_call": round(cpu * 1000 / calls, 4), "wall_ms_in_call": round(inside * 1000 / calls, 4)}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default 1, 2, 4, … up to the CPUs)")
    p.add_argument("--ops", default="cv2_warp,torch_fill")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--gap-ms", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_pool_spin.json"))
    o = p.parse_args(argv)
    ncpu = os.cpu_count() or 1
    default = sorted({1, ncpu, *(2**i for i in range(1, 8) if 2**i <= ncpu)})
    threads = [int(t) for t in o.threads.split(",")] if o.threads else default
    rows: list[dict[str, Any]] = []
    for op in o.ops.split(","):
        for n in threads:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, op, str(n), str(o.calls), str(o.gap_ms)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = {"op": op, "threads": n, **json.loads(out.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json(o.out, {"benchmark": "cpu_pool_spin", "command": " ".join(sys.argv), "rows": rows,
                       "env": env_record(calls=o.calls, gap_ms=o.gap_ms, threads=threads)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
