"""The engine's gallery: its index current with the store at every search (also under failures), restart,
threads, stats hook."""

from __future__ import annotations

import sqlite3
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
from facegate.gallery.index import GalleryIndex
from facegate.gallery.sqlite import SQLiteGalleryStore
from facegate.pipeline.search import Gallery
from store_helpers import add_embeddings, index_templates, stored_templates

D = 32


def unit(rng: np.random.Generator, n: int, d: int = D) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def search(gal: Gallery, gallery: str, queries: np.ndarray, k: int) -> list[list[str]]:
    """The search stage's steps: catch up with the store, then the index's top-``k`` subject ids per query."""
    gal.sync()
    if gal.index.entry(gallery) is None:
        gal.store.get_gallery(gallery)  # the store's GalleryNotFoundError (or InvalidParameterError)
    return [ids for ids, _ in gal.index.search_raw(gallery, queries, k)[0]]


def assert_consistent(svc: Gallery, gallery: str) -> None:
    """Once caught up, the index holds exactly the store's subjects and the store's templates, bit for bit."""
    svc.sync()
    ids_db, T_db = stored_templates(svc.store, gallery)
    ids_ix, T_ix = index_templates(svc.index, gallery)
    assert ids_ix == ids_db
    assert T_ix.tobytes() == T_db.tobytes()
    assert svc.store.get_gallery(gallery).subjects == svc.index.sizes()[gallery]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "gallery.sqlite3"


@pytest.fixture
def svc(db: Path):
    s = Gallery(SQLiteGalleryStore(db), GalleryIndex("cpu"))
    yield s
    s.close()


def test_enrol_search_delete_roundtrip(svc: Gallery) -> None:
    rng = np.random.default_rng(0)
    svc.store.create_gallery("g", "sface", D)
    assert_consistent(svc, "g")
    faces = {f"p{i}": unit(rng, 3) for i in range(20)}
    for sid, e in faces.items():
        info = add_embeddings(svc.store, "g", sid, e, np.array([0.9, 0.5, 0.2], np.float32), {"label": sid})
        assert info.n_embeddings == 3
        assert_consistent(svc, "g")
    # a query close to one of p7's images finds p7 first
    probe = faces["p7"][0] + 0.05 * unit(rng, 1)[0]
    assert search(svc, "g", np.stack([probe, unit(rng, 1)[0]]), k=3)[0][0] == "p7"
    # re-enrol appends and moves the template; the index follows
    add_embeddings(svc.store, "g", "p7", unit(rng, 2), np.array([1.0, 1.0], np.float32))
    assert svc.store.get_subject("g", "p7").n_embeddings == 5
    assert_consistent(svc, "g")
    svc.store.delete_subject("g", "p7")
    assert_consistent(svc, "g")
    assert "p7" not in search(svc, "g", probe[None], k=19)[0]
    with pytest.raises(SubjectNotFoundError):
        svc.store.delete_subject("g", "p7")
    assert [s.subject_id for s in svc.store.list_subjects("g", 0, 5)] == ["p0", "p1", "p10", "p11", "p12"]


def test_gallery_lifecycle_and_errors(svc: Gallery) -> None:
    rng = np.random.default_rng(1)
    svc.store.create_gallery("a", "sface", D)
    with pytest.raises(GalleryExistsError):
        svc.store.create_gallery("a", "sface", D)
    with pytest.raises(GalleryNotFoundError):
        search(svc, "nope", unit(rng, 1), k=1)
    with pytest.raises(GalleryNotFoundError):
        add_embeddings(svc.store, "nope", "x", unit(rng, 1), np.ones(1, np.float32))
    with pytest.raises(InvalidParameterError):
        search(svc, "bad name!", unit(rng, 1), k=1)
    with pytest.raises(DimensionMismatchError):
        search(svc, "a", unit(rng, 1, D + 1), k=1)
    # a failed store write leaves the index untouched
    with pytest.raises(DimensionMismatchError):
        add_embeddings(svc.store, "a", "x", unit(rng, 1, D + 1), np.ones(1, np.float32))
    assert svc.index.sizes() == {"a": 0}
    assert search(svc, "a", unit(rng, 1), k=5) == [[]]
    add_embeddings(svc.store, "a", "x", unit(rng, 1), np.ones(1, np.float32))
    svc.store.delete_gallery("a")
    assert svc.sync() == 2 and svc.index.sizes() == {}
    assert svc.store.list_galleries() == []
    with pytest.raises(GalleryNotFoundError):
        search(svc, "a", unit(rng, 1), k=1)


def test_index_failure_fails_the_search_until_the_change_applies(svc: Gallery, monkeypatch: pytest.MonkeyPatch) -> None:
    """A committed change the index cannot apply stays in the feed: the search fails rather than answer from a
    stale index, and the next search applies it."""
    rng = np.random.default_rng(2)
    svc.store.create_gallery("g", "sface", D)
    for i in range(5):
        add_embeddings(svc.store, "g", f"s{i}", unit(rng, 1), np.ones(1, np.float32))
    e = unit(rng, 1)
    with monkeypatch.context() as m:
        m.setattr(svc.index, "upsert", lambda *a: (_ for _ in ()).throw(RuntimeError("simulated device failure")))
        add_embeddings(svc.store, "g", "s9", e, np.ones(1, np.float32))
        with pytest.raises(RuntimeError):
            search(svc, "g", e, k=1)  # the index cannot apply it yet: no stale answer
    assert search(svc, "g", e, k=1)[0][0] == "s9"
    assert_consistent(svc, "g")
    svc.store.delete_subject("g", "s0")
    with monkeypatch.context() as m:
        m.setattr(svc.index, "remove", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError):
            search(svc, "g", e, k=10)
    assert "s0" not in search(svc, "g", e, k=10)[0]
    assert_consistent(svc, "g")


