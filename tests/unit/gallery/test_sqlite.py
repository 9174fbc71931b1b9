"""SQLiteGalleryStore: schema/pragmas, CRUD, errors, template math, erasure, restart, crash, threads."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from facegate.errors import (
    DimensionMismatchError,
    GalleryError,
    GalleryExistsError,
    GalleryNotFoundError,
    InvalidParameterError,
    SubjectNotFoundError,
)
from facegate.gallery.base import (
    TEMPLATE_WEIGHT_FLOOR,
    GalleryStore,
    quality_weighted_template,
)
from facegate.gallery.sqlite import APPLICATION_ID, SCHEMA_VERSION, SQLiteGalleryStore
from store_helpers import add_embeddings, stored_template, stored_templates


def unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """``(n, d) float32`` random unit vectors."""
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "g" / "gallery.sqlite3"


@pytest.fixture
def store(db: Path):
    s = SQLiteGalleryStore(db)
    yield s
    s.close()


def raw(db: Path) -> sqlite3.Connection:
    """An independent connection, to check what is really in the file."""
    return sqlite3.connect(str(db))


# --------------------------------------------------------------------------- file / pragmas
def test_pragmas_schema_and_protocol(store: SQLiteGalleryStore, db: Path) -> None:
    assert isinstance(store, GalleryStore)
    assert store.journal_mode == "wal"
    with raw(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert c.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"galleries", "subjects", "embeddings", "changes", "sqlite_sequence"}
    conn = store._conn  # per-connection settings: check on the store's own connection
    assert conn is not None
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert conn.execute("PRAGMA secure_delete").fetchone()[0] == 1
    assert (os.stat(db).st_mode & 0o777) == 0o600


def test_a_v2_file_gets_its_subject_counts(db: Path) -> None:
    rng = np.random.default_rng(3)
    with SQLiteGalleryStore(db) as s:
        s.create_gallery("g", "sface", 8)
        s.import_templates("g", ["a", "b", "c"], unit(rng, 3, 8), np.ones(3, np.float32))
    with raw(db) as c:  # back to the v2 schema: no kept count
        c.execute("ALTER TABLE galleries DROP COLUMN subjects")
        c.execute("PRAGMA user_version=2")
    with SQLiteGalleryStore(db) as s:
        assert s.get_gallery("g").subjects == 3


def test_a_v1_file_gets_the_change_log_and_its_subject_counts(db: Path) -> None:
    rng = np.random.default_rng(4)
    with SQLiteGalleryStore(db) as s:
        s.create_gallery("g", "sface", 8)
        s.import_templates("g", ["a", "b"], unit(rng, 2, 8), np.ones(2, np.float32))
    with raw(db) as c:  # back to the v1 schema: no change log, no kept count
        c.execute("DROP TABLE changes")
        c.execute("ALTER TABLE galleries DROP COLUMN subjects")
        c.execute("PRAGMA user_version=1")
    with SQLiteGalleryStore(db) as s:
        assert s.get_gallery("g").subjects == 2
        s.delete_subject("g", "a")
        assert [(c.op, c.subject_id) for c in s.changes_since(0)] == [("delete_subject", "a")]
    with raw(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_reopen_does_not_remigrate(db: Path) -> None:
    SQLiteGalleryStore(db).close()
    with SQLiteGalleryStore(db) as s:
        s.create_gallery("a", "sface", 8)
    with SQLiteGalleryStore(db) as s:
        assert [g.name for g in s.list_galleries()] == ["a"]


def test_opening_waits_out_a_busy_file(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's write lock held past the busy timeout: opening retries until it is released, and
    gives up with a GalleryError naming SQLITE_BUSY after ``open_retry_s``."""
    monkeypatch.setattr("facegate.gallery.sqlite.BUSY_TIMEOUT_S", 0.05)
    SQLiteGalleryStore(db).close()
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(GalleryError) as err:
        SQLiteGalleryStore(db, open_retry_s=0.3)
    assert err.value.detail["sqlite_errorname"] == "SQLITE_BUSY"
    release = threading.Timer(0.5, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        store = SQLiteGalleryStore(db, open_retry_s=10.0)
    finally:
        release.join()
        holder.close()
    assert store.journal_mode == "wal"
    store.close()


def test_refuses_foreign_and_newer_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(GalleryError):
        SQLiteGalleryStore(junk)
    other = tmp_path / "other.sqlite3"
    with raw(other) as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(GalleryError, match="something else"):
        SQLiteGalleryStore(other)
    newer = tmp_path / "newer.sqlite3"
    SQLiteGalleryStore(newer).close()
    with raw(newer) as c:
        c.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(GalleryError, match="schema"):
        SQLiteGalleryStore(newer)


def test_closed_store_raises(db: Path) -> None:
    s = SQLiteGalleryStore(db)
    s.close()
    s.close()  # idempotent
    with pytest.raises(GalleryError, match="closed"):
        s.list_galleries()


def test_sqlite_errors_are_converted(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("facegate.gallery.sqlite.BUSY_TIMEOUT_S", 0.05)
    with SQLiteGalleryStore(db) as s:
        s.create_gallery("a", "sface", 4)
        other = sqlite3.connect(str(db), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process-like writer holds the lock
        try:
            with pytest.raises(GalleryError) as ei:
                s.create_gallery("b", "sface", 4)
            assert not isinstance(ei.value, sqlite3.Error)
            assert ei.value.detail["sqlite_error"] == "OperationalError"
        finally:
            other.execute("ROLLBACK")
            other.close()
        s.create_gallery("b", "sface", 4)  # lock released: works again


# --------------------------------------------------------------------------- galleries
def test_gallery_crud(store: SQLiteGalleryStore) -> None:
    a = store.create_gallery("staff", "sface", 128)
    assert (a.name, a.model, a.dim, a.subjects) == ("staff", "sface", 128, 0)
    store.create_gallery("guests-2024.v1", "irse64_rts", 512)
    assert [g.name for g in store.list_galleries()] == ["guests-2024.v1", "staff"]
    assert store.get_gallery("staff") == a
    with pytest.raises(GalleryExistsError):
        store.create_gallery("staff", "sface", 128)
    store.delete_gallery("staff")
    with pytest.raises(GalleryNotFoundError):
        store.get_gallery("staff")
    with pytest.raises(GalleryNotFoundError):
        store.delete_gallery("staff")
    assert [g.name for g in store.list_galleries()] == ["guests-2024.v1"]


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "../etc", "é", None, 5, "a/b"])
def test_invalid_gallery_names(store: SQLiteGalleryStore, name: object) -> None:
    with pytest.raises(InvalidParameterError):
        store.create_gallery(name, "sface", 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("dim", [0, -1, 10**6, 1.5, True, "8"])
def test_invalid_dims_and_models(store: SQLiteGalleryStore, dim: object) -> None:
    with pytest.raises(InvalidParameterError):
        store.create_gallery("g", "sface", dim)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        store.create_gallery("g", "bad model", 8)
    assert store.list_galleries() == []


# --------------------------------------------------------------------------- subjects + templates
def reference_template(e: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Independent restatement of the documented formula."""
    w = np.maximum(q.astype(np.float64), TEMPLATE_WEIGHT_FLOOR)
    s = (w[:, None] * e.astype(np.float64)).sum(axis=0)
    return (s / np.sqrt((s * s).sum())).astype(np.float32)


def test_quality_weighted_template_and_append(store: SQLiteGalleryStore) -> None:
    rng = np.random.default_rng(0)
    store.create_gallery("g", "sface", 16)
    e1, q1 = unit(rng, 3, 16), np.array([0.9, 0.1, 0.5], np.float32)
    info = add_embeddings(store, "g", "alice", e1, q1, {"name": "Alice"})
    assert (info.subject_id, info.n_embeddings, info.meta) == ("alice", 3, {"name": "Alice"})
    assert info.template_quality == pytest.approx(0.9)
    t = stored_template(store, "g", "alice")
    assert t.dtype == np.float32 and t.shape == (16,)
    np.testing.assert_allclose(t, reference_template(e1, q1), atol=1e-6)
    assert abs(np.linalg.norm(t) - 1) < 1e-6
    # the template leans towards the high-quality embedding
    assert float(t @ e1[0]) > float(t @ e1[1])

    e2, q2 = unit(rng, 2, 16), np.array([0.95, 0.0], np.float32)
    info2 = add_embeddings(store, "g", "alice", e2, q2)  # meta=None keeps the meta
    assert info2.n_embeddings == 5 and info2.meta == {"name": "Alice"}
    assert info2.template_quality == pytest.approx(0.95)
    assert info2.created_at == info.created_at and info2.updated_at >= info.updated_at
    np.testing.assert_allclose(
        stored_template(store, "g", "alice"), reference_template(np.vstack([e1, e2]), np.hstack([q1, q2])), atol=1e-6
    )
    assert add_embeddings(store, "g", "alice", e2[:1], q2[:1], {"x": [1, 2]}).meta == {"x": [1, 2]}


def test_template_edge_cases() -> None:
    rng = np.random.default_rng(1)
    e = unit(rng, 4, 8)
    zero_q = quality_weighted_template(e, np.zeros(4, np.float32))  # floor -> plain mean direction
    mean = e.astype(np.float64).sum(0)
    np.testing.assert_allclose(zero_q, mean / np.linalg.norm(mean), atol=1e-6)
    opposite = np.stack([e[0], -e[0]])  # weighted sum vanishes -> the heaviest embedding
    np.testing.assert_allclose(quality_weighted_template(opposite, np.array([0.5, 0.5], np.float32)), e[0])


def test_enrolment_errors_are_atomic(store: SQLiteGalleryStore) -> None:
    rng = np.random.default_rng(2)
    store.create_gallery("g", "sface", 8)
    ok_q = np.ones(1, np.float32)
    with pytest.raises(DimensionMismatchError):
        add_embeddings(store, "g", "s", unit(rng, 1, 9), ok_q)
    with pytest.raises(GalleryNotFoundError):
        add_embeddings(store, "nope", "s", unit(rng, 1, 8), ok_q)
    bad = [
        (unit(rng, 1, 8) * 2, ok_q),  # not normalised
        (np.full((1, 8), np.nan, np.float32), ok_q),
        (unit(rng, 1, 8), np.array([1.5], np.float32)),  # quality outside [0, 1]
        (unit(rng, 2, 8), ok_q),  # qualities shape
        (unit(rng, 1, 8)[0], ok_q),  # 1-D
        (np.zeros((0, 8), np.float32), np.zeros(0, np.float32)),
    ]
    for emb, q in bad:
        with pytest.raises(InvalidParameterError):
            add_embeddings(store, "g", "s", emb, q)
    with pytest.raises(InvalidParameterError):
        add_embeddings(store, "g", "bad id!", unit(rng, 1, 8), ok_q)
    with pytest.raises(InvalidParameterError):
        add_embeddings(store, "g", "s", unit(rng, 1, 8), ok_q, {"x": object()})
    with pytest.raises(InvalidParameterError):
        add_embeddings(store, "g", "s", unit(rng, 1, 8), ok_q, {"x": "y" * 20000})
    # nothing of the failed calls was written
    assert store.list_subjects("g") == []
    with pytest.raises(SubjectNotFoundError):
        store.get_subject("g", "s")
    with pytest.raises(SubjectNotFoundError):
        store.delete_subject("g", "s")


def test_list_subjects_pages(store: SQLiteGalleryStore) -> None:
    rng = np.random.default_rng(3)
    store.create_gallery("g", "sface", 4)
    ids = [f"user{i:03d}" for i in range(25)]
    for sid in reversed(ids):
        add_embeddings(store, "g", sid, unit(rng, 1, 4), np.array([0.5], np.float32))
    pages = [store.list_subjects("g", off, 10) for off in (0, 10, 20, 30)]
    assert [len(p) for p in pages] == [10, 10, 5, 0]
    assert [s.subject_id for p in pages for s in p] == ids
    assert store.get_gallery("g").subjects == 25
    for off, lim in [(-1, 10), (0, 0), (0, 10**6), (0, 1.5)]:
        with pytest.raises(InvalidParameterError):
            store.list_subjects("g", off, lim)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- erasure
def test_delete_subject_really_erases(store: SQLiteGalleryStore, db: Path) -> None:
    rng = np.random.default_rng(4)
    store.create_gallery("g", "sface", 32)
    secret = unit(rng, 2, 32)
    add_embeddings(store, "g", "victim", secret, np.array([0.7, 0.6], np.float32))
    add_embeddings(store, "g", "keeper", unit(rng, 1, 32), np.array([0.7], np.float32))
    template = stored_template(store, "g", "victim")
    blobs = [secret[0].tobytes(), secret[1].tobytes(), template.tobytes()]

    def files_holding_blobs() -> list[str]:
        return [f.name for f in db.parent.iterdir() if any(b in f.read_bytes() for b in blobs)]

    assert files_holding_blobs()  # precondition: the check below can see the vectors when they are there
    store.delete_subject("g", "victim")
    with raw(db) as c:
        assert c.execute("SELECT COUNT(*) FROM subjects WHERE subject_id='victim'").fetchone()[0] == 0
        assert c.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0] == 1  # only keeper's row
        assert c.execute("SELECT COUNT(*) FROM subjects").fetchone()[0] == 1
    # the vectors' bytes are gone from every file SQLite owns (secure_delete + WAL truncate)
    assert files_holding_blobs() == []
    with pytest.raises(SubjectNotFoundError):
        store.get_subject("g", "victim")


def test_delete_gallery_cascades(store: SQLiteGalleryStore, db: Path) -> None:
    rng = np.random.default_rng(5)
    store.create_gallery("g", "sface", 8)
    store.create_gallery("h", "sface", 8)
    for sid in ("a", "b"):
        add_embeddings(store, "g", sid, unit(rng, 2, 8), np.array([0.5, 0.5], np.float32))
    add_embeddings(store, "h", "a", unit(rng, 1, 8), np.array([0.5], np.float32))
    store.delete_gallery("g")
    with raw(db) as c:
        assert c.execute("SELECT COUNT(*) FROM subjects").fetchone()[0] == 1
        assert c.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0] == 1
    assert stored_templates(store, "h")[0] == ["a"]


# --------------------------------------------------------------------------- durability
def test_restart_keeps_everything(db: Path) -> None:
    rng = np.random.default_rng(6)
    with SQLiteGalleryStore(db) as s:
        s.create_gallery("g", "sface", 64)
        s.create_gallery("empty", "sface", 64)
        for i in range(40):
            add_embeddings(s, "g", f"s{i:02d}", unit(rng, 1 + i % 3, 64), rng.random(1 + i % 3).astype(np.float32))
        ids, T = stored_templates(s, "g")
        subjects = s.list_subjects("g", 0, 100)
        galleries = s.list_galleries()
    with SQLiteGalleryStore(db) as s:
        ids2, T2 = stored_templates(s, "g")
        assert ids2 == ids and T2.dtype == np.float32 and T2.tobytes() == T.tobytes()
        assert s.list_subjects("g", 0, 100) == subjects
        assert s.list_galleries() == galleries
        assert stored_templates(s, "empty")[1].shape == (0, 64)


_CHILD_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from facegate.gallery.sqlite import SQLiteGalleryStore
    with SQLiteGalleryStore(sys.argv[1]) as s:
        s.enrol_many("g", [(sys.argv[2], np.eye(4, dtype=np.float32)[:1], np.ones(1, np.float32), None)])
    """
)


def test_a_second_store_in_a_process_keeps_its_writes_shared(db: Path) -> None:
    """Two stores on one file in one process (a one-process server's app and engine), another process writing and
    closing in between: every write is seen by the first store and is in the file afterwards. Opening the second
    store must not drop the process's locks on the database, or the other process deletes the live WAL."""
    first = SQLiteGalleryStore(db)
    first.create_gallery("g", "sface", 4)
    second = SQLiteGalleryStore(db)
    seen = []
    for sid in ("x", "y"):
        subprocess.run([sys.executable, "-c", _CHILD_WRITER, str(db), sid], check=True, timeout=60)
        seen.append([s.subject_id for s in first.list_subjects("g")])
    first.delete_subject("g", "x")
    subprocess.run([sys.executable, "-c", _CHILD_WRITER, str(db), "z"], check=True, timeout=60)
    seen.append([s.subject_id for s in first.list_subjects("g")])
    assert seen == [["x"], ["x", "y"], ["y", "z"]]
    second.close()
    first.close()
    with raw(db) as c:
        assert sorted(r[0] for r in c.execute("SELECT subject_id FROM subjects")) == ["y", "z"]


_CRASH_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from facegate.gallery.sqlite import SQLiteGalleryStore
    s = SQLiteGalleryStore(sys.argv[1])
    s.create_gallery("g", "sface", 16)
    rng = np.random.default_rng(7)
    for i in range(int(sys.argv[2])):
        e = rng.standard_normal((1, 16)).astype(np.float32)
        e /= np.linalg.norm(e)
        s.enrol_many("g", [(f"s{i}", e, np.array([0.5], np.float32), None)])
        print(i, flush=True)  # acknowledged
    os.kill(os.getpid(), signal.SIGKILL)  # crash: no close(), no checkpoint
    """
)


def test_acknowledged_writes_survive_a_crash(db: Path) -> None:
    n = 25
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_WRITER, str(db), str(n)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    acked = [int(x) for x in proc.stdout.split()]
    assert acked == list(range(n))
    assert Path(str(db) + "-wal").stat().st_size > 0  # the data is only in the WAL: recovery is exercised
    rng = np.random.default_rng(7)
    expected = []
    for _ in range(n):
        e = rng.standard_normal((1, 16)).astype(np.float32)
        expected.append(e / np.linalg.norm(e))
    with SQLiteGalleryStore(db) as s:
        for i in acked:
            np.testing.assert_allclose(stored_template(s, "g", f"s{i}"), expected[i][0], atol=1e-6)
        assert s.get_gallery("g").subjects == n


# --------------------------------------------------------------------------- threads
def test_concurrent_writers(store: SQLiteGalleryStore, db: Path) -> None:
    store.create_gallery("g", "sface", 32)
    n_threads, per_thread = 4, 50
    errors: list[BaseException] = []
    sent: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    sent_lock = threading.Lock()

    def writer(t: int) -> None:
        rng = np.random.default_rng(100 + t)
        try:
            for i in range(per_thread):
                # half the writes go to 5 subjects shared by all threads (read-modify-write contention)
                sid = f"shared{i % 5}" if i % 2 else f"t{t}_{i}"
                e, q = unit(rng, 1, 32), rng.random(1).astype(np.float32)
                add_embeddings(store, "g", sid, e, q)
                with sent_lock:
                    sent.setdefault(sid, []).append((e, q))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    with raw(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert c.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0] == n_threads * per_thread
    assert store.get_gallery("g").subjects == len(sent) == 5 + n_threads * per_thread // 2
    for sid, items in sent.items():
        info = store.get_subject("g", sid)
        assert info.n_embeddings == len(items)
        # the stored template covers every embedding, whatever order the threads committed in
        e = np.vstack([x for x, _ in items])
        q = np.hstack([y for _, y in items])
        np.testing.assert_allclose(stored_template(store, "g", sid), reference_template(e, q), atol=1e-5)


def test_delete_erases_while_another_connection_reads(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader holding a snapshot: the delete waits for it (busy timeout) and then erases; a reader that
    outlasts the wait gets a clear erasure_incomplete error, and the bytes go once it has finished."""
    monkeypatch.setattr("facegate.gallery.sqlite.BUSY_TIMEOUT_S", 0.5)
    import threading

    from facegate.errors import ErasureIncompleteError

    rng = np.random.default_rng(9)
    store = SQLiteGalleryStore(db)
    store.create_gallery("g", "sface", 32)
    for sid in ("a", "b"):
        add_embeddings(store, "g", sid, unit(rng, 1, 32), np.array([0.7], np.float32))
    blobs = {sid: stored_template(store, "g", sid).tobytes() for sid in ("a", "b")}

    def on_disk(sid: str) -> bool:
        return any(blobs[sid] in f.read_bytes() for f in db.parent.iterdir())

    reader = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM subjects").fetchone()  # holds a read snapshot
    threading.Timer(0.15, lambda: reader.execute("COMMIT")).start()
    store.delete_subject("g", "a")  # waits for the reader, then checkpoints
    assert not on_disk("a")

    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM subjects").fetchone()
    with pytest.raises(ErasureIncompleteError):
        store.delete_subject("g", "b")  # the reader outlasts the 0.5 s wait
    with pytest.raises(SubjectNotFoundError):
        store.get_subject("g", "b")  # the delete itself is committed
    reader.execute("COMMIT")
    with pytest.raises(SubjectNotFoundError):
        store.delete_subject("g", "b")  # the client's retry, as the 503 asks: it finishes the erasure, then 404
    assert not on_disk("b")

    store.create_gallery("h", "sface", 32)
    add_embeddings(store, "h", "c", unit(rng, 1, 32), np.array([0.7], np.float32))
    blobs["c"] = stored_template(store, "h", "c").tobytes()
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM subjects").fetchone()
    with pytest.raises(ErasureIncompleteError):
        store.delete_gallery("h")
    reader.execute("COMMIT")
    with pytest.raises(GalleryNotFoundError):
        store.delete_gallery("h")  # likewise for a gallery
    assert not on_disk("c")
    store.erase_pending()  # nothing pending: a no-op
    reader.close()
    store.close()


def test_writers_of_several_processes_queue_on_the_writers_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write waits for the ``<file>-writers`` lock that another process holds, goes ahead as soon as it is
    released, and answers GalleryUnavailableError (503) when it is held past the busy timeout."""
    monkeypatch.setattr("facegate.gallery.sqlite.BUSY_TIMEOUT_S", 0.3)
    import fcntl
    import time

    from facegate.errors import GalleryUnavailableError

    db = tmp_path / "g.sqlite3"
    rng = np.random.default_rng(5)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, sys, time\nf = open({str(db) + '-writers'!r}, 'a')\n"
         "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with SQLiteGalleryStore(db) as store:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            with pytest.raises(GalleryUnavailableError) as err:
                store.create_gallery("g", "m", 8)
            assert err.value.detail["sqlite_errorname"] == "SQLITE_BUSY"
            assert store.list_galleries() == []  # reads do not queue
            done = threading.Event()
            t = threading.Thread(target=lambda: (store.create_gallery("g", "m", 8), done.set()))
            t.start()
            time.sleep(0.1)
            assert not done.is_set()
            holder.stdin.write("\n")  # type: ignore[union-attr]
            holder.stdin.flush()  # type: ignore[union-attr]
            t.join(5)
            assert done.is_set() and store.get_gallery("g").dim == 8
            add_embeddings(store, "g", "a", unit(rng, 1, 8), np.ones(1, np.float32))
            fd = os.open(str(db) + "-writers", os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after every write
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()
