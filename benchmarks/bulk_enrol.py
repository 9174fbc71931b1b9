"""Bulk enrolment against compare, photos/s on the CPU, in one server and one invocation.

``facegate serve --device cpu`` on a fresh data folder; the same LFW photos (``--photos`` of them, two per
person) go through

* **compare**: ``POST /api/compare`` with two photos per request, from ``--concurrency`` threads;
* **enrol**: the HTTP batch endpoint ``POST /api/galleries/g/enrolments`` with ``--batch`` photos per request
  (each person is one subject), from as many threads.

The two alternate ``--rounds`` times so a change in the box's load hits both; photos/s is summed over the
rounds. ``ratio`` = enrol photos/s ÷ compare photos/s.

``--store`` measures the store alone instead (no server, no model): ``--processes`` writers share one SQLite
gallery pre-filled with ``--prefill`` templates and enrol subjects of two photos, either one transaction per
subject (``per_subject``, how a batch request was written before) or one per request of ``--batch`` photos
(``per_request``, :meth:`GalleryStore.enrol_many`); the two alternate ``--rounds`` times.

    python benchmarks/bulk_enrol.py --photos 256 --rounds 2
    python benchmarks/bulk_enrol.py --store --processes 8 --subjects 400 --rounds 3
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
import numpy as np

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


def store_writer(job: tuple[str, str, int, int, float]) -> tuple[float, float, int]:
    """One writer process: from wall-clock time ``at``, enrol ``n`` subjects of 2 unit-norm 128-d embeddings,
    ``per`` per transaction (1: one subject's enrolment); returns the wall-clock times of its first write and
    its last commit (opening the store and making the data stay outside them) and the subjects not written."""
    from facegate.errors import GalleryError
    from facegate.gallery.sqlite import SQLiteGalleryStore

    path, tag, n, per, at = job
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    x = rng.standard_normal((n, 2, 128)).astype(np.float32)
    x /= np.linalg.norm(x, axis=2, keepdims=True)
    q = np.full(2, 0.8, np.float32)
    with SQLiteGalleryStore(path) as store:
        time.sleep(max(0.0, at - time.time()))
        t0 = time.time()
        failed = 0
        for s in range(0, n, per):
            try:
                store.enrol_many("g", [(f"{tag}-{i}", x[i], q, None) for i in range(s, min(n, s + per))])
            except GalleryError as exc:  # busy past the timeout: counted, not retried
                log.warning("%s: %s", tag, exc.message)
                failed += min(per, n - s)
        return t0, time.time(), failed


def store_main(o: argparse.Namespace, argv: list[str] | None) -> int:
    from concurrent.futures import ProcessPoolExecutor

    from facegate.gallery.sqlite import SQLiteGalleryStore

    modes = {"per_subject": 1, "per_request": max(1, o.batch // 2)}
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="facegate-store-") as tmp:
        path = str(Path(tmp) / "g.sqlite3")
        with SQLiteGalleryStore(path) as store:
            store.create_gallery("g", "m", 128)
            rng = np.random.default_rng(0)
            for s in range(0, o.prefill, 10_000):
                t = rng.standard_normal((min(10_000, o.prefill - s), 128)).astype(np.float32)
                t /= np.linalg.norm(t, axis=1, keepdims=True)
                store.import_templates("g", [f"p{s + i}" for i in range(len(t))], t, np.ones(len(t), np.float32))
        with ProcessPoolExecutor(o.processes) as pool:
            list(pool.map(store_writer, [(path, f"w{i}", 8, 8, 0.0) for i in range(o.processes)]))  # warm-up
            for r in range(o.rounds):
                row: dict[str, Any] = {}
                for mode, per in modes.items():
                    at = time.time() + 2.0  # every writer has opened the store by then
                    jobs = [(path, f"{mode}-r{r}-{i}", o.subjects, per, at) for i in range(o.processes)]
                    spans = list(pool.map(store_writer, jobs))
                    seconds = max(b for _, b, _ in spans) - min(a for a, _, _ in spans)
                    failed = sum(f for _, _, f in spans)
                    row[f"{mode}_subjects_per_s"] = round((o.processes * o.subjects - failed) / seconds, 1)
                    row[f"{mode}_failed"], row[f"{mode}_s"] = failed, round(seconds, 3)
                row["load_average_1m"] = os.getloadavg()[0]
                rounds.append(row)
                log.info("round %d: %s", r, row)
    written = o.processes * o.subjects
    total = {m: sum(written - x[f"{m}_failed"] for x in rounds) / sum(x[f"{m}_s"] for x in rounds) for m in modes}
    result = {
        "benchmark": "bulk_enrol_store",
        "rounds": rounds,
        **{f"{m}_subjects_per_s": round(v, 1) for m, v in total.items()},
        "ratio": round(total["per_request"] / total["per_subject"], 2),
        "median_round_ratio": round(
            float(np.median([x["per_request_subjects_per_s"] / x["per_subject_subjects_per_s"] for x in rounds])), 2
        ),
        "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]),
        "env": env_record(
            processes=o.processes, subjects=o.subjects, batch=o.batch, prefill=o.prefill, rounds=o.rounds
        ),
    }
    write_json(o.out, result)
    log.info("store: %s", {k: v for k, v in result.items() if k.endswith("_per_s") or k == "ratio"})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--photos", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="photos per enrolment request")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lfw-root", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw")))
    p.add_argument("--store", action="store_true", help="measure the store alone (see the module docstring)")
    p.add_argument("--processes", type=int, default=8, help="--store: writer processes")
    p.add_argument("--subjects", type=int, default=400, help="--store: subjects per writer and mode per round")
    p.add_argument("--prefill", type=int, default=100_000, help="--store: templates in the gallery beforehand")
    p.add_argument("--out", type=Path, default=None, help="default: results/bulk_enrol-cpu2[-store].json")
    o = p.parse_args(argv)
    o.out = o.out or ROOT / "benchmarks" / "results" / f"bulk_enrol-cpu2{'-store' if o.store else ''}.json"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if o.store:
        return store_main(o, argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    people = lfw_pairs(o.lfw_root, o.photos)
    n_photos = 2 * len(people)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="facegate-enrol-") as tmp:
        proc, url = start(Path(tmp), 1, "cpu")
        try:
            with httpx.Client(base_url=url, timeout=300) as c, ThreadPoolExecutor(o.concurrency) as pool:
                c.post("/api/galleries", json={"name": "g"}).raise_for_status()

                def compare(job: tuple[str, bytes, bytes]) -> int:
                    files = {"img1": ("a.jpg", job[1]), "img2": ("b.jpg", job[2])}
                    resp = c.post("/api/compare", files=files)
                    if resp.status_code != 200:
                        log.warning("compare answered %d: %s", resp.status_code, resp.text[:300])
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
