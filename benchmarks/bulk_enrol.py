"""Bulk enrolment against compare, photos/s on the CPU, in one server and one invocation.

``facegate serve --device cpu`` on a fresh data folder; the same LFW photos (``--photos`` of them, two per
person) go through

* **compare**: ``POST /api/compare`` with two photos per request, from ``--concurrency`` threads;
* **enrol**: the HTTP batch endpoint ``POST /api/galleries/g/enrolments`` with ``--batch`` photos per request
  (each person is one subject), from as many threads.

The two alternate ``--rounds`` times so a change in the box's load hits both; photos/s is summed over the
rounds. ``ratio`` = enrol photos/s ÷ compare photos/s.

    python benchmarks/bulk_enrol.py --photos 256 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from gallery_visibility import start, stop

log = logging.getLogger("bulk_enrol")
ROOT = Path(__file__).resolve().parents[1]


def lfw_pairs(root: Path, n: int) -> list[tuple[str, bytes, bytes]]:
    """``n // 2`` people with two photos each: ``(name, photo 1, photo 2)``."""
    out = []
    for d in sorted((root / "lfw-deepfunneled").iterdir()):
        files = sorted(d.glob("*.jpg"))
        if len(files) >= 2:
            out.append((d.name, files[0].read_bytes(), files[1].read_bytes()))
        if len(out) == n // 2:
            break
    return out


def run(pool: ThreadPoolExecutor, fn: Any, jobs: list[Any]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    codes = list(pool.map(fn, jobs))
    return time.perf_counter() - t0, codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--photos", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="photos per enrolment request")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lfw-root", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw")))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bulk_enrol-cpu2.json")
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    people = lfw_pairs(o.lfw_root, o.photos)
    n_photos = 2 * len(people)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="facegate-enrol-") as tmp:
        proc, url = start(Path(tmp), 1)
        try:
            with httpx.Client(base_url=url, timeout=300) as c, ThreadPoolExecutor(o.concurrency) as pool:
                c.post("/api/galleries", json={"name": "g"}).raise_for_status()

                def compare(job: tuple[str, bytes, bytes]) -> int:
                    files = {"img1": ("a.jpg", job[1]), "img2": ("b.jpg", job[2])}
                    resp = c.post("/api/compare", files=files)
                    if resp.status_code != 200:
                        log.warning("compare answered %d: %s", resp.status_code, resp.text[:300])
                    if resp.status_code != 200:
                        log.warning("enrolment answered %d: %s", resp.status_code, resp.text[:300])
                    return resp.status_code

                def enrol(job: tuple[int, list[tuple[str, bytes, bytes]]]) -> int:
                    r, batch = job
                    files = [("images", (f"{i}.jpg", ph)) for i, (_, a, b) in enumerate(batch) for ph in (a, b)]
                    ids = [f"r{r}-{name}" for name, _, _ in batch for _ in (0, 1)]
                    resp = c.post("/api/galleries/g/enrolments", files=files, data={"subject_ids": json.dumps(ids)})
                    if resp.status_code != 200:
                        log.warning("enrolment answered %d: %s", resp.status_code, resp.text[:300])
                    return resp.status_code

                run(pool, compare, people[: o.concurrency])  # warm-up
                per = max(1, o.batch // 2)
                for r in range(o.rounds):
                    t_cmp, codes_c = run(pool, compare, people)
                    batches = [(r, people[i : i + per]) for i in range(0, len(people), per)]
                    t_enr, codes_e = run(pool, enrol, batches)
                    rounds.append(
                        {
                            "compare_s": round(t_cmp, 2),
                            "enrol_s": round(t_enr, 2),
                            "compare_photos_per_s": round(n_photos / t_cmp, 2),
                            "enrol_photos_per_s": round(n_photos / t_enr, 2),
                            "compare_non_200": sum(x != 200 for x in codes_c),
                            "enrol_non_200": sum(x != 200 for x in codes_e),
                            "load_average_1m": os.getloadavg()[0],
                        }
                    )
                    log.info("round %d: %s", r, rounds[-1])
                g = c.get("/api/galleries").json()
        finally:
            stop(proc)
    t_c = sum(r["compare_s"] for r in rounds)
    t_e = sum(r["enrol_s"] for r in rounds)
    result = {
        "benchmark": "bulk_enrol",
        "photos_per_round": n_photos,
        "rounds": rounds,
        "compare_photos_per_s": round(n_photos * len(rounds) / t_c, 2),
        "enrol_photos_per_s": round(n_photos * len(rounds) / t_e, 2),
        "ratio": round(t_c / t_e, 3),
        "galleries": g,
        "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]),
        "env": env_record(photos=o.photos, batch=o.batch, concurrency=o.concurrency, rounds=o.rounds),
    }
    write_json(o.out, result)
    log.info(
        "compare %.2f photos/s, enrol %.2f photos/s, ratio %.3f",
        *(result[k] for k in ("compare_photos_per_s", "enrol_photos_per_s", "ratio")),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