def test_stats_hook(db: Path) -> None:
    calls: list[dict[str, int]] = []
    rng = np.random.default_rng(4)
    svc = Gallery(SQLiteGalleryStore(db), GalleryIndex(), stats_hook=calls.append)
    try:
        svc.store.create_gallery("g", "sface", D)
        svc.sync()
        add_embeddings(svc.store, "g", "a", unit(rng, 1), np.ones(1, np.float32))
        add_embeddings(svc.store, "g", "b", unit(rng, 1), np.ones(1, np.float32))
        svc.sync()
        svc.store.delete_subject("g", "a")
        svc.sync()
        assert calls == [{}, {"g": 0}, {"g": 2}, {"g": 1}]

        def broken(_: dict[str, int]) -> None:
            raise ValueError("metrics backend down")

        # a failing hook never fails loading or applying a change
        other = Gallery(SQLiteGalleryStore(db), GalleryIndex(), stats_hook=broken)
        add_embeddings(svc.store, "g", "c", unit(rng, 1), np.ones(1, np.float32))
        assert other.sync() == 1 and other.index.sizes() == {"g": 2}
        other.close()
    finally:
        svc.close()


def test_restart_gives_identical_results(db: Path) -> None:
    rng = np.random.default_rng(5)
    Q = unit(rng, 16)
    svc = Gallery(SQLiteGalleryStore(db), GalleryIndex())
    svc.store.create_gallery("g", "sface", D)
    svc.store.create_gallery("h", "sface", D)
    for i in range(200):
        add_embeddings(svc.store, "g", f"s{i:03d}", unit(rng, 1 + i % 3), rng.random(1 + i % 3).astype(np.float32))
    svc.store.delete_subject("g", "s100")
    svc.sync()
    before = svc.index.search_raw("g", Q, 10)[0]
    templates = stored_templates(svc.store, "g")
    svc.close()

    svc2 = Gallery(SQLiteGalleryStore(db), GalleryIndex())
    try:
        assert svc2.index.sizes() == {"g": 199, "h": 0}
        ids2, T2 = stored_templates(svc2.store, "g")
        assert ids2 == templates[0] and T2.tobytes() == templates[1].tobytes()
        after = svc2.index.search_raw("g", Q, 10)[0]
        # same ids in the same order; scores equal up to float32 summation order (row order differs)
        assert [r for r, _ in after] == [r for r, _ in before]
        np.testing.assert_allclose([s for _, s in after], [s for _, s in before], atol=1e-6)
        assert_consistent(svc2, "g")
    finally:
        svc2.close()


def test_concurrent_enrolments_from_threads(svc: Gallery, db: Path) -> None:
    svc.store.create_gallery("g", "sface", D)
    svc.store.create_gallery("h", "sface", D)
    n_threads, per_thread = 4, 50
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(10 + t)
        try:
            for i in range(per_thread):
                gallery = "g" if t % 2 == 0 else "h"
                sid = f"shared{i % 4}" if i % 5 == 0 else f"t{t}_{i}"  # 10 writes to contended subjects
                add_embeddings(svc.store, gallery, sid, unit(rng, 1), rng.random(1).astype(np.float32))
                if i % 10 == 9:
                    svc.store.delete_subject(gallery, f"t{t}_{i - 1}")
                search(svc, gallery, unit(rng, 2), k=3)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for gallery in ("g", "h"):
        assert_consistent(svc, gallery)
    with sqlite3.connect(str(db)) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        n_emb = c.execute("SELECT COUNT(*) FROM embeddings").fetchone()[0]
        n_sub = c.execute("SELECT COUNT(*) FROM subjects").fetchone()[0]
        sum_n = c.execute("SELECT SUM(n_embeddings) FROM subjects").fetchone()[0]
    # per thread: 50 enrolments, 5 of which were deleted again (one embedding each)
    assert n_emb == sum_n == n_threads * (per_thread - 5)
    # per gallery: 4 shared subjects + 2 threads x (50 - 10 shared - 5 deleted) own subjects
    assert n_sub == 2 * (4 + 2 * (per_thread - 10 - 5))


def test_closed_store_surfaces_gallery_error(db: Path) -> None:
    svc = Gallery(SQLiteGalleryStore(db), GalleryIndex())
    svc.store.create_gallery("g", "sface", D)
    svc.sync()
    svc.close()
    with pytest.raises(GalleryError):
        add_embeddings(svc.store, "g", "a", unit(np.random.default_rng(0), 1), np.ones(1, np.float32))
    assert svc.index.sizes() == {"g": 0}


def test_index_follows_commits_of_another_process(tmp_path: Path) -> None:
    """Two front-end processes share one SQLite file; each index applies the other's changes."""
    path = tmp_path / "g.sqlite3"
    a = Gallery(SQLiteGalleryStore(path), GalleryIndex(device="cpu"))
    b = Gallery(SQLiteGalleryStore(path), GalleryIndex(device="cpu"))
    try:
        a.store.create_gallery("staff", "sface", 4)
        e = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
        add_embeddings(a.store, "staff", "alice", e, np.array([0.9], np.float32))
        assert a.sync() == 2 and a.sync() == 0
        assert search(b, "staff", e, k=1) == [["alice"]]  # b applies the two changes before searching
        assert b.sync() == 0  # nothing new since
        a.store.delete_subject("staff", "alice")
        assert search(b, "staff", e, k=1) == [[]]
    finally:
        a.close()
        b.close()
