"""kill -9 during bulk enrolment: nothing acknowledged is lost and the database stays intact."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from facegate.gallery import open_store

#: Enrols subjects one transaction at a time and prints each id once its commit returned (acknowledged).
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
        store.import_templates("g", [f"{sys.argv[2]}-t{i}"], e[:1], np.ones(1, np.float32))
    else:
        store.add_embeddings("g", f"{sys.argv[2]}-e{i}", e, np.full(3, 0.5, np.float32))
    print(f"{sys.argv[2]}-{'te'[i % 2 == 0]}{i}", flush=True)
    i += 1
"""


@pytest.mark.slow
def test_kill_9_during_bulk_enrolment_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db = tmp_path / "g.sqlite3"
    s = open_store(str(db))
    s.create_gallery("g", "m", 32)
    s.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    acknowledged: set[str] = set()
    rng = np.random.default_rng(0)
    for trial in range(20):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(db), str(trial)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # wait until it is writing
        assert first, "the writer did not start"
        acknowledged.add(first.strip())
        time.sleep(float(rng.uniform(0.0, 0.3)))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        acknowledged.update(x for x in out.split("\n") if x)
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = open_store(str(db))
    stored: set[str] = set()
    while page := store.list_subjects("g", len(stored), 10_000):  # every page: a fast box writes >10k per run
        stored.update(sub.subject_id for sub in page)
    changes = {c.subject_id for c in store.changes_since(0, 100_000) if c.op == "enrol"}
    store.close()
    assert len(acknowledged) > 20
    assert acknowledged <= stored and acknowledged <= changes
