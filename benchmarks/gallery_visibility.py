"""Read your writes across front-ends at 1M subjects, and front-end memory with an empty and a full gallery.

``facegate serve --workers 2 --device DEVICE`` (default cpu) on one data folder, run twice in one invocation:

1. **empty gallery**: create gallery ``g`` through the API; warm both front-ends (compares, searches); record
   each front-end's RSS (``VmRSS``). Then stop the server.
2. import ``--size`` synthetic unit-norm templates into the same SQLite file in bulk (the store's
   ``import_templates``), restart the server, warm it the same way and record the front-ends' RSS again.
3. **visibility**, ``--trials`` times: client A (kept-alive, answered by front-end PA) enrols subject ``v<i>``
   through ``POST /api/galleries/g/templates`` with the embedding of an LFW photo (so detection is not part
   of the write), and as soon as that answers, client B (front-end PB != PA) searches with that photo
   (``POST /api/galleries/g/search``, detection included). ``visible_ms`` is from A's answer to B's answer;
   the trial passes when B's rank-1 hit is ``v<i>``. A then deletes ``v<i>``, and the next trial also checks
   that no search returns a deleted subject. ``search_only_ms``: the same searches with no write before them
   (the part of ``visible_ms`` that is the search itself).

    python benchmarks/gallery_visibility.py --size 1000000 --trials 1000
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, start_serve, write_json
from facegate.gallery import open_store

log = logging.getLogger("gallery_visibility")
ROOT = Path(__file__).resolve().parents[1]


def start(data: Path, workers: int, device: str = "cpu") -> tuple[subprocess.Popen[bytes], str]:
    return start_serve(data, workers, device, timeout_s=600)


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def front_end_pid(client: httpx.Client) -> int:
    """The front-end process that answers this kept-alive connection (``/metrics`` is labelled with it)."""
    text = client.get("/metrics").text
    return int(next(ln.split('"')[1] for ln in text.splitlines() if ln.startswith("facegate_process_info{")))


def two_front_ends(url: str) -> tuple[httpx.Client, httpx.Client, int, int]:
    """Two kept-alive clients answered by two different front-end processes (waits for the second one to
    accept: right after start-up only one may be serving)."""
    deadline = time.monotonic() + 120
    while True:
        a = httpx.Client(base_url=url, timeout=120)
        pa = front_end_pid(a)
        spare = []
        for _ in range(8):
            b = httpx.Client(base_url=url, timeout=120)
            pb = front_end_pid(b)
            if pb != pa:
                for c in spare:
                    c.close()
                return a, b, pa, pb
            spare.append(b)
        for c in [a, *spare]:
            c.close()
        if time.monotonic() > deadline:
            raise RuntimeError("every connection went to one front-end")
        time.sleep(1.0)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for {pid}")


def search(client: httpx.Client, photo: bytes) -> tuple[float, list[str]]:
    t0 = time.perf_counter()
    r = client.post("/api/galleries/g/search", params={"k": 5}, files={"image": ("q.jpg", photo)})
    r.raise_for_status()
    return time.perf_counter() - t0, [h["subject_id"] for h in r.json()["hits"]]


def warm_and_measure(url: str, photos: list[bytes], rounds: int) -> dict[str, Any]:
    """Warm both front-ends with compares and searches; their RSS afterwards."""
    a, b, pa, pb = two_front_ends(url)
    for c in (a, b):
        for i in range(rounds):
            p, q = photos[i % len(photos)], photos[(i + 1) % len(photos)]
            c.post("/api/compare", files={"img1": ("a.jpg", p), "img2": ("b.jpg", q)}).raise_for_status()
            search(c, p)
    out = {"front_end_pids": [pa, pb], "front_end_rss_mib": [rss_mib(pa), rss_mib(pb)]}
    a.close()
    b.close()
    return out


def trials(
    a: httpx.Client, b: httpx.Client, photos: list[bytes], emb: list[list[float]], n: int
) -> tuple[list[float], int, int]:
    """``n`` trials: enrol through ``a``, search through ``b`` at once, delete through ``a``. Returns the
    seconds from each enrolment's answer to the search's answer, how many first searches found the new
    subject at rank 1, and how many searches returned the subject deleted before them."""
    visible, found, stale = [], 0, 0
    prev: str | None = None
    for i in range(n):
        sid, j = f"v{i}", i % len(photos)
        a.post("/api/galleries/g/templates", json={"subject_ids": [sid], "embeddings": [emb[j]]}).raise_for_status()
        t_ack = time.perf_counter()
        _, hits = search(b, photos[j])
        visible.append(time.perf_counter() - t_ack)
        found += bool(hits) and hits[0] == sid
        stale += prev is not None and prev in hits
        a.delete(f"/api/galleries/g/subjects/{sid}").raise_for_status()
        prev = sid
        if i % 100 == 0:
            log.info("trial %d: %.1f ms, found %d/%d", i, visible[-1] * 1000, found, i + 1)
    return visible, found, stale


def lfw_photos(root: Path, n: int) -> list[bytes]:
    people = sorted(d for d in (root / "lfw-deepfunneled").iterdir() if d.is_dir())
    return [sorted(d.glob("*.jpg"))[0].read_bytes() for d in people[:: max(1, len(people) // n)][:n]]


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs) * 1000, q)), 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--baseline", type=int, default=200, help="searches with no write before them")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the server's --device (cpu, cuda)")
    p.add_argument("--photos", type=int, default=20)
    p.add_argument("--lfw-root", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw")))
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/gallery_visibility-cpu2.json")
    o = p.parse_args(argv)
    o.out = o.out or ROOT / "benchmarks" / "results" / "gallery_visibility-cpu2.json"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    photos = lfw_photos(o.lfw_root, o.photos)
    result: dict[str, Any] = {
        "benchmark": "gallery_visibility",
        "gallery": o.size,
        "workers": o.workers,
        "device": o.device,
    }
    with tempfile.TemporaryDirectory(prefix="facegate-vis-") as tmp:
        data = Path(tmp)
        proc, url = start(data, o.workers, o.device)
        try:
            with httpx.Client(base_url=url, timeout=120) as c:
                r = c.post("/api/galleries", json={"name": "g"})
                r.raise_for_status()
                dim = int(r.json()["dim"])
                emb, kept = [], []
                for ph in photos:  # a photo the search gate refuses can never be found: leave it out
                    r = c.post("/api/embed", files={"images": ("p.jpg", ph)})
                    r.raise_for_status()
                    face = r.json()["results"][0]["faces"][0]
                    if face["quality"]["accepted"]:
                        emb.append(face["embedding"])
                        kept.append(ph)
                result["photos_refused_by_gate"] = len(photos) - len(kept)
                photos = kept
            result["empty"] = warm_and_measure(url, photos, 5)
        finally:
            stop(proc)
        log.info("empty gallery: %s", result["empty"])
        rng = np.random.default_rng(0)
        store = open_store(None, data_dir=data)
        t0 = time.perf_counter()
        for s in range(0, o.size, 10_000):
            n = min(10_000, o.size - s)
            t = rng.standard_normal((n, dim), dtype=np.float32)
            t /= np.linalg.norm(t, axis=1, keepdims=True)
            store.import_templates("g", [f"s{i}" for i in range(s, s + n)], t, np.ones(n, np.float32))
        store.close()
        result["import_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        proc, url = start(data, o.workers, o.device)
        result["restart_to_ready_s"] = round(time.perf_counter() - t0, 1)
        try:
            result["full"] = warm_and_measure(url, photos, 5)
            log.info("%d-subject gallery: %s", o.size, result["full"])
            a, b, pa, pb = two_front_ends(url)
            visible, found, stale = trials(a, b, photos, emb, o.trials)
            same = [front_end_pid(a), front_end_pid(b)] == [pa, pb]
            alone = [search(b, photos[i % len(photos)])[0] for i in range(o.baseline)]
            a.close()
            b.close()
        finally:
            stop(proc)
    result["visibility"] = {
        "trials": o.trials,
        "found_by_first_search": found,
        "deleted_subject_returned": stale,
        "clients_kept_their_front_ends": same,
        "write": "POST /api/galleries/g/templates through front-end A (no detection)",
        "search": "POST /api/galleries/g/search through front-end B (detection + embedding + 1:N search)",
        "visible_ms_p50": pct(visible, 50),
        "visible_ms_p99": pct(visible, 99),
        "search_only_ms_p50": pct(alone, 50),
        "search_only_ms_p99": pct(alone, 99),
    }
    e, f = result["empty"]["front_end_rss_mib"], result["full"]["front_end_rss_mib"]
    result["front_end_rss_delta_mib"] = round(max(f) - max(e), 1)
    result["load_average_1m"] = os.getloadavg()[0]
    result["command"] = "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])])
    result["env"] = env_record(size=o.size, trials=o.trials, workers=o.workers, photos=o.photos)
    write_json(o.out, result)
    log.info("visibility %s; RSS empty %s full %s", result["visibility"], e, f)
    return 0 if found == o.trials and stale == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
