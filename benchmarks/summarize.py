"""Write docs/benchmarks.md from the committed JSON results (every figure there comes from a file here).

python benchmarks/summarize.py > docs/benchmarks.md
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance import ACCEPTANCE
from summary_http import (
    cold_starts,
    engine_phases,
    gpu_memory,
    http_gpu,
    http_gpu_images,
    http_gpu_runs,
    http_ratios,
    http_run,
    images_run,
    load,
    session12_fields,
    table_md,
    time_split,
)
from summary_memory import session13_fields, session14_fields, session15_fields


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


def frontend_gil(name: str = "frontend_gil_cpu.json") -> str:
    d = load(name)
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


def soak(name: str = "soak_cpu_mp.json") -> str:
    d = load(name)
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


def soak_front_ends(name: str) -> str:
    """Resident memory of each server process at a soak's first and last window (the smallest-RSS ones are the
    front-ends of a process-model server; the supervisor and resource tracker are smaller still)."""
    sm = load(name)["samples"]
    first, last = sm[0]["rss_by_pid"], sm[-1]["rss_by_pid"]
    rows = ", ".join(f"{first[p]:.0f} → {last[p]:.0f}" for p in sorted(first, key=first.get) if p in last)
    return f"Resident MiB per server process, first → last window: {rows}."


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


def photo_profile_device(header: str, runs: tuple[tuple[str, str], ...]) -> str:
    """photo_profile.py runs of one device call (``--gpu-kernels``), one row per run and batch size."""
    out = [
        f"| {header} | photos per batch | prepare ms | execute ms | two threads: photos/s "
        "| device ms per batch | profiled wall ms per batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, f in runs:
        for pt in load(f)["points"]:
            sq, g = pt["sequential"], pt["gpu_kernels"]
            out.append(
                f"| {label} | {pt['batch']} | {sq['prepare_ms']:.2f} | {sq['execute_ms']:.2f} | "
                f"{pt['pipelined']['photos_per_s']:,.0f} | {g['device_ms_per_batch']:.2f} | "
                f"{g['wall_ms_per_batch']:.2f} |"
            )
    return "\n".join(out)


def photo_top_kernels(name: str, batch: int, n: int = 6) -> str:
    """The ``n`` device activities with the most time per batch at one batch size of a photo_profile run."""
    pt = next(p for p in load(name)["points"] if p["batch"] == batch)
    return "; ".join(f"{_kernel_label(k['name'])} {k['ms_per_batch']:.2f} ms" for k in pt["gpu_kernels"]["top"][:n])


def _kernel_label(name: str) -> str:
    """A CUDA kernel's name shortened to the ATen operation (and dtype) or library kernel it is."""
    for key in (
        "prelu_kernel", "CUDAFunctor_add", "conv_depthwise2d_forward_kernel", "launch_clamp_scalar",
        "max_pool_forward_nchw", "direct_copy_kernel_cuda", "CatArrayBatchedCopy", "implicit_convolve_sgemm",
        "bias_act_kernel",
    ):  # fmt: skip
        if key in name:
            dtype = "fp16" if "Half" in name else "fp32" if "float" in name else ""
            return f"`{key}` ({dtype})" if dtype else f"`{key}`"
    return f"`{name.split('(')[0][:48]}`"


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


def warmup_shapes(name: str) -> str:
    """Per variant of a ``serve_memory.py`` run: the first eager run (cuDNN planning) of each captured shape."""
    d = load(name)
    variants = [v for v in d["variants"] if "captures" in v]
    shapes = [tuple(c["shape"]) for c in variants[0]["captures"]]
    head = " | ".join("×".join(str(x) for x in sh[:3]) for sh in shapes)
    out = [f"| variant | {head} | total s |", "|---|" + "---|" * (len(shapes) + 1)]
    for v in variants:
        firsts = {tuple(c["shape"]): c["first_run_s"] or 0.0 for c in v["captures"]}
        cells = " | ".join(f"{firsts[sh]:.2f}" if sh in firsts else "–" for sh in shapes)
        out.append(f"| `{v['variant']}` | {cells} | {sum(firsts.values()):.1f} |")
    return "\n".join(out)


