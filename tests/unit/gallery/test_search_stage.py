"""The engine's search stage: batched across requests and galleries, current with the store per batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from facegate.errors import GalleryNotFoundError, GalleryUnavailableError, InvalidParameterError
from facegate.gallery import open_store
from facegate.gallery.index import GalleryIndex
from facegate.pipeline.search import Gallery, SearchOut, SearchStage, decode_search, encode_search
from store_helpers import add_embeddings

D = 16


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def store_with(tmp_path: Path, galleries: dict[str, tuple[str, np.ndarray]]) -> tuple[str, Any]:
    """A SQLite store at ``tmp_path`` holding ``{name: (model, (n, D) templates)}`` (subjects ``name0..``): its
    URL and the writer's connection."""
    url = str(tmp_path / "g.sqlite3")
    writer = open_store(url)
    for name, (model, t) in galleries.items():
        writer.create_gallery(name, model, D)
        writer.import_templates(name, [f"{name}{i}" for i in range(len(t))], t, np.ones(len(t), np.float32))
    return url, writer


def run(stage: SearchStage, payloads: list[np.ndarray]) -> list[object]:
    return stage.execute(stage.prepare(payloads))


def test_wire_roundtrip_and_malformed() -> None:
    q = np.arange(D, dtype=np.float32)
    name, k, back = decode_search(encode_search("g-1.x", q, 7))
    assert (name, k) == ("g-1.x", 7) and back.tobytes() == q.tobytes()
    with pytest.raises(InvalidParameterError):
        decode_search(np.zeros(10, np.uint8))
    with pytest.raises(InvalidParameterError):
        encode_search("bad name", q, 1)


def test_one_batch_mixes_galleries_and_sees_foreign_writes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    url = str(tmp_path / "g.sqlite3")
    writer = open_store(url)  # a front-end's connection: writes only
    stage = SearchStage(lambda: Gallery(open_store(url), GalleryIndex("cpu")), model=("m", D))
    writer.create_gallery("a", "m", D)
    writer.create_gallery("b", "m", D)
    ta, tb = unit(rng, 50), unit(rng, 30)
    writer.import_templates("a", [f"a{i}" for i in range(50)], ta, np.ones(50, np.float32))
    writer.import_templates("b", [f"b{i}" for i in range(30)], tb, np.ones(30, np.float32))
    out = run(
        stage,
        [
            encode_search("a", ta[3], 1),
            encode_search("b", tb[4], 5),
            encode_search("a", ta[7], 3),
            encode_search("nope", ta[0], 1),
            np.zeros(3, np.uint8),
        ],
    )
    assert isinstance(out[0], SearchOut) and out[0].subject_ids == ["a3"] and out[0].size == 50
    assert out[1].subject_ids[0] == "b4" and len(out[1].subject_ids) == 5 and out[1].size == 30
    assert out[2].subject_ids[0] == "a7" and np.all(np.diff(out[2].scores) <= 0)
    assert isinstance(out[3], GalleryNotFoundError) and isinstance(out[4], InvalidParameterError)
    # a write acknowledged by another connection is seen by the next batch, and so is a delete
    e = unit(rng, 1)
    add_embeddings(writer, "a", "new", e, np.ones(1, np.float32))
    writer.delete_subject("a", "a3")
    got = run(stage, [encode_search("a", e[0], 1), encode_search("a", ta[3], 1)])
    assert got[0].subject_ids == ["new"] and got[1].subject_ids != ["a3"] and got[0].size == 50
    assert got[0].seq == writer.current_seq()
    stage.close()
    writer.close()


