"""FP16 (or BF16) versus FP32 parity of the whole pipeline on LFW.

Two steps, because the GPU machine receives at most 64 MiB per call and the 7,701 LFW pair images
are 65 MB: ``embed`` runs on the device over a part of the images and saves, for both precisions in
the same process, each image's embedding, quality and detector score; ``report`` joins the parts
and computes LFW 10-fold accuracy for both precisions and its delta, the mean (and min) embedding
cosine between them, the Pearson r of quality scores, and the share of identical verdicts at the
operating threshold (the model's calibrated FMR 1e-3 point), and of quality verdicts at the quality gate.

  # on the device, once per part (images under DIR keep LFW's Name/Name_NNNN.jpg layout):
  python benchmarks/parity_lfw.py embed --images DIR --part 0 --parts 2 --precision fp16 --out part0.npz
  # on the CPU (bf16, on a CPU with AMX): the same with --device cpu --precision bf16 --compile auto
  # here:
  python benchmarks/parity_lfw.py report --root $FACEGATE_LFW_ROOT --parts part0.npz part1.npz \
      --out benchmarks/results/parity_lfw-h200.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.config import Settings
from facegate.eval.lfw import embed_lfw, evaluate_scores, pair_images, pair_scores, read_pairs
from facegate.models.registry import get_spec
from facegate.pipeline.pipeline import FacePipeline

log = logging.getLogger("parity_lfw")


def split(paths: list[str], part: int, parts: int) -> list[str]:
    """Deterministic split of the sorted image list into ``parts`` contiguous parts."""
    paths = sorted(paths)
    n = len(paths)
    return paths[part * n // parts : (part + 1) * n // parts]


def cmd_embed(a: argparse.Namespace) -> None:
    base = Path(a.images)
    paths = sorted(str(p.relative_to(base)) for p in base.rglob("*.jpg"))
    if a.parts > 1:
        paths = split(paths, a.part, a.parts)
    root = base.parent if base.name == "lfw-deepfunneled" else base
    if base.name != "lfw-deepfunneled":
        raise SystemExit("--images must be a folder named lfw-deepfunneled")
    out: dict[str, np.ndarray] = {"paths": np.array(paths)}
    for prec in ("fp32", a.precision):
        s = Settings(device=a.device, precision=prec, compile=a.compile if prec != "fp32" else "off")
        p = FacePipeline.from_settings(s)
        p.warmup()
        t0 = time.perf_counter()
        emb = embed_lfw(p, root, paths, batch_size=a.batch)
        secs = time.perf_counter() - t0
        out[f"emb_{prec}"], out[f"q_{prec}"], out[f"det_{prec}"] = emb["embeddings"], emb["quality"], emb["det_score"]
        out[f"seconds_{prec}"] = np.array(secs)
        out["threshold"] = np.array(p.operating.match_threshold)
        log.info("%s: %d images in %.1f s (%.0f img/s)", prec, len(paths), secs, len(paths) / secs)
    out["env"] = np.array(json.dumps(env_record(**{k: str(v) for k, v in vars(a).items() if k != "func"})))
    np.savez_compressed(a.out, **out)


def cmd_report(a: argparse.Namespace) -> None:
    parts = [dict(np.load(p)) for p in a.parts]  # materialise: indexing an NpzFile re-reads the array
    prec = a.precision
    emb32, emblo, q32, qlo = {}, {}, {}, {}
    for z in parts:
        for i, k in enumerate(z["paths"]):
            emb32[str(k)], emblo[str(k)] = z["emb_fp32"][i], z[f"emb_{prec}"][i]
            q32[str(k)], qlo[str(k)] = float(z["q_fp32"][i]), float(z[f"q_{prec}"][i])
    thr = a.threshold if a.threshold is not None else get_spec("sface").thresholds.match
    gate = get_spec("sface").thresholds.quality
    pairs = read_pairs(a.root)
    needed = pair_images(pairs)
    missing = [k for k in needed if k not in emb32]
    if missing:
        raise SystemExit(f"{len(missing)} pair images missing from the parts, e.g. {missing[:3]}")
    ok = [k for k in needed if not (np.isnan(emb32[k]).any() or np.isnan(emblo[k]).any())]
    cos = np.array([float(np.dot(emb32[k], emblo[k])) for k in ok])
    sc32, sclo = pair_scores(pairs, emb32), pair_scores(pairs, emblo)
    r32, rlo = evaluate_scores(sc32, pairs), evaluate_scores(sclo, pairs)
    res = {
        "pairs": len(pairs),
        "images": len(needed),
        "images_compared": len(ok),
        "operating_threshold": thr,
        "accuracy_fp32": r32["accuracy_mean"],
        "accuracy_std_fp32": r32["accuracy_std"],
        f"accuracy_{prec}": rlo["accuracy_mean"],
        f"accuracy_std_{prec}": rlo["accuracy_std"],
        "accuracy_delta": rlo["accuracy_mean"] - r32["accuracy_mean"],
        "embedding_cosine_mean": float(cos.mean()),
        "embedding_cosine_min": float(cos.min()),
        "quality_pearson_r": float(np.corrcoef([q32[k] for k in ok], [qlo[k] for k in ok])[0, 1]),
        "quality_max_abs_diff": float(max(abs(q32[k] - qlo[k]) for k in ok)),
        "identical_quality_verdicts": float(np.mean([(q32[k] >= gate) == (qlo[k] >= gate) for k in ok])),
        "quality_gate": gate,
        "identical_verdicts": float(np.mean((sc32 >= thr) == (sclo >= thr))),
        "tar_at_fmr1e-3_fp32": r32["tar_at_fmr"],
        f"tar_at_fmr1e-3_{prec}": rlo["tar_at_fmr"],
        "seconds": {f"part{i}_{k}": float(z[f"seconds_{k}"]) for i, z in enumerate(parts) for k in ("fp32", prec)},
        "device_env": [json.loads(str(z["env"])) for z in parts],
    }
    log.info("%s", json.dumps({k: v for k, v in res.items() if k != "device_env"}, indent=1))
    write_json(a.out, {"env": env_record(step="report", parts=[str(p) for p in a.parts]), **res})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(required=True)
    e = sub.add_parser("embed")
    e.add_argument("--images", type=Path, required=True)
    e.add_argument("--part", type=int, default=0)
    e.add_argument("--parts", type=int, default=1)
    e.add_argument("--device", default="cuda")
    e.add_argument("--precision", default="fp16")
    e.add_argument("--compile", default="off")
    e.add_argument("--batch", type=int, default=64)
    e.add_argument("--out", type=Path, required=True)
    e.set_defaults(func=cmd_embed)
    r = sub.add_parser("report")
    r.add_argument("--root", type=Path, required=True)
    r.add_argument("--parts", type=Path, nargs="+", required=True)
    r.add_argument("--precision", default="fp16")
    r.add_argument("--threshold", type=float, default=None, help="operating threshold (default: the registry's)")
    r.add_argument("--out", type=Path, default=Path("benchmarks/results/parity_lfw-h200.json"))
    r.set_defaults(func=cmd_report)
    a = ap.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
