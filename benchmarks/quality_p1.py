"""Protocol P1 on full LFW with every baseline, the reasons' limits, the gates and the reliability, in one run.

The features come from one pass of ``benchmarks/quality_p1_features.py`` over every photo pairs.txt uses (on the
GPU machine: two calls, one per half of the photos); the statistics run here on the CPU:

    python benchmarks/quality_p1.py --features out/p1_half1.npz out/p1_half2.npz \\
        --reliability-out src/facegate/models/heads/sface_reliability_v1.json

Writes ``benchmarks/results/quality_p1-h200.json`` (the features' machine) and the EDC plot ``docs/quality_edc.png``.
``--features`` takes files or folders of them; ``--lfw`` (or ``--root``) defaults to ``$FACEGATE_LFW_ROOT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record
from facegate.models.registry import get_spec
from quality_eval import eval_quality


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", nargs="+", required=True)
    ap.add_argument(
        "--lfw", "--root", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw"))
    )
    ap.add_argument("--match-threshold", type=float, default=get_spec("sface").thresholds.match)
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_p1-h200.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/quality_edc.png"))
    ap.add_argument("--reliability-out", type=Path, default=None)
    a = ap.parse_args()
    command = "python benchmarks/quality_p1.py " + " ".join(sys.argv[1:])
    rep = eval_quality(
        a.features,
        a.lfw,
        out=a.out,
        plot=a.plot,
        match_threshold=a.match_threshold,
        command=command,
        draws=a.draws,
        reliability_out=a.reliability_out,
    )
    files = [f for p in map(Path, a.features) for f in (sorted(p.glob("*.npz")) if p.is_dir() else [p])]
    seconds = [float(np.load(f)["seconds"]) for f in files]
    rep["env"] = env_record(features=a.features, draws=a.draws, feature_seconds=seconds)
    rep["feature_command"] = (
        "python3 benchmarks/quality_p1_features.py --lfw lfw --device cuda --batch 128 --max-seconds 140 "
        "--out $OUT/p1_halfN.npz  (nvidia-h200, one call per half of the pairs.txt photos); crop statistics then "
        "recomputed on the CPU: python benchmarks/quality_p1_restat.py out/p1_halfN.npz out/p1_halfN_r.npz"
    )
    a.out.write_text(json.dumps(rep, indent=1, default=float))
    p1 = rep["p1"]["all"]
    for m, row in p1.items():
        d = row.get("pauc20_minus_feature_norm", {})
        print(f"{m:18s} pAUC@20 {row['raw']['pauc20']:.4f}  diff {d.get('value', 0):+.4f}  CI {d.get('ci95', '')}")


if __name__ == "__main__":
    main()