def test_store_down_answers_unavailable_then_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import facegate.pipeline.search as search_mod

    monkeypatch.setattr(search_mod, "REOPEN_S", 0.0)
    url = str(tmp_path / "g.sqlite3")
    calls: list[int] = []

    def opener() -> Gallery:
        calls.append(1)
        if len(calls) <= 2:  # down at start-up and at the first batch
            return open_store("postgresql://nobody@127.0.0.1:1/none", open_retry_s=1)  # type: ignore[return-value]
        return Gallery(open_store(url), GalleryIndex("cpu"))

    stage = SearchStage(opener, model=("m", D))
    assert stage.gallery is None
    with pytest.raises(GalleryUnavailableError):
        run(stage, [])
    w = open_store(url)
    w.create_gallery("g", "m", D)
    out = run(stage, [encode_search("g", np.ones(D, np.float32), 1)])
    assert out[0].subject_ids == [] and out[0].size == 0
    stage.close()
    w.close()


class _PhotoByIndex:
    """A photo stage over fixed embeddings: photo bytes ``[i]`` give gallery row ``i``'s face; ``[255]`` a
    photo with no face (its error)."""

    def __init__(self, emb: np.ndarray, device: str = "cpu") -> None:
        self.emb = emb
        self.device = device

    def prepare(self, photos: list[np.ndarray]) -> list[int]:
        return [int(p[0]) for p in photos]

    def execute(self, rows: list[int]) -> list[object]:
        from types import SimpleNamespace

        from facegate.errors import NoFaceError

        return [NoFaceError("no face") if r == 255 else SimpleNamespace(embedding=self.emb[r : r + 1]) for r in rows]

    def execute_with(self, rows: list[int], extra: object) -> tuple[list[object], None, set[int]]:
        assert extra is None  # a NumPy index queues no search on the embeddings
        return self.execute(rows), None, set()


class _PhotoOnDevice(_PhotoByIndex):
    """:class:`_PhotoByIndex` with the photo stage's ``execute_with``: the embeddings as a torch tensor for the
    search to queue on; photo ``[254]`` is row 0's face settled by the host rule: its device row (another
    embedding) is void."""

    def execute(self, rows: list[int]) -> list[object]:
        return super().execute([0 if r == 254 else r for r in rows])

    def execute_with(self, rows: list[int], extra: object) -> tuple[list[object], np.ndarray | None, set[int]]:
        import torch

        faces = self.execute(rows)
        owners = [j for j, r in enumerate(rows) if r != 255]
        emb = torch.from_numpy(np.stack([-self.emb[0] if rows[j] == 254 else self.emb[rows[j]] for j in owners]))
        more = None if extra is None else extra(emb.to(self.device), owners)  # type: ignore[operator]
        return faces, None if more is None else more.cpu().numpy(), {j for j in owners if rows[j] == 254}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_photo_search_on_a_torch_index_shares_the_photo_wait(tmp_path: Path, device: str) -> None:
    """On a torch index the search is queued on the photos' embeddings and read from their one host copy; it
    answers as the search on its own does, the host rule's photos and other galleries included; a gallery of
    another model and a missing one get their errors before the photo is looked at."""
    pytest.importorskip("torch")
    from facegate.errors import DimensionMismatchError, NoFaceError
    from facegate.pipeline.search import PhotoSearchStage, encode_photo_search

    rng = np.random.default_rng(4)
    t = unit(rng, 30)
    url, writer = store_with(tmp_path, {"a": ("m", t), "b": ("m", t), "x": ("other", t)})
    t[7] = -t[7]  # photo 7's face is no longer a7: only a search of the right embedding finds a7
    search = SearchStage(lambda: Gallery(open_store(url), GalleryIndex("cpu", "float32")), model=("m", D))
    fused = SearchStage(lambda: Gallery(open_store(url), GalleryIndex(device, "float16")), model=("m", D))
    payloads = [
        encode_photo_search("a", bytes([4]), 3),
        encode_photo_search("b", bytes([9]), 1),
        encode_photo_search("a", bytes([255]), 1),
        encode_photo_search("a", bytes([254]), 2),
        encode_photo_search("x", bytes([5]), 1),
        encode_photo_search("nope", bytes([255]), 1),
        encode_photo_search("a", bytes([7]), 2),
    ]
    ref = PhotoSearchStage(_PhotoOnDevice(t), search)  # its plain execute: the search on its own
    stage = PhotoSearchStage(_PhotoOnDevice(t, device), fused)
    assert stage._search.gallery.index.on_torch and not ref._search.gallery.index.on_torch
    want = ref.execute(ref.prepare(payloads))
    got = stage.execute(stage.prepare(payloads))
    for w, g in zip(want, got, strict=True):
        if isinstance(w, BaseException):
            assert type(g) is type(w)
        else:
            assert g[1].subject_ids == w[1].subject_ids and g[1].size == w[1].size == 30
            np.testing.assert_allclose(g[1].scores, w[1].scores, atol=2e-3)  # fp16 templates
    assert got[0][1].subject_ids[0] == "a4" and len(got[0][1].subject_ids) == 3
    assert got[3][1].subject_ids[0] == "a0"  # the host rule's face, searched on its own
    assert isinstance(got[2], NoFaceError)
    assert isinstance(got[4], DimensionMismatchError) and isinstance(got[5], GalleryNotFoundError)
    assert got[6][1].subject_ids[0] != "a7"
    search.close()
    fused.close()
    writer.close()


