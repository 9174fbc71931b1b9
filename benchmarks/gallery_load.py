"""Start-up load of a large gallery: what an engine does before it answers its first search.

Fills gallery ``g`` with ``--size`` synthetic unit-norm templates (imported in bulk), then times, ``--repeats``
times, a fresh :class:`facegate.pipeline.search.Gallery` (open the store, read one snapshot of every template,
load the index on the CPU), from SQLite and from a real PostgreSQL server (``--postgres-url``, or a throw-away
one started with the Debian binaries, as the ``postgres`` user when root). Reports the median and every run.

    python benchmarks/gallery_load.py --size 1000000
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.gallery import open_store
from facegate.gallery.index import GalleryIndex
from facegate.pipeline.search import Gallery
from gallery_search import build, median_ms, postgres

log = logging.getLogger("gallery_load")
ROOT = Path(__file__).resolve().parents[1]


def load_times(url: str, size: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gal = Gallery(open_store(url), GalleryIndex("cpu", "float32"))
        out.append(round(time.perf_counter() - t0, 3))
        assert gal.index.sizes() == {"g": size}, gal.index.sizes()
        gal.close()
        del gal
    return out


def gallery_request_ms(url: str) -> dict[str, float]:
    """Median ms of ``get_gallery`` (what every gallery request of a front-end reads: the kept count) beside
    the ``COUNT(*)`` the store ran for it before it kept one, on the same database."""
    store = open_store(url)
    kept = median_ms(lambda: store.get_gallery("g"), 20)
    with store._tx("counting", write=False) as conn:
        count = median_ms(lambda: conn.execute("SELECT COUNT(*) FROM subjects WHERE gallery_id = 1").fetchone(), 20)
    store.close()
    return {"get_gallery_ms": kept, "count_star_ms": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--postgres-url", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gallery_load-cpu2.json")
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="facegate-bench-") as tmp, postgres(o.postgres_url) as pg:
        urls = [("sqlite", str(Path(tmp) / "g.sqlite3"))]
        if pg:
            import psycopg

            with psycopg.connect(pg, autocommit=True) as c:
                c.execute("DROP DATABASE IF EXISTS bench_load")
                c.execute("CREATE DATABASE bench_load")
            urls.append(("postgresql", pg.rsplit("/", 1)[0] + "/bench_load"))
        for backend, url in urls:
            rate = build(url, o.size, o.dim, rng)
            times = load_times(url, o.size, o.repeats)
            rows.append(
                {
                    "backend": backend,
                    "gallery": o.size,
                    "import_subjects_per_s": round(rate),
                    "load_s_median": statistics.median(times),
                    "load_s_runs": times,
                    **gallery_request_ms(url),
                    "load_average_1m": os.getloadavg()[0],
                }
            )
            log.info("%s", rows[-1])
    env = env_record(size=o.size, dim=o.dim, repeats=o.repeats)
    cmd = "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])])
    write_json(o.out, {"benchmark": "gallery_load", "command": cmd, "rows": rows, "env": env})
    log.info("wrote %s", o.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
