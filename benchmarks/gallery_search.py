"""Exact 1:N search on the CPU: the gallery index's NumPy backend against its torch backend, same process.

Galleries of random unit-norm 128-d templates; per (gallery size S, queries Q) the median milliseconds of
``GalleryIndex.search`` (k = 10) over ``--iters`` calls after one warm-up, backends alternating per round.
The front-ends search with the NumPy backend (they never import torch); torch serves CUDA and half precision.

    OMP_NUM_THREADS=1 python benchmarks/gallery_search.py --out benchmarks/results/gallery_search-cpu2.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.gallery.index import GalleryIndex, _TorchOps

log = logging.getLogger("gallery_search")
ROOT = Path(__file__).resolve().parents[1]


def make_index(backend: str, ids: list[str], templates: np.ndarray) -> GalleryIndex:
    idx = GalleryIndex("cpu")
    if backend == "torch":
        idx._ops = _TorchOps("cpu", "float32")  # the torch backend on the CPU, for comparison
    idx.load_gallery("g", templates.shape[1], ids, templates)
    return idx


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,200000")
    p.add_argument("--queries", default="1,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rng = np.random.default_rng(0)
    rows = []
    for size in (int(x) for x in o.sizes.split(",")):
        t = rng.standard_normal((size, 128)).astype(np.float32)
        t /= np.linalg.norm(t, axis=1, keepdims=True)
        ids = [str(i) for i in range(size)]
        indexes = {b: make_index(b, ids, t) for b in ("numpy", "torch")}
        for n_q in (int(x) for x in o.queries.split(",")):
            q = rng.standard_normal((n_q, 128)).astype(np.float32)
            hits = {b: idx.search("g", q, 10, 0.3) for b, idx in indexes.items()}  # warm-up, and agreement
            same = [[h.subject_id for h in r] for r in hits["numpy"]] == [
                [h.subject_id for h in r] for r in hits["torch"]
            ]
            times: dict[str, list[float]] = {b: [] for b in indexes}
            for _ in range(o.rounds):
                for b, idx in indexes.items():
                    for _ in range(o.iters):
                        t0 = time.perf_counter()
                        idx.search("g", q, 10, 0.3)
                        times[b].append((time.perf_counter() - t0) * 1000)
            row = {"gallery": size, "queries": n_q, "same_hits": same}
            row.update({f"{b}_ms": round(statistics.median(v), 3) for b, v in times.items()})
            row["numpy_over_torch"] = round(row["numpy_ms"] / row["torch_ms"], 2)
            rows.append(row)
            log.info("%s", row)
    payload = {
        "benchmark": "gallery_search",
        "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]),
        "rows": rows,
        "env": env_record(sizes=o.sizes, queries=o.queries, iters=o.iters, rounds=o.rounds),
    }
    write_json(o.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
