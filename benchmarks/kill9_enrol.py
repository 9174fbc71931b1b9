"""kill -9 during bulk enrolment, many times: is any acknowledged subject lost, is the database intact?

Each trial starts a writer process on one SQLite gallery that bulk-enrols without pause, alternating a
template import and a batch of photo-style enrolments (three subjects of 1–3 embeddings, templates
computed) per transaction, and prints each subject id once its commit returned (acknowledged). After a
random 0–300 ms the writer gets SIGKILL. At the end: ``PRAGMA integrity_check``, and every acknowledged id
must be both a stored subject and an ``enrol`` row of the change feed.

    python benchmarks/kill9_enrol.py --trials 50
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
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("kill9_enrol")
ROOT = Path(__file__).resolve().parents[1]

#: Enrols subjects, a transaction at a time, and prints each id once its commit returned (acknowledged).
WRITER = """
import sys, numpy as np
from facegate.gallery import open_store
store = open_store(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]))
i = 0
while True:
    e = rng.standard_normal((3, 32)).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    if i % 2:
        ids = [f"{sys.argv[2]}-t{i}"]
        store.import_templates("g", ids, e[:1], np.ones(1, np.float32))
    else:  # a batch request's subjects: one transaction
        ids = [f"{sys.argv[2]}-e{i}-{j}" for j in range(3)]
        store.enrol_many("g", [(sid, e[j:], np.full(3 - j, 0.5, np.float32), None) for j, sid in enumerate(ids)])
    print(*ids, sep="\\n", flush=True)
    i += 1
"""


def soak(db: Path, trials: int, seed: int = 0) -> dict[str, Any]:
    """``trials`` kill -9 rounds on a fresh gallery file ``db``; the counts the acceptance asks for."""
    from facegate.gallery import open_store

    s = open_store(str(db))
    s.create_gallery("g", "m", 32)
    s.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    acknowledged: set[str] = set()
    rng = np.random.default_rng(seed)
    corrupt = 0
    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(db), str(trial)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # wait until it is writing
        if not first:
            raise RuntimeError(f"the writer of trial {trial} did not start")
        acknowledged.add(first.strip())
        time.sleep(float(rng.uniform(0.0, 0.3)))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        acknowledged.update(x for x in out.split("\n") if x)
        with sqlite3.connect(db) as c:  # after every kill, not only at the end
            corrupt += c.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
    store = open_store(str(db))
    stored: set[str] = set()
    while page := store.list_subjects("g", len(stored), 10_000):
        stored.update(sub.subject_id for sub in page)
    changes = {c.subject_id for c in store.changes_since(0, 10_000_000) if c.op == "enrol"}
    store.close()
    return {
        "trials": trials,
        "acknowledged": len(acknowledged),
        "stored": len(stored),
        "lost_acknowledged": len(acknowledged - stored),
        "missing_from_feed": len(acknowledged - changes),
        "corrupt_checks": corrupt,
    }


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import env_record, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kill9_enrol-cpu2.json")
    o = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="facegate-kill9-") as tmp:
        t0 = time.perf_counter()
        result: dict[str, Any] = {"benchmark": "kill9_enrol", **soak(Path(tmp) / "g.sqlite3", o.trials)}
        result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["load_average_1m"] = os.getloadavg()[0]
    result["command"] = "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])])
    result["env"] = env_record(trials=o.trials)
    write_json(o.out, result)
    log.info("%s", {k: v for k, v in result.items() if k != "env"})
    return 0 if result["lost_acknowledged"] == result["missing_from_feed"] == result["corrupt_checks"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
