"""1:N gallery at scale: engine search, CPU single-query search, applying one change, start-up load.

Synthetic unit-norm templates (``--dim``, 128 = sface), imported in bulk. Per gallery size S:

* ``engine_batch64_ms``: the engine's search stage (:class:`facegate.pipeline.search.SearchStage`) answering
  one batch of 64 queries, top-10: prepare (decode, per-batch catch-up: one ``max(seq)``), execute and
  deliver; ``engine_execute_ms``, execute alone (the device thread's share); and ``index_batch64_ms``, the
  index's search alone (fp16 on CUDA, float32 BLAS on the CPU);
* ``single_query_ms``: one query, top-10, on the index;
* ``apply_one_change_ms``: the index applying one enrolment committed by another connection (feed read
  included), and ``full_load_s``: start-up (one snapshot read + index load), from SQLite and, when a
  PostgreSQL server is available (``--postgres-url``, or the Debian binaries to start one), PostgreSQL;
* ``--index-only-sizes``: sizes measured on the index alone (no store), e.g. 10M on a GPU;
* ``--host-overhead S``: per-batch host overhead on a gallery of S subjects, where the matrix product is small:
  stage, prepare, execute, index and bare kernel medians over ``--probe-iters`` calls, of this tree and of
  ``--baseline`` (a git revision or a ``src`` folder), alternating in separate processes over ``--rounds``;
* CPU (NumPy) index: one query with 1 and 2 BLAS threads, as the index does it and as ``np.dot`` into a
  preallocated output + ``argpartition``, interleaved over ``--rounds`` with the load average per round;
* ``variants_batch64_ms`` (torch index): the 64-query search with the two-level top-k at several block sizes
  against one ``torch.topk`` over every score (``plain``), interleaved over ``--rounds``, with
  ``floor``, the bare matrix product + ``torch.topk`` on the device (no host copies), and whether every
  variant returned the same ids as ``plain``.

Medians over ``--iters`` calls after a warm-up. Writes one JSON named by environment::

    python benchmarks/gallery_search.py --device cpu --sizes 100000                      # 2-core CPU
    python benchmarks/gallery_search.py --device cuda --sizes 1000000 --index-only-sizes 10000000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.gallery import open_store
from facegate.gallery.index import GalleryIndex

try:
    from facegate.pipeline.search import Gallery, SearchStage, encode_search
except ImportError:  # a --baseline tree from before the engine's gallery and the request format moved there
    from facegate.gallery.query import encode_search
    from facegate.gallery.service import Gallery

    from facegate.pipeline.search import SearchStage

log = logging.getLogger("gallery_search")
ROOT = Path(__file__).resolve().parents[1]


def median_ms(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 3)


def variants(
    idx: GalleryIndex, q: np.ndarray, o: argparse.Namespace, engine: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Interleaved medians of the 64-query search per top-k variant (torch index only; see the docstring),
    and of ``engine`` (the search stage's batch) at the default block size."""
    from facegate.gallery.index import _TorchOps

    ops = idx._ops
    if not isinstance(ops, _TorchOps):  # NumPy: BLAS threads 1 against 2; np.dot into a preallocated output
        cpu: dict[str, list[float]] = {}
        mat, n = idx._entry("g").mat, idx.sizes()["g"]
        buf = np.empty(n, np.float32)

        def dot_out() -> np.ndarray:  # one query: (n, D) @ (D,) into buf, then the same argpartition top-k
            with ops._blas.limit(limits=ops.threads, user_api="blas"):  # type: ignore[union-attr]
                np.dot(mat[:n], q[0], out=buf)
            top = np.argpartition(buf, n - 10)[n - 10 :]
            return top[np.argsort(-buf[top], kind="stable")]

        ids = idx._entry("g").ids
        assert [ids[j] for j in dot_out()] == idx.search_raw("g", q[:1], 10)[0][0][0], "dot_out answers differ"
        loads = []
        for _ in range(o.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            for t in (1, 2):
                ops.threads = t  # type: ignore[union-attr]
                cpu.setdefault(f"single_threads{t}", []).append(
                    median_ms(lambda: idx.search_raw("g", q[:1], 10), o.iters)
                )
                cpu.setdefault(f"single_dot_out_threads{t}", []).append(median_ms(dot_out, o.iters))
                if n <= 100_000:  # 64 queries at 1M take seconds each on two cores
                    cpu.setdefault(f"batch64_threads{t}", []).append(
                        median_ms(lambda: idx.search_raw("g", q, 10), o.iters)
                    )
        ops.threads = max(1, (os.cpu_count() or 1) // 2)  # type: ignore[union-attr]
        return {"blas_threads_ms": {name: round(statistics.median(v), 3) for name, v in cpu.items()},
                "blas_threads_rounds_ms": cpu, "load1_per_round": loads}  # fmt: skip
    torch, mat, n = ops.torch, idx._entry("g").mat, idx.sizes()["g"]
    qd = torch.from_numpy(q).to(ops.device, ops.dtype)

    def floor() -> None:
        torch.topk(qd @ mat[:n].T, 10, dim=1)
        if ops.device.type == "cuda":
            torch.cuda.synchronize()

    def with_block(b: int | None) -> Callable[[], Any]:
        def fn() -> Any:
            ops.block = b
            return idx.search_raw("g", q, 10)

        return fn

    fns: dict[str, Callable[[], Any]] = {"floor": floor, "plain": with_block(0), "block_auto": with_block(None)}
    fns.update({f"block{b}": with_block(b) for b in (256, 1024, 4096)})
    if engine is not None:
        fns["engine"] = lambda: (setattr(ops, "block", None), engine())
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(o.rounds):
        for name, fn in fns.items():
            runs[name].append(median_ms(fn, o.iters))
    out: dict[str, Any] = {name: round(statistics.median(v), 3) for name, v in runs.items()}
    # fp16 scores tie often: the same scores, and the same ids up to the order of equal scores
    ref = with_block(0)()[0]
    same_scores, same_ids = {}, {}
    for name in [x for x in fns if x.startswith("block")]:
        got = fns[name]()[0]
        same_scores[name] = all(np.array_equal(a[1], b[1]) for a, b in zip(got, ref, strict=True))
        same_ids[name] = sum(len(set(a[0]) ^ set(b[0])) for a, b in zip(got, ref, strict=True)) // 2
    ops.block = None
    return {"variants_batch64_ms": out, "same_scores_as_plain": same_scores, "ids_differing_from_plain": same_ids,
            "plain_over_block_auto": round(out["plain"] / out["block_auto"], 2)}  # fmt: skip


def templates(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    t = rng.standard_normal((n, dim), dtype=np.float32)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    return t


@contextmanager
def postgres(url: str | None) -> Iterator[str | None]:
    """``url``, or a throw-away local server (run as the ``postgres`` user when root), or None."""
    if url:
        yield url
        return
    initdb = shutil.which("initdb") or "/usr/local/bin/initdb"
    pg_ctl = shutil.which("pg_ctl") or "/usr/local/bin/pg_ctl"
    if not (Path(initdb).exists() and Path(pg_ctl).exists()):
        yield None
        return
    base = Path(tempfile.mkdtemp(prefix="facegate-bench-pg-"))
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if prefix:
        shutil.chown(base, "postgres", "postgres")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = base / "data"
    subprocess.run([*prefix, initdb, "-D", str(data), "-A", "trust", "-U", "postgres"], check=True, capture_output=True)
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1"
    subprocess.run([*prefix, pg_ctl, "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "start"], check=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def build(url: str, size: int, dim: int, rng: np.random.Generator) -> float:
    """Fill gallery ``g`` with ``size`` subjects; returns subjects/s of the import."""
    store = open_store(url)
    store.create_gallery("g", "bench", dim)
    t0 = time.perf_counter()
    for s in range(0, size, 10_000):
        n = min(10_000, size - s)
        store.import_templates("g", [f"s{i}" for i in range(s, s + n)], templates(rng, n, dim), np.ones(n, np.float32))
    rate = size / (time.perf_counter() - t0)
    store.close()
    return rate


def store_rows(url: str, backend: str, size: int, o: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": backend, "gallery": size}
    row["import_subjects_per_s"] = round(build(url, size, o.dim, rng))
    t0 = time.perf_counter()
    gal = Gallery(open_store(url), GalleryIndex(o.device, o.dtype))
    row["full_load_s"] = round(time.perf_counter() - t0, 3)
    stage = SearchStage(lambda: gal, model=("bench", o.dim))
    q = templates(rng, 64, o.dim)
    payloads = [encode_search("g", x, 10) for x in q]
    batch = stage.prepare(payloads)

    def engine() -> Any:  # the whole stage: decode + catch-up (prepare), search (execute)
        return stage.execute(stage.prepare(payloads))

    row["engine_batch64_ms"] = median_ms(engine, o.iters)
    row["engine_execute_ms"] = median_ms(lambda: stage.execute(batch), o.iters)  # the device thread's part
    row["index_batch64_ms"] = median_ms(lambda: gal.index.search_raw("g", q, 10), o.iters)
    row["single_query_ms"] = median_ms(lambda: gal.index.search_raw("g", q[:1], 10), o.iters)
    row.update(variants(gal.index, q, o, engine))
    writer = open_store(url)
    one = np.ones(1, np.float32)
    costs = []
    for i in range(o.iters):
        writer.enrol_many("g", [(f"new{i}", templates(rng, 1, o.dim), one, None)])
        t0 = time.perf_counter()
        gal.sync()
        costs.append((time.perf_counter() - t0) * 1000)
    row["apply_one_change_ms"] = round(statistics.median(costs), 3)
    writer.close()
    gal.close()
    return row


def index_rows(size: int, o: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    idx = GalleryIndex(o.device, o.dtype)
    chunks = [templates(rng, min(1_000_000, size - s), o.dim) for s in range(0, size, 1_000_000)]
    idx.ensure_gallery("g", o.dim)
    entry_ids = [f"s{i}" for i in range(size)]
    idx.load_all({"g": (o.dim, entry_ids, np.concatenate(chunks))})
    del chunks
    q = templates(rng, 64, o.dim)
    return {
        "backend": "index_only",
        "gallery": size,
        "index_batch64_ms": median_ms(lambda: idx.search_raw("g", q, 10), o.iters),
        "single_query_ms": median_ms(lambda: idx.search_raw("g", q[:1], 10), o.iters),
        **variants(idx, q, o),
    }


def host_probe(size: int, o: argparse.Namespace) -> dict[str, Any]:
    """Medians of one 64-query batch, top-10, through each layer over a SQLite gallery of ``size`` subjects:
    the stage (prepare + execute + deliver, and each), the index's ``search_raw`` and the bare ``ops.topk``
    kernel. Uses only calls that older trees have too, so ``--baseline`` can run it on one."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="facegate-probe-") as tmp:
        url = str(Path(tmp) / "g.sqlite3")
        build(url, size, o.dim, rng)
        gal = Gallery(open_store(url), GalleryIndex(o.device, o.dtype))
        stage = SearchStage(lambda: gal, model=("bench", o.dim))
        q = templates(rng, 64, o.dim)
        payloads = [encode_search("g", x, 10) for x in q]
        prepared = stage.prepare(payloads)
        ops, mat = gal.index._ops, gal.index._entry("g").mat
        qn = q.astype(np.float32)
        fns = {
            "stage_ms": lambda: stage.execute(stage.prepare(payloads)),
            "prepare_ms": lambda: stage.prepare(payloads),
            "execute_ms": lambda: stage.execute(prepared),
            "index_ms": lambda: gal.index.search_raw("g", q, 10),
            "kernel_ms": lambda: ops.topk(qn, mat, size, 10),
        }
        row = {name: median_ms(fn, o.iters) for name, fn in fns.items()}
        gal.close()
    row["stage_over_index_ms"] = round(row["stage_ms"] - row["index_ms"], 3)
    row["index_over_kernel_ms"] = round(row["index_ms"] - row["kernel_ms"], 3)
    row["host_overhead_ms"] = round(row["stage_ms"] - row["kernel_ms"], 3)
    return row


def host_overhead(o: argparse.Namespace) -> dict[str, Any]:
    """:func:`host_probe` of this tree and of ``--baseline`` (a git revision or a ``src`` folder), each in its
    own process, alternating over ``--rounds``; per tree the per-round rows and the medians."""
    trees = {"this": str(ROOT / "src")}
    with tempfile.TemporaryDirectory(prefix="facegate-baseline-") as tmp:
        if o.baseline and Path(o.baseline).is_dir():
            trees["baseline"] = str(Path(o.baseline).resolve())
        elif o.baseline:
            archive = subprocess.run(["git", "archive", o.baseline, "src"], cwd=ROOT, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            trees["baseline"] = str(Path(tmp) / "src")
        argv = ["--device", o.device, "--dtype", o.dtype, "--dim", str(o.dim), "--iters", str(o.probe_iters)]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        loads = []
        for _ in range(o.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            for name, src in trees.items():
                cmd = [sys.executable, __file__, "--host-probe", str(o.host_overhead), *argv]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
    med = {
        name: {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]} for name, rows in runs.items()
    }
    return {"gallery": o.host_overhead, "load1_per_round": loads, "median": med, "rounds": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--sizes", default="100000", help="gallery sizes measured through the stores")
    p.add_argument("--index-only-sizes", default="", help="sizes measured on the index alone")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the top-k variants")
    p.add_argument("--dtype", default=None, help="index dtype (default: float16 on CUDA, float32 on the CPU)")
    p.add_argument("--postgres-url", default=None)
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--host-overhead", type=int, default=0, help="gallery size of the host-overhead rounds (0: off)")
    p.add_argument("--probe-iters", type=int, default=1000, help="calls per median in the host-overhead rounds")
    p.add_argument("--baseline", default=None, help="git revision or src folder for the host-overhead baseline")
    p.add_argument("--host-probe", type=int, default=0, help=argparse.SUPPRESS)  # one probe, JSON on stdout
    o = p.parse_args(argv)
    o.dtype = o.dtype or ("float16" if o.device.startswith("cuda") else "float32")
    if o.host_probe:
        print(json.dumps(host_probe(o.host_probe, o)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rng = np.random.default_rng(0)
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="facegate-bench-") as tmp,
        nullcontext(None) if o.no_postgres else postgres(o.postgres_url) as pg,
    ):
        for size in (int(x) for x in o.sizes.split(",") if x):
            rows.append(store_rows(str(Path(tmp) / f"g{size}.sqlite3"), "sqlite", size, o, rng))
            log.info("%s", rows[-1])
            if pg and not o.no_postgres:
                import psycopg

                db = f"bench_{size}"
                with psycopg.connect(pg, autocommit=True) as c:
                    c.execute(f"DROP DATABASE IF EXISTS {db}")
                    c.execute(f"CREATE DATABASE {db}")
                rows.append(store_rows(pg.rsplit("/", 1)[0] + "/" + db, "postgresql", size, o, rng))
                log.info("%s", rows[-1])
        for size in (int(x) for x in o.index_only_sizes.split(",") if x):
            rows.append(index_rows(size, o, rng))
            log.info("%s", rows[-1])
    overhead = host_overhead(o) if o.host_overhead else None
    env = env_record(
        device=o.device, dtype=o.dtype, dim=o.dim, sizes=o.sizes, index_only=o.index_only_sizes, iters=o.iters
    )
    machine = "gpu" if o.device.startswith("cuda") else f"cpu{os.cpu_count()}"
    out = o.out or ROOT / "benchmarks" / "results" / f"gallery_search-{machine}.json"
    write_json(
        out,
        {
            "benchmark": "gallery_search",
            "command": "python " + " ".join([Path(__file__).relative_to(ROOT).as_posix(), *(argv or sys.argv[1:])]),
            "rows": rows,
            "host_overhead": overhead,
            "env": env,
        },
    )
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
