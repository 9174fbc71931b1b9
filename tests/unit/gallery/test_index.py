"""GalleryIndex: exact top-k against a NumPy brute force, incremental updates, rebuild, errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from facegate.errors import DimensionMismatchError, GalleryNotFoundError, InvalidParameterError
from facegate.gallery.index import GalleryIndex
from store_helpers import index_templates


def unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force(T: np.ndarray, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference in float64: ``(Q, k)`` top indices, their scores, and the full ``(Q, S)`` score matrix."""
    Qn = Q.astype(np.float64) / np.linalg.norm(Q.astype(np.float64), axis=1, keepdims=True)
    S = Qn @ T.astype(np.float64).T
    idx = np.argsort(-S, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(S, idx, axis=1), S


def top(idx: GalleryIndex, gallery: str, queries: np.ndarray, k: int) -> list[tuple[list[str], np.ndarray]]:
    """Per query ``(subject_ids, scores)`` of :meth:`GalleryIndex.search_raw`."""
    return idx.search_raw(gallery, queries, k)[0]


def assert_matches_reference(hits, ids: list[str], T: np.ndarray, Q: np.ndarray, k: int, atol: float) -> None:
    """Same ids in the same order and the same scores as the brute force (ties within ``atol`` may swap)."""
    ref_idx, ref_s, full = brute_force(T, Q, k)
    pos = {s: i for i, s in enumerate(ids)}
    assert len(hits) == len(Q)
    n_swapped = 0
    for qi, (row, got_s) in enumerate(hits):
        assert len(row) == len(got_s) == min(k, len(ids))
        np.testing.assert_allclose(got_s, ref_s[qi], atol=atol)
        assert np.all(np.diff(got_s) <= 0), "hits must be sorted by descending score"
        for r, sid in enumerate(row):
            if sid != ids[ref_idx[qi, r]]:
                # allowed only for a near-tie: the returned subject's true score equals the rank's score
                assert abs(full[qi, pos[sid]] - ref_s[qi, r]) <= 2 * atol, (qi, r, sid)
                n_swapped += 1
    assert n_swapped <= max(1, len(hits) * k // 100), n_swapped


def test_search_equals_numpy_brute_force_10k() -> None:
    rng = np.random.default_rng(0)
    S, D, k = 10_000, 128, 10
    T = unit(rng, S, D)
    ids = [f"s{i}" for i in range(S)]
    idx = GalleryIndex("cpu")
    idx.load_all({"g": (D, ids, T)})
    # queries: noisy copies of known subjects (realistic: one clear winner) plus pure noise
    Q = np.vstack([T[:32] + 0.3 * unit(rng, 32, D), unit(rng, 32, D)]).astype(np.float32)
    hits = top(idx, "g", Q, k)
    assert_matches_reference(hits, ids, T, Q, k, atol=2e-6)
    assert [row[0][0] for row in hits[:32]] == ids[:32]
    # a single query (matrix-vector path) agrees with the batch (matrix-matrix) up to float32 rounding
    single = top(idx, "g", Q[:1], k)[0]
    assert single[0] == hits[0][0]
    np.testing.assert_allclose(single[1], hits[0][1], atol=1e-6)


def test_small_and_empty_galleries() -> None:
    rng = np.random.default_rng(1)
    idx = GalleryIndex()
    idx.ensure_gallery("e", 8)
    assert idx.search_raw("e", unit(rng, 3, 8), 5)[1] == 0
    assert [ids for ids, _ in top(idx, "e", unit(rng, 3, 8), 5)] == [[], [], []]
    T = unit(rng, 3, 8)
    idx.load_all({"g": (8, ["a", "b", "c"], T)})
    hits = top(idx, "g", T, 10)  # k > S: clamps to S
    assert [len(r) for r, _ in hits] == [3, 3, 3]
    assert [r[0] for r, _ in hits] == ["a", "b", "c"]
    assert all(s[0] == pytest.approx(1.0, abs=1e-6) for _, s in hits)
    # queries are normalised by the index: scale does not change scores
    np.testing.assert_allclose(top(idx, "g", 7 * T[:1], 3)[0][1], hits[0][1], atol=1e-6)


def test_search_errors() -> None:
    rng = np.random.default_rng(2)
    idx = GalleryIndex()
    idx.load_all({"g": (8, ["a"], unit(rng, 1, 8))})
    with pytest.raises(GalleryNotFoundError):
        idx.search_raw("nope", unit(rng, 1, 8), 1)
    with pytest.raises(DimensionMismatchError):
        idx.search_raw("g", unit(rng, 1, 9), 1)
    for bad_k in (0, -1, 1.5, True):
        with pytest.raises(InvalidParameterError):
            idx.search_raw("g", unit(rng, 1, 8), bad_k)  # type: ignore[arg-type]
    for bad_q in (unit(rng, 1, 8)[0], np.zeros((0, 8), np.float32), np.full((1, 8), np.inf, np.float32)):
        with pytest.raises(InvalidParameterError):
            idx.search_raw("g", bad_q, 1)
    with pytest.raises(DimensionMismatchError):
        idx.upsert("g", "b", unit(rng, 1, 9)[0])
    with pytest.raises(DimensionMismatchError):
        idx.load_all({"h": (8, ["a", "b"], unit(rng, 3, 8))})
    with pytest.raises(InvalidParameterError):
        GalleryIndex(dtype=torch.int8)


def test_incremental_updates_match_a_reference_dict() -> None:
    """Random upserts (new and overwrite) and removes; grows past capacity and shrinks back."""
    rng = np.random.default_rng(3)
    D = 16
    idx = GalleryIndex()
    idx.ensure_gallery("g", D)
    ref: dict[str, np.ndarray] = {}
    capacities: list[int] = []
    for step in range(1500):
        phase_grow = step < 900
        r = rng.random()
        if ref and r < (0.15 if phase_grow else 0.8):
            sid = sorted(ref)[int(rng.integers(len(ref)))]
            assert idx.remove("g", sid)
            del ref[sid]
        elif ref and r < 0.35:
            sid = sorted(ref)[int(rng.integers(len(ref)))]
            ref[sid] = unit(rng, 1, D)[0]
            idx.upsert("g", sid, ref[sid])
        else:
            sid = f"s{step}"
            ref[sid] = unit(rng, 1, D)[0]
            idx.upsert("g", sid, ref[sid])
        capacities.append(idx._entries["g"].mat.shape[0])
        if step % 100 == 99 or step == 1499:
            ids, T = index_templates(idx, "g")
            assert ids == sorted(ref)
            if ids:
                np.testing.assert_array_equal(T, np.stack([ref[s] for s in ids]))
                Q = unit(rng, 4, D)
                assert_matches_reference(top(idx, "g", Q, 5), ids, T, Q, 5, atol=2e-6)
    assert max(capacities) >= 256 and capacities[-1] < max(capacities)  # grew several times, then shrank
    assert not idx.remove("g", "never-there")
    assert idx.sizes() == {"g": len(ref)}


def test_load_all_replaces_everything_and_drop() -> None:
    rng = np.random.default_rng(4)
    idx = GalleryIndex()
    idx.load_all({"stale": (4, ["x"], unit(rng, 1, 4))})
    idx.load_all({"a": (4, ["p", "q"], unit(rng, 2, 4)), "b": (8, [], np.zeros((0, 8), np.float32))})
    assert idx.sizes() == {"a": 2, "b": 0}
    assert idx.entry("stale") is None
    idx.load_all({"a": (4, ["r"], unit(rng, 1, 4)), "b": (8, [], np.zeros((0, 8), np.float32))})
    assert index_templates(idx, "a")[0] == ["r"] and index_templates(idx, "a")[1].shape == (1, 4)
    idx.ensure_gallery("a", 4)  # present with that dim: kept
    assert index_templates(idx, "a")[0] == ["r"]
    idx.ensure_gallery("a", 6)  # another dim (a re-created gallery): a fresh, empty one
    assert index_templates(idx, "a")[1].shape == (0, 6)
    idx.drop("a")
    idx.drop("a")
    assert idx.sizes() == {"b": 0}


def test_bfloat16_index_ranks_well_separated_data() -> None:
    rng = np.random.default_rng(5)
    T = unit(rng, 500, 64)
    ids = [str(i) for i in range(500)]
    idx = GalleryIndex("cpu", torch.bfloat16)
    idx.load_all({"g": (64, ids, T)})
    hits = top(idx, "g", T[:20] + 0.1 * unit(rng, 20, 64), 1)
    assert [r[0] for r, _ in hits] == ids[:20]


def test_concurrent_search_and_updates() -> None:
    """Searches running while another thread upserts/removes never fail nor see torn state."""
    rng = np.random.default_rng(6)
    D = 32
    idx = GalleryIndex()
    base = unit(rng, 300, D)
    idx.load_all({"g": (D, [f"b{i}" for i in range(300)], base)})
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        wr = np.random.default_rng(7)
        i = 0
        while not stop.is_set():
            idx.upsert("g", f"w{i}", unit(wr, 1, D)[0])
            if i >= 5:
                idx.remove("g", f"w{i - 5}")
            i += 1

    def reader() -> None:
        try:
            for _ in range(200):
                # base[0] is never touched by the writer: it must always be found with score 1
                row, scores = top(idx, "g", base[:1], 3)[0]
                assert row[0] == "b0" and scores[0] == pytest.approx(1.0, abs=1e-5)
                assert scores[0] >= scores[1] >= scores[2]
        except BaseException as exc:
            errors.append(exc)

    w = threading.Thread(target=writer)
    readers = [threading.Thread(target=reader) for _ in range(2)]
    w.start()
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    stop.set()
    w.join()
    assert errors == []
    ids, T = index_templates(idx, "g")
    assert {f"b{i}" for i in range(300)} <= set(ids) and len(ids) <= 305 and len(set(ids)) == len(ids)
    np.testing.assert_array_equal(T[[ids.index(f"b{i}") for i in range(300)]], base)  # untouched rows intact


@pytest.mark.gpu
def test_cuda_search_matches_cpu() -> None:
    rng = np.random.default_rng(8)
    T = unit(rng, 100_000, 512)  # above BLOCK_MIN: the two-level top-k
    ids = [str(i) for i in range(len(T))]
    Q = unit(rng, 64, 512)
    cpu, gpu = GalleryIndex("cpu"), GalleryIndex("cuda")
    for idx in (cpu, gpu):
        idx.load_all({"g": (512, ids, T)})
    assert_matches_reference(top(gpu, "g", Q, 10), ids, T, Q, 10, atol=1e-4)
    assert_matches_reference(top(cpu, "g", Q, 10), ids, T, Q, 10, atol=2e-6)
    half = GalleryIndex("cuda", torch.float16)
    half.load_all({"g": (512, ids, T)})
    top1 = [r[0] for r, _ in top(half, "g", T[:64], 1)]
    assert top1 == ids[:64]


@pytest.mark.parametrize("dtype", ["float32", "float64", torch.float32])
def test_cpu_full_precision_index_is_numpy(dtype: object) -> None:
    """On the CPU in float32/float64 the index keeps NumPy arrays (front-ends search without torch)."""
    idx = GalleryIndex("cpu", dtype)
    idx.ensure_gallery("g", 8)
    assert isinstance(idx._entry("g").mat, np.ndarray) and idx.device == "cpu"
    assert idx._entry("g").mat.dtype == np.dtype(str(dtype).removeprefix("torch."))
    half = GalleryIndex("cpu", "bfloat16")
    half.ensure_gallery("g", 8)
    assert isinstance(half._entry("g").mat, torch.Tensor)
    with pytest.raises(InvalidParameterError):
        GalleryIndex("gpu")  # not a device torch knows


@pytest.mark.parametrize("k", [1, 7, 400])
def test_numpy_and_torch_backends_agree(k: int) -> None:
    """The same upserts, removes and searches through both backends (torch forced on the CPU)."""
    from facegate.gallery.index import _TorchOps

    rng = np.random.default_rng(9)
    T = unit(rng, 300, 32)
    ids = [f"s{i}" for i in range(300)]
    a, b = GalleryIndex("cpu"), GalleryIndex("cpu")
    b._ops = _TorchOps("cpu", "float32")
    for idx in (a, b):
        idx.load_all({"g": (32, ids, T)})
        for i in range(0, 300, 7):
            assert idx.remove("g", f"s{i}")
        idx.upsert("g", "new", T[0])
    Q = unit(rng, 5, 32) * 3.0  # any non-zero scale
    ha, hb = top(a, "g", Q, k), top(b, "g", Q, k)
    assert [r for r, _ in ha] == [r for r, _ in hb]
    np.testing.assert_allclose([s for _, s in ha], [s for _, s in hb], atol=1e-6)
    assert index_templates(a, "g")[0] == index_templates(b, "g")[0]
    np.testing.assert_array_equal(index_templates(a, "g")[1], index_templates(b, "g")[1])
    assert len(ha[0][0]) == min(k, 300 - 43 + 1)


def test_torch_index_grown_in_inference_mode_takes_later_writes() -> None:
    """A search thread may apply changes (and grow the matrix) inside inference mode; the feed thread's
    later in-place writes outside it must still work."""
    import torch

    idx = GalleryIndex("cpu", "float16")  # the torch backend, as on CUDA
    idx.ensure_gallery("g", 8)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((200, 8)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    with torch.inference_mode():
        for i in range(100):  # grows past the first buffer
            idx.upsert("g", f"s{i}", vecs[i])
    for i in range(100, 200):
        idx.upsert("g", f"s{i}", vecs[i])
    assert idx.remove("g", "s3")
    assert top(idx, "g", vecs[[150]], 1)[0][0][0] == "s150"


@pytest.mark.parametrize(("n", "k", "block"), [(70_001, 10, 1024), (70_001, 100, 4096), (80_000, 1, None)])
def test_two_level_topk_equals_plain_topk(n: int, k: int, block: int | None) -> None:
    """The block-max top-k of a large gallery returns exactly what one ``torch.topk`` over all scores does,
    also with a partial last block and with k above the number of blocks."""
    from facegate.gallery.index import BLOCK_MIN, _TorchOps

    assert n > BLOCK_MIN
    rng = np.random.default_rng(10)
    T = unit(rng, n, 16)
    ids = [f"s{i}" for i in range(n)]
    two, plain = GalleryIndex("cpu"), GalleryIndex("cpu")
    two._ops, plain._ops = _TorchOps("cpu", "float32", block), _TorchOps("cpu", "float32", 0)
    for idx in (two, plain):
        idx.load_all({"g": (16, ids, T)})
        idx.remove("g", "s5")  # the last row moves into the hole
    Q = np.vstack([T[[n - 1, 7]], unit(rng, 6, 16)])
    (ha, na), (hb, nb) = two.search_raw("g", Q, k), plain.search_raw("g", Q, k)
    assert na == nb == n - 1
    for (ia, va), (ib, vb) in zip(ha, hb, strict=True):
        assert ia == ib
        np.testing.assert_array_equal(va, vb)
    assert ha[0][0][0] == f"s{n - 1}" and ha[1][0][0] == "s7"
    assert_matches_reference(top(two, "g", Q, k), *index_templates(two, "g"), Q, k, atol=2e-6)


def test_torch_answers_survive_the_next_search_and_other_threads() -> None:
    """The torch backend reuses host buffers per thread: an answer must not change when the same thread, or
    another one, searches again with another batch size."""
    import threading

    from facegate.gallery.index import _TorchOps

    rng = np.random.default_rng(11)
    T = unit(rng, 500, 16)
    ids = [f"s{i}" for i in range(500)]
    idx = GalleryIndex("cpu")
    idx._ops = _TorchOps("cpu", "float32")
    idx.load_all({"g": (16, ids, T)})
    first, _ = idx.search_raw("g", T[:3], 4)
    kept = [(list(i), s.copy()) for i, s in first]
    for q in (T[10:74], T[5:6]):
        idx.search_raw("g", q, 9)
    tops: dict[int, list[str]] = {}

    def search(j: int) -> None:
        for _ in range(20):
            hits, _ = idx.search_raw("g", T[j : j + 1 + j % 3], 2)
            tops[j] = [h[0][0] for h in hits]

    threads = [threading.Thread(target=search, args=(j,)) for j in range(20, 26)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tops == {j: [f"s{j + i}" for i in range(1 + j % 3)] for j in range(20, 26)}
    for (a, b), (c, d) in zip(first, kept, strict=True):
        assert a == c and np.array_equal(b, d)
    assert [i[0] for i, _ in first] == ["s0", "s1", "s2"]
