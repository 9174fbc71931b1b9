"""One test suite for every gallery backend: SQLite and a real PostgreSQL server.

Covers the change feed (every mutation commits with a monotonic change row), the index following it at
a cost proportional to the change, read-your-writes across two front-ends sharing one store, and the
lost-write race of a front-end that rebuilt its whole index on foreign writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from facegate.errors import ErasureIncompleteError, GalleryExistsError, GalleryNotFoundError, SubjectNotFoundError
from facegate.gallery import open_store
from facegate.gallery.base import GalleryStore
from facegate.gallery.index import GalleryIndex
from facegate.pipeline.search import Gallery
from store_helpers import add_embeddings, index_templates, stored_template, stored_templates

D = 32

StoreFactory = Callable[[], GalleryStore]


def unit(rng: np.random.Generator, n: int, d: int = D) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(params=["sqlite", "postgres"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """A factory of stores on one shared database (each call: a new connection, like another process)."""
    url = str(tmp_path / "g.sqlite3") if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    opened: list[GalleryStore] = []

    def factory() -> GalleryStore:
        s = open_store(url)
        opened.append(s)
        return s

    yield factory
    for s in opened:
        s.close()


def search(gal: Gallery, gallery: str, queries: np.ndarray, k: int) -> list[list[str]]:
    """The search stage's steps: catch up with the store, then the index's top-``k`` subject ids per query."""
    gal.sync()
    if gal.index.entry(gallery) is None:
        gal.store.get_gallery(gallery)  # the store's GalleryNotFoundError
    return [ids for ids, _ in gal.index.search_raw(gallery, queries, k)[0]]


def gallery_of(make_store: StoreFactory, **kw: object) -> Gallery:
    return Gallery(make_store(), GalleryIndex("cpu"), **kw)  # type: ignore[arg-type]


def test_every_mutation_logs_one_change_in_order(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(0)
    s = make_store()
    assert s.current_seq() == 0 and s.changes_since(0) == []
    s.create_gallery("g", "m", D)
    add_embeddings(s, "g", "a", unit(rng, 2), np.array([0.9, 0.1], np.float32))
    add_embeddings(s, "g", "a", unit(rng, 1), np.array([0.5], np.float32))  # re-enrol
    add_embeddings(s, "g", "b", unit(rng, 1), np.array([0.5], np.float32))
    s.delete_subject("g", "b")
    with pytest.raises(SubjectNotFoundError):
        s.delete_subject("g", "b")
    with pytest.raises(GalleryExistsError):
        s.create_gallery("g", "m", D)
    s.delete_gallery("g")
    changes = s.changes_since(0)
    assert [(c.seq, c.op, c.subject_id) for c in changes] == [
        (1, "create_gallery", None),
        (2, "enrol", "a"),
        (3, "enrol", "a"),
        (4, "enrol", "b"),
        (5, "delete_subject", "b"),
        (6, "delete_gallery", None),
    ]  # failed writes logged nothing
    assert s.current_seq() == 6
    assert [c.seq for c in s.changes_since(3, limit=2)] == [4, 5]
    # state-based: the gallery is gone, so no change carries a template any more
    assert all(c.template is None for c in changes)


def test_gallery_size_is_kept_through_every_write(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(9)
    s = make_store()
    s.create_gallery("g", "m", D)
    s.create_gallery("h", "m", D)
    add_embeddings(s, "g", "a", unit(rng, 2), np.array([0.5, 0.5], np.float32))
    add_embeddings(s, "g", "a", unit(rng, 1), np.array([0.5], np.float32))  # a re-enrolment adds no subject
    s.import_templates("g", ["a", "b", "c"], unit(rng, 3), np.ones(3, np.float32))  # "a" is replaced
    s.delete_subject("g", "b")
    add_embeddings(s, "h", "x", unit(rng, 1), np.array([0.5], np.float32))
    assert s.get_gallery("g").subjects == 2 == len(s.list_subjects("g"))
    assert [(g.name, g.subjects) for g in s.list_galleries()] == [("g", 2), ("h", 1)]


def test_enrol_many_is_one_transaction_with_a_change_row_per_subject(make_store: StoreFactory) -> None:
    from facegate.errors import DimensionMismatchError
    from facegate.gallery.base import quality_weighted_template

    rng = np.random.default_rng(7)
    s, other = make_store(), make_store()
    s.create_gallery("g", "m", D)
    a1, a2, b = unit(rng, 2), unit(rng, 1), unit(rng, 3)
    add_embeddings(s, "g", "a", a1, np.array([0.9, 0.2], np.float32), {"k": 1})
    seq = s.current_seq()
    infos = s.enrol_many(
        "g",
        [("a", a2, np.array([0.5], np.float32), None), ("b", b, np.full(3, 0.4, np.float32), {"k": 2})],
    )
    assert [(i.subject_id, i.n_embeddings, i.meta) for i in infos] == [("a", 3, {"k": 1}), ("b", 3, {"k": 2})]
    assert [(c.op, c.subject_id) for c in other.changes_since(seq)] == [("enrol", "a"), ("enrol", "b")]
    want = quality_weighted_template(np.concatenate([a1, a2]), np.array([0.9, 0.2, 0.5], np.float32))
    np.testing.assert_array_equal(stored_template(other, "g", "a"), want)  # re-enrolment: old and new faces
    assert other.get_gallery("g").subjects == 2
    # one bad item: nothing of the batch is written
    with pytest.raises(DimensionMismatchError):
        s.enrol_many(
            "g", [("c", unit(rng, 1), np.ones(1, np.float32), None), ("d", unit(rng, 1, D + 1), np.ones(1), None)]
        )
    assert other.current_seq() == seq + 2 and other.get_gallery("g").subjects == 2
    assert s.enrol_many("g", []) == []


def test_changes_carry_the_current_template(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(1)
    s = make_store()
    s.create_gallery("g", "m", D)
    add_embeddings(s, "g", "a", unit(rng, 1), np.array([0.9], np.float32))
    c = s.changes_since(0)
    assert c[0].dim == D
    np.testing.assert_array_equal(c[1].template, stored_template(s, "g", "a"))
    seq, galleries = s.load_snapshot()
    assert seq == 2
    dim, ids, t = galleries["g"]
    assert (dim, ids) == (D, ["a"])
    np.testing.assert_array_equal(t[0], stored_template(s, "g", "a"))


def test_import_templates_in_bulk(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(2)
    svc = gallery_of(make_store)
    svc.store.create_gallery("g", "m", D)
    t = unit(rng, 300)
    ids = [f"s{i:04d}" for i in range(300)]
    assert svc.store.import_templates("g", ids, t, np.ones(300, np.float32)) == 300
    assert svc.store.get_gallery("g").subjects == 300
    assert svc.store.current_seq() == 301  # one change per subject, one transaction
    hits = search(svc, "g", t[[7, 123]], k=3)
    assert [h[0] for h in hits] == ["s0007", "s0123"]
    assert svc.store.get_subject("g", "s0007").n_embeddings == 1
    # re-import replaces the subject's template; a later enrolment builds on the imported embedding
    svc.store.import_templates("g", ["s0007"], t[[8]], np.ones(1, np.float32))
    assert svc.store.get_subject("g", "s0007").n_embeddings == 1
    add_embeddings(svc.store, "g", "s0007", t[[9]], np.array([1.0], np.float32))
    assert svc.store.get_subject("g", "s0007").n_embeddings == 2
    svc.close()


def test_enrol_many_with_replace_starts_a_subject_over(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(12)
    svc = gallery_of(make_store)
    svc.store.create_gallery("g", "m", D)
    old, new = unit(rng, 3), unit(rng, 2)
    add_embeddings(svc.store, "g", "a", old, np.ones(3, np.float32), {"k": 1})
    assert search(svc, "g", old[:1], k=1) == [["a"]]
    for _ in range(2):  # the same replace twice: the same subject
        [info] = svc.store.enrol_many("g", [("a", new, np.ones(2, np.float32), None)], replace=True)
        assert (info.n_embeddings, info.meta) == (2, {})
        assert svc.store.get_gallery("g").subjects == 1
    t = new.sum(0) / np.linalg.norm(new.sum(0))
    np.testing.assert_allclose(stored_template(svc.store, "g", "a"), t, atol=1e-6)
    assert search(svc, "g", new[:1], k=1) == [["a"]]
    ids, templates = index_templates(svc.index, "g")  # the index follows the replace
    assert ids == ["a"]
    np.testing.assert_allclose(templates[0], t, atol=1e-6)
    svc.close()


def test_follower_applies_changes_without_reloading(make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    a, b = gallery_of(make_store), gallery_of(make_store)
    a.store.create_gallery("g", "m", D)
    a.store.import_templates("g", [f"s{i}" for i in range(50)], unit(rng, 50), np.ones(50, np.float32))
    loads: list[int] = []
    monkeypatch.setattr(b.store, "load_snapshot", lambda: loads.append(1))  # a reload would fail loudly
    e = unit(rng, 1)
    add_embeddings(a.store, "g", "new", e, np.array([0.8], np.float32))
    assert b.sync() == 52  # create (1) + import (50) + enrol (1), one by one
    assert search(b, "g", e, k=1)[0][0] == "new"
    a.store.delete_subject("g", "new")
    assert b.sync() == 1 and loads == []
    assert search(b, "g", e, k=1)[0][0] != "new"
    # the index matches the store bit for bit
    ids_db, t_db = stored_templates(a.store, "g")  # b.store.load_snapshot is patched; the same database
    ids_ix, t_ix = index_templates(b.index, "g")
    assert ids_ix == ids_db and t_ix.tobytes() == t_db.tobytes()
    a.close()
    b.close()


def test_gallery_recreated_with_another_dim_is_followed(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(4)
    a, b = gallery_of(make_store), gallery_of(make_store)
    a.store.create_gallery("g", "m", D)
    add_embeddings(a.store, "g", "x", unit(rng, 1), np.array([0.8], np.float32))
    a.store.delete_gallery("g")
    a.store.create_gallery("g", "m", 16)
    e = unit(rng, 1, 16)
    add_embeddings(a.store, "g", "x", e, np.array([0.8], np.float32))
    hits = search(b, "g", e, k=5)  # b applies all five changes, reading the final state
    assert hits[0] == ["x"] and index_templates(b.index, "g")[1].shape == (1, 16)
    a.store.delete_gallery("g")
    with pytest.raises(GalleryNotFoundError):
        search(b, "g", e, k=1)
    a.close()
    b.close()


def test_background_follower_applies_foreign_writes(make_store: StoreFactory) -> None:
    rng = np.random.default_rng(5)
    lags: list[float] = []
    a = gallery_of(make_store)
    b = gallery_of(make_store, follow=True, lag_hook=lags.append)
    a.store.create_gallery("g", "m", D)
    add_embeddings(a.store, "g", "x", unit(rng, 1), np.array([0.8], np.float32))
    seq = a.store.current_seq()
    deadline = threading.Event()
    for _ in range(200):  # bounded: 200 × 25 ms
        if b.seq >= seq:
            break
        deadline.wait(0.025)
    assert b.seq >= seq and b.index.sizes() == {"g": 1}
    assert lags and all(lag >= 0 for lag in lags)
    a.close()
    b.close()


@pytest.mark.slow
def test_no_lost_writes_in_1000_trials_of_the_rebuild_race(make_store: StoreFactory) -> None:
    """Two front-ends share one store. In every trial front-end A enrols one subject and deletes another
    while front-end B writes concurrently and A catches up on B's write; A's writes must never be lost,
    and both front-ends must see them as soon as they are acknowledged."""
    rng = np.random.default_rng(6)
    a, b = gallery_of(make_store), gallery_of(make_store)
    a.store.create_gallery("g", "m", D)
    trials = 1000
    own, foreign = unit(rng, trials), unit(rng, trials)
    a.store.import_templates("g", [f"old{i}" for i in range(trials)], unit(rng, trials), np.ones(trials))
    old_t = a.store.load_snapshot()[1]["g"][2]
    one = np.array([0.9], np.float32)
    lost: list[str] = []
    errors: list[BaseException] = []
    incomplete = 0

    def foreign_writer() -> None:
        try:
            for i in range(trials):
                add_embeddings(b.store, "g", f"f{i}", foreign[[i]], one)
                search(b, "g", foreign[[i]], k=1)  # B catches up while A writes
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=foreign_writer)
    t.start()
    for i in range(trials):
        add_embeddings(a.store, "g", f"x{i}", own[[i]], one)
        try:
            a.store.delete_subject("g", f"old{i}")
        except ErasureIncompleteError:
            incomplete += 1  # committed; only the WAL's bytes wait for a reader (checked: never returned)
        for fe in (a, b):
            hit = search(fe, "g", own[[i]], k=1)[0][0]
            if hit != f"x{i}":
                lost.append(f"enrol x{i} missing via {'ab'[fe is b]}")
            gone = search(fe, "g", old_t[[i]], k=1)[0][0]
            if gone == f"old{i}":
                lost.append(f"delete old{i} lost via {'ab'[fe is b]}")
    t.join(60)
    assert not errors and not lost, (errors, lost[:5], len(lost))
    assert incomplete <= trials // 100  # a rare starved checkpoint under a busy foreign writer
    assert a.index.sizes() == b.index.sizes() == {"g": 2 * trials}
    a.close()
    b.close()


def test_create_then_enrol_through_two_front_ends_logs_no_error(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The gallery is created through one front-end and enrolled into through another: no ERROR, and the
    second front-end's index has both changes."""
    import logging

    rng = np.random.default_rng(7)
    a, b = gallery_of(make_store), gallery_of(make_store)
    with caplog.at_level(logging.WARNING):
        a.store.create_gallery("g", "m", D)
        e = unit(rng, 1)
        add_embeddings(b.store, "g", "x", e, np.array([0.8], np.float32))
        assert search(a, "g", e, k=1)[0][0] == "x"
        assert b.sync() == 2
    assert [r for r in caplog.records if r.levelno >= logging.WARNING and "facegate" in r.name] == []
    assert b.index.sizes() == {"g": 1}
    a.close()
    b.close()