def frontend_footprint() -> str:
    """``frontend_footprint.py``: import seconds, peak and resident memory of a front-end, head vs baseline."""
    d = load("frontend_footprint_cpu.json")
    out = [
        "| tree | import + index s (median, range) | peak MiB (import probe) | front-end RSS MiB (serving) | "
        "front-ends mapping libtorch | server ready s (one start) |",
        "|---|---|---|---|---|---|",
    ]
    for name, sm in d["summary"].items():
        lo, hi = sm["probe_seconds_range"]
        rss = " / ".join(f"{x:.0f}" for x in sm["front_end_rss_mib"])
        mapping = f"{sm['front_ends_mapping_libtorch']} of {len(sm['front_end_rss_mib'])}"
        out.append(
            f"| {name} | {sm['probe_seconds_median']:.2f} ({lo:.2f}–{hi:.2f}) | {sm['probe_max_rss_mib']:.0f} | "
            f"{rss} | {mapping} | {d['serve'][name]['ready_s']:.1f} |"
        )
    return "\n".join(out)


def gallery_search() -> str:
    """``gallery_search.py``: engine search stage (64 queries, top-10), one query, one applied change, start-up."""
    d = load("gallery_search_cpu.json")

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "–"

    out = [
        "| backend | gallery | engine batch of 64 ms | index batch of 64 ms | one query ms | apply one change ms "
        "| start-up load s | import subjects/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['backend']} | {r['gallery']:,} | {cell(r, 'engine_batch64_ms', '.1f')} | "
            f"{cell(r, 'index_batch64_ms', '.1f')} | {cell(r, 'single_query_ms', '.2f')} | "
            f"{cell(r, 'apply_one_change_ms', '.3f')} | {cell(r, 'full_load_s', '.2f')} | "
            f"{cell(r, 'import_subjects_per_s', ',.0f')} |"
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


def engine_gil() -> str:
    """``frontend_gil.py --target engine``: the embed stage's prepare ms per batch and req/s, per variant."""
    d = load("engine_gil_cpu_8crops.json")
    parts = []
    for label in d["median_gil_samples_per_request"]:
        rows = [r for r in d["rows"] if r["variant"] == label]
        prep = ", ".join(f"{r['engine_phases']['phase_ms_per_batch']['prepare,embed']:.2f}" for r in rows)
        rps = ", ".join(f"{r['ok_req_s']:.0f}" for r in rows)
        parts.append(f"`{label}` prepare {prep} ms per batch at {rps} req/s")
    return "; ".join(parts)


def acceptance() -> str:
    out = ["| target | measured | status |", "|---|---|---|"]
    out += [f"| {t} | {m} | {s} |" for t, m, s in ACCEPTANCE]
    return "\n".join(out)


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
            soak7_cmd=load("soak_cpu_mp_session7.json")["command"],
            soak7_commit=load("soak_cpu_mp_session7.json")["env"]["code_commit"][:7],
            soak7=soak("soak_cpu_mp_session7.json"),
            soak8_cmd=load("soak_cpu_mp_session8.json")["command"],
            soak8_commit=load("soak_cpu_mp_session8.json")["env"]["code_commit"][:7],
            soak8=soak("soak_cpu_mp_session8.json"),
            soak8_fronts=soak_front_ends("soak_cpu_mp_session8.json"),
            soak7_end=", ".join(
                f"{v:.0f}" for v in sorted(load("soak_cpu_mp_session7.json")["samples"][-1]["rss_by_pid"].values())
            ),
            frontend_footprint_cmd=load("frontend_footprint_cpu.json")["command"],
            frontend_footprint=frontend_footprint(),
            gallery_search_cmd=load("gallery_search_cpu.json")["command"],
            gallery_search=gallery_search(),
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
            frontend_gil_fast=frontend_gil("frontend_gil_cpu_fastpath.json"),
            frontend_gil_fast_cmd=load("frontend_gil_cpu_fastpath.json")["command"],
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
            engine_gil=engine_gil(),
            engine_gil_cmd=load("engine_gil_cpu_8crops.json")["command"],
            gil_copy_cmd=load("gil_copy_cpu.json")["command"],
            probe_threads=warmup_probe("serve_memory_gpu_plan_threads.json"),
            probe_wscap=warmup_probe("serve_memory_gpu_wscap.json"),
            **images_run(
                "http_gpu15",
                "http_gpu_run15_session7.json",
                ("_ratios", "facegate_mp_w8", ("naive", "litserve", "facegate_mp")),
            ),
            engine_phases15=engine_phases("http_gpu_run15_session7.json", "facegate_mp_w8"),
            **images_run(
                "http_gpu16",
                "http_gpu_run16_two_engines.json",
                ("_ratios", "facegate_mp_w8_e2", ("naive", "litserve", "facegate_mp_w8")),
                ("_w8_ratios", "facegate_mp_w8", ("naive", "litserve")),
            ),
            probe_det_nchw_cmd=load("serve_memory_gpu_det_nchw.json")["command"],
            probe_det_nchw_shapes=warmup_shapes("serve_memory_gpu_det_nchw.json"),
            probe_det_nchw=warmup_probe("serve_memory_gpu_det_nchw.json"),
            **images_run(
                "http_gpu18",
                "http_gpu_run18_det_nchw.json",
                ("_ratios", "facegate_mp_w8_e2", ("naive", "litserve", "facegate_mp_w8")),
                ("_w8_ratios", "facegate_mp_w8", ("naive", "litserve")),
            ),
            engine_phases18=engine_phases("http_gpu_run18_det_nchw.json", "facegate_mp_w8"),
            soak_gpu4_cmd=load("soak_gpu_mp_run4_session8.json")["command"],
            soak_gpu4=soak_gpu("soak_gpu_mp_run4_session8.json"),
            probe_max_batch_cmd=load("serve_memory_gpu_max_batch.json")["command"],
            probe_max_batch=warmup_probe("serve_memory_gpu_max_batch.json"),
            **images_run(
                "http_gpu19",
                "http_gpu_run19_three_engines.json",
                ("_ratios", "facegate_mp_w8_e3", ("naive", "litserve", "facegate_mp_w8_e2", "facegate_mp_w8")),
                ("_e2_ratios", "facegate_mp_w8_e2", ("naive", "litserve")),
                ("_w8_ratios", "facegate_mp_w8", ("naive", "litserve")),
            ),
            pyspy10=pyspy_engine("pyspy_run10_facegate_mp.json"),
            photo_profile_device=photo_profile_device(
                "photos per detector forward",
                (("16", "photo_profile_run4_det16.json"), ("64", "photo_profile_run4_det64.json")),
            ),
            photo_profile_devsel=photo_profile_device(
                "face selection",
                (("host", "photo_profile_run5_devsel_false.json"), ("device", "photo_profile_run5_devsel_true.json")),
            ),
            photo_top_kernels=photo_top_kernels("photo_profile_run4_det16.json", 54),
            **images_run(
                "http_gpu25",
                "http_gpu_run25_devsel_v2.json",
                ("_ratios", "facegate_mp_w8_devsel", ("facegate_mp_w8",)),
                ("_e3_ratios", "facegate_mp_w8_e3_det64_devsel", ("facegate_mp_w8_e3_det64",)),
            ),
            engine_phases25=engine_phases("http_gpu_run25_devsel_v2.json", "facegate_mp_w8_devsel"),
            photo_profile_fuse=photo_profile_device(
                "fused epilogues",
                (("off", "photo_profile_run6_fuse_false.json"), ("on", "photo_profile_run6_fuse_true.json")),
            ),
            photo_top_kernels_fused=photo_top_kernels("photo_profile_run6_fuse_true.json", 54),
            **images_run(
                "http_gpu26",
                "http_gpu_run26_fused_epilogue.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("facegate_mp_w8_e3_det64_nofuse",)),
                ("_w8_ratios", "facegate_mp_w8", ("facegate_mp_w8_nofuse",)),
            ),
            time_split26=time_split("http_gpu_run26_fused_epilogue.json"),
            **images_run(
                "http_gpu27",
                "http_gpu_run27_buckets.json",
                (
                    "_ratios",
                    "facegate_mp_w8_e3_det64",
                    ("facegate_mp_w8_e3_det64_b3", "facegate_mp_w8_e3_det64_nofuse"),
                ),
            ),
            time_split27=time_split("http_gpu_run27_buckets.json"),
            **images_run(
                "http_gpu28",
                "http_gpu_run28_hostdec.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("facegate_mp_w8_e3_det64_hostdec", "naive", "litserve")),
            ),
            **images_run(
                "http_gpu29",
                "http_gpu_run29_depthwise.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("facegate_mp_w8_e3_det64_nodw",)),
            ),
            time_split29=time_split("http_gpu_run29_depthwise.json"),
            photo_profile_dw=photo_profile_device(
                "depthwise kernel",
                (
                    ("off (run 29)", "photo_profile_run7_dw_off.json"),
                    ("2-D tiles, specialised (run 29)", "photo_profile_run7_dw_on.json"),
                    ("off (run 31)", "photo_profile_run8_flat_dw_off.json"),
                    ("flat, unspecialised (run 31)", "photo_profile_run8_flat_dw_on.json"),
                    ("off (run 32)", "photo_profile_run9_dw_off.json"),
                    ("2-D tiles, C/H unspecialised (run 32)", "photo_profile_run9_dw_on.json"),
                ),
            ),
            photo_top_kernels_dw=photo_top_kernels("photo_profile_run9_dw_on.json", 54),
            **images_run(
                "http_gpu30",
                "http_gpu_run30_session11.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("naive", "litserve")),
            ),
            time_split30=time_split("http_gpu_run30_session11.json"),
            **images_run(
                "http_gpu32",
                "http_gpu_run32_session11_final.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("facegate_mp_w8_e3_det64_nodw",)),
            ),
            **session12_fields(),
            **session13_fields(),
            **session14_fields(),
            **session15_fields(),
            soak_gpu6=soak_gpu("soak_gpu_mp_run6_session12.json"),
            soak_gpu15=soak_gpu("soak_gpu_lowmem_run54.json"),
            soak_gpu15_env=", ".join(
                f"`{k}={v}`"
                for k, v in load("soak_gpu_lowmem_run54.json")["server_env"].items()
                if k != "FACEGATE_LOG_LEVEL"
            ),
            serve_memory12=serve_memory("serve_memory_gpu_session12.json"),
            cold_starts11=cold_starts(
                (
                    ("30", "http_gpu_run30_session11.json", "facegate_mp_w8_e3_det64", "empty"),
                    ("30", "http_gpu_run30_warm_triton_cache.json", "facegate_mp_w8_e3_det64", "warm"),
                    ("31", "http_gpu_run31_flat_kernels.json", "facegate_mp_w8_e3_det64", "empty"),
                    ("31", "http_gpu_run31_warm_triton_cache.json", "facegate_mp_w8_e3_det64", "warm"),
                    ("32", "http_gpu_run32_session11_final.json", "facegate_mp_w8_e3_det64", "empty"),
                    ("32", "http_gpu_run32_session11_final.json", "facegate_mp_w8_e3_det64_nodw", "partly warm"),
                    ("32", "http_gpu_run32_warm_triton_cache.json", "facegate_mp_w8_e3_det64", "warm"),
                )
            ),
            soak_gpu5_cmd=load("soak_gpu_mp_run5_session10.json")["command"],
            soak_gpu5=soak_gpu("soak_gpu_mp_run5_session10.json"),
            serve_memory10_cmd=load("serve_memory_gpu_session10.json")["command"],
            serve_memory10=serve_memory("serve_memory_gpu_session10.json"),
            **images_run(
                "http_gpu20",
                "http_gpu_run20_detect_in_prepare.json",
                ("_ratios", "facegate_mp_w8_e2", ("facegate_mp_w8_e2_detexec", "facegate_mp_w8_e2_det64", "naive")),
                ("_w8_ratios", "facegate_mp_w8", ("facegate_mp_w8_detexec", "naive")),
            ),
            **images_run("http_gpu21", "http_gpu_run21_pyspy.json"),
            pyspy21=pyspy_engine("pyspy_run21_facegate_mp_w8_e2.json"),
            engine_phases21=engine_phases("http_gpu_run21_pyspy.json", "facegate_mp_w8_e3_det64"),
            **images_run(
                "http_gpu22",
                "http_gpu_run22_affinity.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("naive", "litserve", "facegate_mp_w8_e3_det64_noaff")),
                ("_e2_ratios", "facegate_mp_w8_e2", ("naive", "litserve")),
            ),
            **images_run(
                "http_gpu24",
                "http_gpu_run24_device_select.json",
                ("_ratios", "facegate_mp_w8", ("facegate_mp_w8_devsel",)),
                ("_e3_ratios", "facegate_mp_w8_e3_det64", ("facegate_mp_w8_e3_det64_devsel",)),
            ),
            engine_phases24=engine_phases("http_gpu_run24_device_select.json", "facegate_mp_w8_devsel"),
            engine_phases24_host=engine_phases("http_gpu_run24_device_select.json", "facegate_mp_w8"),
            **images_run(
                "http_gpu23",
                "http_gpu_run23_affinity_rounds.json",
                ("_ratios", "facegate_mp_w8_e3_det64", ("facegate_mp_w8_e3_det64_noaff",)),
            ),
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


#: docs/benchmarks.md with ``{field}`` placeholders (``str.format``; literal braces doubled).
TEMPLATE = (Path(__file__).resolve().parent / "benchmarks_template.md").read_text()


if __name__ == "__main__":
    main()
