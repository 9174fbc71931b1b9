"""Start ``facegate ray`` (a local Ray head on 127.0.0.1, one GPU's engine replicas) with ``facegate serve``'s flags.

``http_e2e.py`` starts it for the server names ``facegate_ray`` (1 ingress replica) and ``facegate_ray_wN``
(N ingress replicas), so Ray Serve and ``facegate serve`` are measured in one run, on the same photos and
load generator. The flags become the ``FACEGATE_*`` settings every replica reads; SIGTERM stops the
application and the Ray node.

GPU (one H200: ``facegate serve`` with no flags against Ray with 8 ingress replicas, compare at concurrency
100 and 256 with LFW photos; scripts/gpu-ray.sh runs it on the lent machine):
  python benchmarks/http_e2e.py --device cuda --precision fp16 --compile graphs --images .lfwT/lfw-deepfunneled \
      --servers facegate_default,facegate_ray_w8 --kinds compare --concurrency 100,256 --duration 4 \
      --budget-s 300 --out benchmarks/results/http_e2e-h200-ray.json

CPU (the 2-core box; the tiny random-weight recognizer and aligned crops, so that the serving overheads show
beside the model's compute; the same command on main's code and on this one gives the before/after ratios):
  python benchmarks/http_e2e.py --device cpu --servers facegate_default,facegate_ray \
      --kinds embed_aligned,compare --concurrency 32 --duration 5 --rounds 3 --warmup 2 --n-images 64 \
      --server-env OMP_WAIT_POLICY=PASSIVE --server-env FACEGATE_MODEL=sface-tiny \
      --out benchmarks/results/http_e2e-cpu2-ray-tiny.json

Two trees in one run (before/after, same load): ``facegate_ray_w01`` is a second 1-ingress Ray server, and
``FACEGATE_BENCH_WRAP`` starts it over another checkout's ``src`` (here an export of main's at /tmp/raybefore):
  FACEGATE_BENCH_WRAP="facegate_ray_w01=env PYTHONPATH=/tmp/raybefore/src" python benchmarks/http_e2e.py \
      --device cpu --servers facegate_default,facegate_ray_w01,facegate_ray --kinds compare --concurrency 1,4,16 \
      --duration 4 --rounds 2 --warmup 1 --n-images 64 --server-env OMP_WAIT_POLICY=PASSIVE \
      --server-env FACEGATE_MODEL=sface-tiny --out benchmarks/results/http_e2e-cpu2-ray-local.json
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--compile", default=None)
    ap.add_argument("--max-batch-size", type=int, default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--engine-replicas", type=int, default=1)
    o = ap.parse_args(argv)
    env = {"FACEGATE_DEVICE": o.device, "FACEGATE_PRECISION": o.precision, "FACEGATE_COMPILE": o.compile,
           "FACEGATE_ENGINE__MAX_BATCH_SIZE": o.max_batch_size, "FACEGATE_DATA_DIR": o.data_dir}  # fmt: skip
    for k, v in env.items():
        if v is not None:
            os.environ.setdefault(k, str(v))  # a server variant's own environment wins
    from facegate.cli import main as facegate_main

    sys.argv = ["facegate", "ray", "--host", "127.0.0.1", "--port", str(o.port),
                "--ingress-replicas", str(o.ingress_replicas), "--engine-replicas", str(o.engine_replicas)]  # fmt: skip
    facegate_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
