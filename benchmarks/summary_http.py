"""The HTTP-run and shared helpers of summarize.py: result loading, the tables of one http_e2e run, ratios.

Split from summarize.py, which renders docs/benchmarks.md from these and its other sections' helpers.
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((R / name).read_text())


def _rows(name: str) -> list[dict]:
    return load(name)["rows"]


def _errors_and_batches(r: dict) -> tuple[str, str]:
    """An http_e2e row's error counts and mean batch size per stage, as table cells."""
    err = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "–"
    mb = ", ".join(f"{k} {v:.1f}" for k, v in r.get("mean_batch_size", {}).items()) or "–"
    return err, mb


def http_gpu(name: str = "http_gpu.json") -> str:
    d = load(name)
    out = [
        "| kind | c | server | req/s | p50 / p95 / p99 ms | errors | GPU util % | server CPU cores | mean batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        err, mb = _errors_and_batches(r)
        lat = "–" if r["p50_ms"] is None else f"{r['p50_ms']:.0f} / {r['p95_ms']:.0f} / {r['p99_ms']:.0f}"
        out.append(
            f"| {r['kind']} | {r['concurrency']} | {r['server']} | {r['ok_req_s']:.1f} | {lat} | {err} | "
            f"{r.get('gpu_util_mean', '–')} | {r['server_cpu_cores']:.2f} | {mb} |"
        )
    return "\n".join(out)


def http_gpu_images(name: str) -> str:
    """Rows of one run with images/s (faces/s for the aligned kinds, photos/s for compare) and the CPU picture."""
    d = load(name)
    out = [
        "| kind | images per request | c | server | req/s | images/s | p50 / p99 ms | errors | GPU util % "
        "| server CPU cores | busiest thread | mean batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        err, mb = _errors_and_batches(r)
        lat = "–" if r["p50_ms"] is None else f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}"
        out.append(
            f"| {r['kind']} | {r['images_per_request']} | {r['concurrency']} | {r['server']} | {r['ok_req_s']:,.1f} | "
            f"{r['images_s']:,.0f} | {lat} | {err} | {r.get('gpu_util_mean', '–')} | {r['server_cpu_cores']:.2f} | "
            f"{r['server_top_thread_cpu']:.2f} | {mb} |"
        )
    return "\n".join(out)


def engine_phases(name: str, server: str) -> str:
    """Per kind and concurrency: the engine stage's ms per batch and busy share, prepare and execute."""
    out = ["| kind | c | stage | prepare ms / busy | execute ms / busy | queue wait ms |", "|---|---|---|---|---|---|"]
    for r in _rows(name):
        if r["server"] != server or not r.get("time_breakdown"):
            continue
        tb = r["time_breakdown"]
        for stage in tb.get("queue_wait_ms", {}):
            pm, pb = tb["phase_ms_per_batch"].get(f"prepare,{stage}"), tb["phase_busy"].get(f"prepare,{stage}")
            em, eb = tb["phase_ms_per_batch"].get(f"execute,{stage}"), tb["phase_busy"].get(f"execute,{stage}")
            if pm is None or em is None:
                continue
            out.append(
                f"| {r['kind']} | {r['concurrency']} | {stage} | {pm:.2f} / {pb:.0%} | {em:.2f} / {eb:.0%} | "
                f"{tb['queue_wait_ms'][stage]:.1f} |"
            )
    return "\n".join(out)


def time_split(name: str) -> str:
    """Where a compare request's time went, per facegate server and concurrency (runs whose front-ends are
    told apart by ``facegate_process_info``, from run 26 on): client mean latency; in-server latency; the
    engine call (submit → answer); and inside the engine the photo stage's queue wait and its prepare and
    execute time per batch."""
    out = [
        "| server | c | client mean ms | in server ms | engine call ms | queue wait ms | prepare ms / batch "
        "| execute ms / batch | photos per batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _rows(name):
        tb = r.get("time_breakdown")
        if not tb or r["kind"] != "compare":
            continue
        ph = tb["phase_ms_per_batch"]
        out.append(
            f"| {r['server']} | {r['concurrency']} | {r['mean_ms']:.1f} | "
            f"{tb['server_latency_ms'].get('POST /api/compare', float('nan')):.1f} | "
            f"{tb['engine_call_ms'].get('photo', float('nan')):.1f} | "
            f"{tb['queue_wait_ms'].get('photo', float('nan')):.1f} | "
            f"{ph.get('prepare,photo', float('nan')):.2f} | {ph.get('execute,photo', float('nan')):.2f} | "
            f"{r['mean_batch_size'].get('photo', float('nan')):.1f} |"
        )
    return "\n".join(out)


def http_gpu_runs() -> str:
    runs = (
        ("1: NHWC detector, 4 shapes × 7 buckets warmed", "http_gpu_run1_nhwc_detector.json"),
        ("2: NCHW detector", "http_gpu_run2_nchw_detector.json"),
        ("3: NCHW + detector CUDA graphs", "http_gpu_run3_detector_graphs.json"),
        ("4: one graph pool, buckets 1/4/16/64, 16-photo detector batches", "http_gpu_run4_process_model.json"),
    )
    out = [
        "| run (code) | facegate compare c=100 req/s | p99 ms | detect: ms per batch (execute) | detect execute busy "
        "| embed: ms per batch (execute) | LitServe same run req/s | facegate cold start s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in runs:
        d = load(f)
        fg = next(
            r for r in d["rows"] if r["server"] == "facegate" and r["kind"] == "compare" and r["concurrency"] == 100
        )
        ls = next(
            r for r in d["rows"] if r["server"] == "litserve" and r["kind"] == "compare" and r["concurrency"] == 100
        )
        tb = fg["time_breakdown"]
        out.append(
            f"| {name} ({d['env']['code_commit'][:7]}) | {fg['ok_req_s']:.1f} | {fg['p99_ms']:.0f} | "
            f"{tb['phase_ms_per_batch']['execute,detect']:.1f} | {tb['phase_busy']['execute,detect']:.2f} | "
            f"{tb['phase_ms_per_batch']['execute,embed']:.1f} | {ls['ok_req_s']:.1f} | "
            f"{d['servers']['facegate']['cold_start_s']:.1f} |"
        )
    return "\n".join(out)


def gpu_memory() -> str:
    out = [
        "| run | server | driver MiB idle | above bare context | driver MiB after load | torch allocated / peak / "
        "reserved MiB (idle) |",
        "|---|---|---|---|---|---|",
    ]
    for run, f in (("1", "http_gpu_run1_nhwc_detector.json"), ("2", "http_gpu_run2_nchw_detector.json"),
                   ("3", "http_gpu_run3_detector_graphs.json"), ("4", "http_gpu_run4_process_model.json"),
                   ("5", "http_gpu_run5_cpu_threads.json"), ("6", "http_gpu.json"),
                   ("7", "http_gpu_run7_replay_lock.json"), ("8", "http_gpu_run8_photo_prepare.json"),
                   ("9", "http_gpu_run9_photo_host_time.json"), ("10", "http_gpu_run10_lean_engine.json"),
                   ("11", "http_gpu_run11_gc_freeze.json")):  # fmt: skip
        d = load(f)
        bare = d["bare_cuda_context"]["mib"]
        for name, sv in d["servers"].items():
            idle = sv["gpu_memory_idle"]["mib"]
            after = sv.get("gpu_memory_after_load", {}).get("mib", float("nan"))
            tm = sv.get("torch_memory_idle_mib")
            tms = f"{tm['allocated']:.0f} / {tm['peak']:.0f} / {tm['reserved']:.0f}" if tm else "–"
            n = len(sv["gpu_memory_idle"]["by_pid"])
            out.append(
                f"| {run} | {name} ({n} process{'es' if n > 1 else ''}) | {idle:.0f} | {idle - n * bare:+.0f} | "
                f"{after:.0f} | {tms} |"
            )
    return "\n".join(out)


def http_ratios(name: str, base: str, peers: tuple[str, ...]) -> str:
    """``base``'s successful req/s against each peer's, per kind and concurrency, from one run's rows."""
    rows = {(r["server"], r["kind"], r["concurrency"]): r["ok_req_s"] for r in _rows(name)}
    cs = sorted({c for (_, _, c) in rows})
    out = ["| kind | c | " + " | ".join(f"{base} / {p}" for p in peers) + " |", "|---|---|" + "---|" * len(peers)]
    kinds = list(dict.fromkeys(k for (_, k, _) in rows))
    for kind in kinds:
        for c in cs:
            if (base, kind, c) not in rows:
                continue
            cells = [
                f"{rows[(base, kind, c)] / rows[(p, kind, c)]:.2f}×" if rows.get((p, kind, c)) else "–" for p in peers
            ]
            out.append(f"| {kind} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def table_md(name: str) -> str:
    return load(name)["table_md"].strip()


def http_run(key: str, name: str, peers: tuple[str, ...]) -> dict[str, str]:
    """Template fields ``{key}_cmd``, ``{key}`` and ``{key}_ratios`` (facegate_mp against ``peers``) of one run."""
    return {
        f"{key}_cmd": load(name)["command"],
        key: http_gpu(name),
        f"{key}_ratios": http_ratios(name, "facegate_mp", peers),
    }


def images_run(key: str, name: str, *ratios: tuple[str, str, tuple[str, ...]]) -> dict[str, str]:
    """Template fields of one run: ``{key}_cmd``, ``{key}`` (images/s rows) and ``{key}{suffix}`` per ratio
    table ``(suffix, base server, peers)``."""
    out = {f"{key}_cmd": load(name)["command"], key: http_gpu_images(name)}
    for suffix, base, peers in ratios:
        out[f"{key}{suffix}"] = http_ratios(name, base, peers)
    return out


def cold_starts(rows: tuple[tuple[str, str, str, str], ...]) -> str:
    """Seconds to ``/readyz`` from http_e2e runs: one row per ``(run label, result file, server, cache note)``."""
    out = ["| run | commit | Triton cache | server | cold start s |", "|---|---|---|---|---|"]
    for label, name, server, cache in rows:
        d = load(name)
        commit = d["env"].get("code_commit") or d["env"].get("git_commit", "?")
        out.append(f"| {label} | {commit[:7]} | {cache} | {server} | {d['servers'][server]['cold_start_s']:.1f} |")
    return "\n".join(out)


def front_end_balance(name: str, kinds: tuple[str, ...] = ("compare",)) -> str:
    """Per round: each front-end process's CPU cores, busiest first, with the row's req/s and p99 (http_e2e
    ``front_end_cores_rounds``): how evenly the front-ends shared the work."""
    out = ["| server | kind | c | round | req/s | front-end cores, busiest first | p99 ms (all rounds) |"]
    out.append("|---|---|---|---|---|---|---|")
    for r in _rows(name):
        if r["kind"] not in kinds:
            continue
        rounds = zip(r.get("front_end_cores_rounds", []), r["ok_req_s_rounds"], strict=True)
        for i, (cores, rate) in enumerate(rounds, 1):
            cells = " ".join(f"{c:.2f}" for c in cores)
            head = f"| {r['server']} | {r['kind']} | {r['concurrency']} | {i} | {rate:,.0f}"
            out.append(f"{head} | {cells} | {r['p99_ms']:.1f} |")
    return "\n".join(out)


def activation_floor(name: str = "activation_floor.json") -> str:
    """Per recognizer and batch: weights + the largest layer's input and output, from shapes alone."""
    out = ["| model | batch | weights MiB | largest layer (in + out) MiB | floor MiB |", "|---|---|---|---|---|"]
    for r in load(name)["rows"]:
        out.append(
            f"| {r['model']} | {r['batch']} | {r['weights_mib']:.1f} | {r['peak_in_out_mib']:.1f} "
            f"(`{r['peak_layer_type']}` {r['peak_layer_out_shape']}) | {r['floor_mib']:.1f} |"
        )
    return "\n".join(out)


def session12_fields() -> dict[str, str]:
    """Template fields of session 12 (runs 33–36): uneven accept, balanced accept, the full table, cold start."""
    e3 = "facegate_mp_w8_e3_det64"
    out = {
        **images_run("http_gpu33", "http_gpu_run33_accept_imbalance.json"),
        "balance33": front_end_balance("http_gpu_run33_accept_imbalance.json"),
        **images_run("http_gpu34", "http_gpu_run34_balanced_accept.json", ("_ratios", e3, (f"{e3}_shared",))),
        "balance34": front_end_balance(
            "http_gpu_run34_balanced_accept.json", ("compare", "embed_aligned", "embed_aligned_batch")
        ),
        **images_run("http_gpu35", "http_gpu_run35_session12.json", ("_ratios", e3, ("naive", "litserve"))),
        "time_split35": time_split("http_gpu_run35_session12.json"),
        "activation_floor12": activation_floor(),
        "activation_floor12_cmd": load("activation_floor.json")["command"],
        "soak_gpu6_cmd": load("soak_gpu_mp_run6_session12.json")["command"],
        "serve_memory12_cmd": load("serve_memory_gpu_session12.json")["command"],
        "cold_starts12": cold_starts(
            (
                ("35", "http_gpu_run35_session12.json", e3, "empty"),
                ("35", "http_gpu_run35_warm_triton_cache.json", e3, "warm"),
            )
        ),
    }
    return out