def test_reading_a_gallery_deleted_meanwhile_on_postgres(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gallery deleted through another front-end while this one reads it (a delete and re-create racing a search
    or a subject listing) is found or not found, never half: PostgreSQL's READ COMMITTED gives each statement of
    a read its own snapshot, and a second statement found no row (TypeError, a 500 on the search)."""
    import contextlib
    from contextlib import contextmanager

    reader, other = open_store(postgres_url), open_store(postgres_url)
    reader.create_gallery("g", "m", D)
    real_tx = reader._tx  # type: ignore[attr-defined]
    deleted: list[str] = []

    class DeleteAfterLookup:  # the other front-end's delete commits right after the lookup by name
        def __init__(self, conn: object) -> None:
            self.conn = conn

        def __getattr__(self, name: str) -> object:
            return getattr(self.conn, name)

        def execute(self, sql: str, params: object = None) -> object:
            cur = self.conn.execute(sql, params)  # type: ignore[attr-defined]
            if "FROM galleries WHERE name" in sql and not deleted:
                other.delete_gallery("g")
                deleted.append("g")
            return cur

    @contextmanager
    def tx(*args: object, **kw: object) -> Iterator[object]:
        with real_tx(*args, **kw) as conn:
            yield DeleteAfterLookup(conn)

    monkeypatch.setattr(reader, "_tx", tx)
    with contextlib.suppress(GalleryNotFoundError):
        assert reader.get_gallery("g").name == "g"  # as it was when it was read
    assert deleted == ["g"]
    with pytest.raises(GalleryNotFoundError):
        reader.get_gallery("g")
    reader.close()
    other.close()


def test_a_postgres_restart_costs_no_request(postgres_url: str) -> None:
    """After the server drops every connection (a restart, a failover, an idle timeout), the next read is answered:
    a pooled connection is checked before use, so no request gets the dead one (503 gallery_unavailable, up to one
    per pooled connection of every front-end, after the database was back)."""
    import psycopg

    store = open_store(postgres_url)
    store.create_gallery("g", "m", D)
    assert store.get_gallery("g").subjects == 0  # the pool holds a connection now
    dbname = postgres_url.rsplit("/", 1)[1]
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        sql = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
        assert admin.execute(sql, (dbname,)).fetchall()
    for _ in range(6):  # more than the pool's connections
        assert store.get_gallery("g").name == "g"
    store.close()
