"""CPU serving end to end: ``facegate serve --device cpu`` of a baseline commit against this checkout, one run.

Servers, each a subprocess on a free loopback port (``http_e2e.Server``), SIGSTOPped while another is measured:

* ``baseline``: ``facegate serve --device cpu`` from the source tree of ``--baseline-ref`` (``git archive`` of
  its ``src/`` into a temporary folder, run with the same virtualenv), i.e. the CPU default before the change;
* ``default``: ``facegate serve --device cpu`` from this checkout (its CPU default);
* ``--variant NAME=SPEC``: this checkout with extra ``facegate serve`` flags and ``KEY=VALUE`` environment
  entries, e.g. ``w2="--workers 2"``, ``wait0="--max-wait-ms 0"`` or ``t1="FACEGATE_CPU_THREADS=1"``
  (repeatable): the other CPU serving knobs. A variant named ``baseline…`` runs the baseline's source.

Load: ``compare`` requests (two LFW photos each, spread over ``--images``) from facegate's closed-loop load
generator (`loadgen.py`, raw client, in this process), at each ``--concurrency``; per round every
(concurrency, server) point runs ``--warmup`` unrecorded then ``--duration`` measured seconds, servers
interleaved so that other tenants' load hits them alike. ok req/s is the median over ``--rounds``; the ratio
table divides each server's by the baseline's at the same concurrency. Bounded by ``--budget-s``.

  python benchmarks/cpu_e2e.py --concurrency 1,4,16 --duration 5 --rounds 2 \\
      --variant w2="--workers 2"

writes ``benchmarks/results/cpu_e2e-cpu<cores>.json``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from http_e2e import Server, free_port
from loadgen import collect_images, run_http_bench

log = logging.getLogger("cpu_e2e")
ROOT = Path(__file__).resolve().parent.parent


def export_source(ref: str, dest: Path) -> Path:
    """``src/`` of git ``ref`` unpacked under ``dest``; returns the folder to put on ``PYTHONPATH``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "src"


def server(name: str, src: Path, flags: list[str], workdir: Path) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "facegate", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--device", "cpu", "--data-dir", str(workdir / f"data_{name}"), *flags]
    s = Server(name=name, argv=argv, port=port, log_path=workdir / f"{name}.log")
    s.env = {"PYTHONPATH": str(src), "FACEGATE_LOG_LEVEL": "INFO"}
    return s


def plan_line(s: Server) -> list[str]:
    """The start-up lines that say how the server runs its models (from its log)."""
    keys = ("ONNX Runtime", "pipeline:", "intra-op threads", "plan")
    return [ln.strip()[-240:] for ln in s.log_tail(200_000).splitlines() if any(k in ln for k in keys)][:8]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-ref", default="main", help="git ref whose CPU default is the baseline")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", help="extra server (repeatable)")
    p.add_argument("--images", type=Path, default=None, help="LFW-layout folder (default $FACEGATE_LFW_ROOT/...)")
    p.add_argument("--n-images", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.5, help="unrecorded seconds before each measured point")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=240.0, help="start no point ending past this")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/cpu_e2e-cpu<cores>.json")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = a.out or ROOT / f"benchmarks/results/cpu_e2e-cpu{os.cpu_count()}.json"
    root = a.images or Path(os.environ.get("FACEGATE_LFW_ROOT", "/nonexistent")) / "lfw-deepfunneled"
    files = collect_images([root])
    photos = [f.read_bytes() for f in files[:: max(1, len(files) // a.n_images)][: a.n_images]]
    conc = [int(c) for c in a.concurrency.split(",")]
    t0 = time.perf_counter()
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="cpu_e2e_") as tmp:
        work = Path(tmp)
        base_src = export_source(a.baseline_ref, work / "baseline")
        here = ROOT / "src"
        servers = [server("baseline", base_src, [], work), server("default", here, [], work)]
        for v in a.variant:
            name, _, spec = v.partition("=")
            tokens = shlex.split(spec)
            env = dict(t.split("=", 1) for t in tokens if "=" in t and not t.startswith("-"))
            src = base_src if name.startswith("baseline") else here
            s = server(name, src, [t for t in tokens if t.startswith("-") or "=" not in t], work)
            s.env.update(env)
            servers.append(s)
        cold: dict[str, float] = {}
        try:
            for s in servers:  # one at a time: start-ups would compete for the two cores
                s.start()
                cold[s.name] = round(s.wait_ready(180.0), 2)
                s.pause()
            for r in range(a.rounds):
                for c in conc:
                    for s in servers:
                        if a.budget_s and time.perf_counter() - t0 + a.warmup + a.duration > a.budget_s:
                            log.warning("budget reached: skipping %s c=%d round %d", s.name, c, r)
                            continue
                        s.resume()
                        run_http_bench(s.url, kind="compare", images=photos, concurrency=c, duration_s=a.warmup)
                        res = run_http_bench(s.url, kind="compare", images=photos, concurrency=c, duration_s=a.duration)
                        s.pause()
                        samples.setdefault((s.name, c), []).append(res.to_dict())
                        log.info("round %d %s: %s", r, s.name, res.summary())
            plans = {s.name: plan_line(s) for s in servers}
        finally:
            for s in servers:
                s.stop()
    rows = []
    for (name, c), rs in samples.items():
        rows.append(
            {
                "server": name,
                "concurrency": c,
                "ok_req_s": round(statistics.median(x["ok_req_s"] for x in rs), 2),
                "ok_req_s_rounds": [x["ok_req_s"] for x in rs],
                "p50_ms": rs[-1]["p50_ms"],
                "p99_ms": max((x["p99_ms"] or 0.0) for x in rs),
                "errors": [x["errors"] for x in rs if x["errors"]],
            }
        )
    base = {r["concurrency"]: r["ok_req_s"] for r in rows if r["server"] == "baseline"}
    ratios = {r["server"]: {} for r in rows if r["server"] != "baseline"}  # server → concurrency → ratio to baseline
    for r in rows:
        if r["server"] != "baseline" and base.get(r["concurrency"]):
            ratios[r["server"]][str(r["concurrency"])] = round(r["ok_req_s"] / base[r["concurrency"]], 3)
    result = {
        "benchmark": "cpu_e2e",
        "command": " ".join(["python", *sys.argv]),
        "baseline_ref": a.baseline_ref,
        "baseline_commit": subprocess.run(
            ["git", "rev-parse", a.baseline_ref], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "servers": {s.name: {"argv": s.argv[s.argv.index("--device") :], "env": s.env} for s in servers},
        "cold_start_s": cold,
        "plans": plans,
        "rows": rows,
        "ratio_vs_baseline": ratios,
        "seconds": round(time.perf_counter() - t0, 1),
        "env": env_record(**{k: str(v) for k, v in vars(a).items()}, n_photos=len(photos), loadavg=os.getloadavg()),
    }
    write_json(out, result)
    for r in rows:
        log.info("%-10s c=%-3d %7.2f ok req/s  p99 %s ms", r["server"], r["concurrency"], r["ok_req_s"], r["p99_ms"])
    log.info("ratio vs baseline: %s", ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
