"""Two per-request serialisation costs on the CPU, old way against new, in one run.

* ``embedding_json``: an embedding's 128 floats rounded to 7 decimals for the JSON answer, a Python loop of
  ``round(float(v), 7)`` against numpy's ``np.round(...).tolist()``; and how many of the rounded values differ
  over ``--vectors`` random unit embeddings.
* ``embed_result_pickle``: a batch answer of 64 embed results as the engine's sender pickles it
  (``ForkingPickler.dumps`` of ``("batch", [("ok", rid, result), ...])``), each result three strided views
  against one :class:`~facegate.pipeline.results.EmbedOut` block; and unpickling.

python benchmarks/micro_serialise.py --out benchmarks/results/micro_serialise_cpu.json
"""

from __future__ import annotations

import argparse
import pickle
import sys
import timeit
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.pipeline.results import EmbedOut


def per_call_us(fn: object, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vectors", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/micro_serialise_cpu.json"))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    e = rng.standard_normal(128).astype(np.float32)
    differ = 0
    for _ in range(a.vectors):
        v = rng.standard_normal(128).astype(np.float32)
        v /= np.linalg.norm(v)
        old = [round(float(x), 7) for x in v]
        new = np.round(v.astype(np.float64), 7).tolist()
        differ += sum(x != y for x, y in zip(old, new, strict=True))
    emb = {
        "loop_us": per_call_us(lambda: [round(float(x), 7) for x in e], 2000),
        "numpy_us": per_call_us(lambda: np.round(e.astype(np.float64), 7).tolist(), 2000),
        "values_compared": a.vectors * 128,
        "values_differing": differ,
    }
    out = rng.standard_normal((64, 130)).astype(np.float32)
    views = ("batch", [("ok", i, (out[i : i + 1, :128], out[i : i + 1, 128], out[i : i + 1, 129])) for i in range(64)])
    blocks = ("batch", [("ok", i, EmbedOut(out[i : i + 1])) for i in range(64)])
    pk = {}
    for name, msg in (("three_views", views), ("embed_out", blocks)):
        data = bytes(ForkingPickler.dumps(msg))
        pk[name] = {
            "dumps_us_per_item": per_call_us(lambda m=msg: ForkingPickler.dumps(m), 300) / 64,
            "loads_us_per_item": per_call_us(lambda d=data: pickle.loads(d), 300) / 64,
            "bytes_per_item": len(data) / 64,
        }
    env = env_record(**{k: str(v) for k, v in vars(a).items()})
    write_json(a.out, {"env": env, "embedding_json": emb, "embed_result_pickle": pk})
    print(emb, pk)  # CLI output


if __name__ == "__main__":
    main()
