"""Crash soak: kill -9 a ``facegate serve --workers N`` server mid-write, many times; is anything lost or left?

Each round starts the server on one data folder, checks that every gallery write acknowledged so far (a
2xx to ``POST /api/galleries/g/subjects/{id}``) is listed, that the SQLite database passes
``PRAGMA integrity_check``, and that the folders the previous (killed) run left in the temporary directory
are gone; then it enrols subjects from ``--writers`` threads and SIGKILLs the whole process group once at
least ``--writes`` more writes were acknowledged. It counts named shared-memory segments (``/dev/shm``)
that appear and stay, run folders left behind, lost acknowledged writes and failed integrity checks; a
last round stops the server with SIGTERM and checks its exit status.

The JSON is rewritten after every round, so a soak cut short still reports the rounds it made.

  python benchmarks/kill9_soak.py --kills 100 --workers 4 --out benchmarks/results/kill9_soak-cpu2.json
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from common import env_record, start_serve, write_json

log = logging.getLogger("kill9_soak")


def run_folders(pid: int) -> list[str]:
    return sorted(str(p) for p in Path(tempfile.gettempdir()).glob(f"facegate-*-{pid}-*"))


def named_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "facegate"))}


def start(data: Path, workers: int, device: str, log_file: Any) -> tuple[subprocess.Popen[bytes], str]:
    return start_serve(data, workers, device, log_file)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout.strip():
            return
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--writers", type=int, default=4, help="client threads enrolling subjects")
    ap.add_argument("--writes", type=int, default=3, help="acknowledged writes per round before the kill")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--photo", type=Path, default=None, help="a face photo (default: one from FACEGATE_LFW_ROOT)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    photo_path = a.photo or Path(os.environ["FACEGATE_LFW_ROOT"]) / "lfw-deepfunneled/Tony_Blair/Tony_Blair_0001.jpg"
    photo = photo_path.read_bytes()
    data = Path(tempfile.mkdtemp(prefix="fg-kill9-"))
    shm_before = named_shm()
    acked: list[str] = []
    lost: set[str] = set()
    left_folders: list[str] = []
    shm_left: set[str] = set()
    integrity_failures = 0
    killed: list[int] = []
    t0 = time.monotonic()
    env_start = env_record(**{k: str(v) for k, v in vars(a).items()})  # each round runs the code on disk then

    def report(rounds: int, rc: int | None) -> dict[str, Any]:
        result = {
            "env": env_record(**{k: str(v) for k, v in vars(a).items()}),
            "env_start": env_start,
            "command": " ".join(["python", *sys.argv]),
            "kills": rounds,
            "workers": a.workers,
            "acknowledged_writes": len(acked),
            "lost_acknowledged_writes": len(lost),
            "integrity_check_failures": integrity_failures,
            "shared_memory_segments_left": sorted(shm_left),
            "run_folders_left": left_folders,
            "final_sigterm_exit_status": rc,
            "complete": rc is not None,
            "seconds": round(time.monotonic() - t0, 1),
        }
        write_json(a.out, result)
        return result

    with (data / "server.log").open("wb") as log_file:
        for round_ in range(a.kills + 1):
            proc, url = start(data, a.workers, a.device, log_file)
            try:
                for pid in killed[-1:]:
                    left_folders += run_folders(pid)
                if round_ == 0:
                    httpx.post(url + "/api/galleries", json={"name": "g"}, timeout=30).raise_for_status()
                listed = httpx.get(url + "/api/galleries/g/subjects", params={"limit": 10_000}, timeout=60).json()
                lost |= set(acked) - {s["subject_id"] for s in listed["subjects"]}
                with sqlite3.connect(data / "gallery.sqlite3") as db:
                    integrity_failures += db.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
                if round_ == a.kills:
                    proc.send_signal(signal.SIGTERM)
                    rc = proc.wait(60)
                    break
                stop = threading.Event()

                def write(w: int, round_: int = round_, url: str = url, stop: threading.Event = stop) -> None:
                    with httpx.Client(base_url=url, timeout=60) as c:
                        for i in range(10_000):
                            if stop.is_set():
                                return
                            sid = f"r{round_}-w{w}-{i}"
                            try:
                                r = c.post(f"/api/galleries/g/subjects/{sid}", files={"images": ("a.jpg", photo)})
                            except httpx.TransportError:
                                return
                            if r.status_code in (200, 201):
                                acked.append(sid)

                n0 = len(acked)
                threads = [threading.Thread(target=write, args=(w,)) for w in range(a.writers)]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 60
                while len(acked) < n0 + a.writes and time.monotonic() < deadline:
                    time.sleep(0.02)
                kill_group(proc)
                stop.set()
                for t in threads:
                    t.join(60)
                killed.append(proc.pid)
                shm_left |= named_shm() - shm_before
                report(len(killed), None)
                log.info("round %d: %d writes acknowledged so far, %d lost", round_ + 1, len(acked), len(lost))
            finally:
                if proc.poll() is None:
                    kill_group(proc)
    left_folders += run_folders(proc.pid)
    result = report(len(killed), rc)
    log.info("wrote %s: %s", a.out, {k: v for k, v in result.items() if k != "env"})


if __name__ == "__main__":
    main()