def test_photo_search_keeps_each_photo_with_its_answer(tmp_path: Path) -> None:
    """Photos with a face are searched in one batch; a malformed request and a photo without a face get
    their own errors, in place."""
    from facegate.errors import NoFaceError
    from facegate.pipeline.search import PhotoSearchStage, encode_photo_search

    rng = np.random.default_rng(3)
    t = unit(rng, 20)
    url, writer = store_with(tmp_path, {"a": ("m", t)})
    search = SearchStage(lambda: Gallery(open_store(url), GalleryIndex("cpu")), model=("m", D))
    stage = PhotoSearchStage(_PhotoByIndex(t), search)
    payloads = [
        encode_photo_search("a", bytes([4]), 2),
        np.zeros(3, np.uint8),
        encode_photo_search("a", bytes([255]), 1),
        encode_photo_search("a", bytes([9]), 1),
    ]
    out = stage.execute(stage.prepare(payloads))
    assert out[0][1].subject_ids[0] == "a4" and len(out[0][1].subject_ids) == 2
    assert out[0][0].embedding.shape == (1, D)
    assert isinstance(out[1], InvalidParameterError)
    assert isinstance(out[2], NoFaceError)
    assert out[3][1].subject_ids == ["a9"] and out[3][1].size == 20
    search.close()
    writer.close()


def test_a_batch_of_alike_requests_answers_as_one_by_one(tmp_path: Path) -> None:
    """Requests that differ only in k and the query take one decode for the batch; their answers equal those
    of the same requests decoded one by one (a mixed batch), each cut to its own k."""
    rng = np.random.default_rng(5)
    t = unit(rng, 40)
    url, writer = store_with(tmp_path, {"a": ("m", t)})
    stage = SearchStage(lambda: Gallery(open_store(url), GalleryIndex("cpu")), model=("m", D))
    alike = [encode_search("a", t[i], k) for i, k in ((3, 1), (8, 5), (11, 40), (2, 70))]
    mixed = [*alike, encode_search("b", t[0], 1)]  # another gallery: decoded one by one
    got, ref = run(stage, alike), run(stage, mixed)[:4]
    assert [o.subject_ids for o in got] == [o.subject_ids for o in ref]
    assert [len(o.subject_ids) for o in got] == [1, 5, 40, 40] and got[2].subject_ids[0] == "a11"
    for o, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(o.scores, r.scores)
    assert all(isinstance(o, GalleryNotFoundError) for o in run(stage, [encode_search("b", t[0], 1)] * 3))
    writer.delete_subject("a", "a3")  # a write acknowledged before the batch is in its answer
    assert run(stage, alike[:2])[0].subject_ids != ["a3"]
    stage.close()
    writer.close()
