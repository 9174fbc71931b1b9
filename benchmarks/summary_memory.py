"""Session 13's tables for docs/benchmarks.md: the low-memory settings against issue #4's memory budget, and the
aligned-crop fast path on the GPU (every figure from a committed JSON file)."""

from __future__ import annotations

from typing import Any

from summary_http import images_run, load

IRSE = "rts_checkpoint=/tmp/irse64.pt"


def _short(variant: str) -> str:
    return variant.replace(IRSE, "IR-SE-64").replace(",", ", ")


def _failure(error: str) -> str:
    """Where a variant's child failed: the last facegate frame and the exception's first words."""
    lines = error.strip().splitlines()
    if "ValidationError" in error:  # the settings were refused before anything ran
        at = next((i for i, ln in enumerate(lines) if "validation error for Settings" in ln), len(lines) - 2)
        field, why = [*lines[at + 1 : at + 3], "?", "?"][:2]
        return f"not run: the settings refused `{field.strip()}` ({why.strip()[:40]})"
    if "Py_FinalizeEx" in error and 'File "' not in error:
        return "crashed at interpreter exit (a C++ tensor destructor; the output was lost)"
    frames = [ln.strip() for ln in lines if 'File "' in ln and "/facegate/" in ln]
    where = frames[-1].split("/facegate/")[-1].split('"')[0] if frames else "?"
    func = frames[-1].rsplit(" in ", 1)[-1] if frames else "?"
    kind = "out of memory" if "OutOfMemoryError" in error else (error.strip().splitlines() or ["?"])[-1][:60]
    return f"{kind} in `{where}` ({func})"


def memory_variants(runs: tuple[tuple[str, str], ...]) -> str:
    """One row per serve_memory variant of each ``(run label, file)``: driver MiB above the bare context after
    build / warm-up / load, torch's reserved MiB and what the driver holds beyond it after load, and the speed
    of a batch of 64 crops and of 16 photos. A failed variant shows where it ran out."""
    out = [
        "| run | commit | variant (fp16, max batch 64) | above bare: build / warm-up / load MiB | torch reserved "
        "after load | beyond torch | sub-batches (stages × crops) | embed 64 ms | detect 16 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, name in runs:
        d = load(name)
        bare = d["bare_context"]["driver_mib"]
        commit = d["env"].get("code_commit", "?")[:7]
        for v in d["variants"]:
            head = f"| {label} | {commit} | `{_short(v['variant'])}`"
            if "error" in v:
                why = _failure(v["error"])
                out.append(f"{head} | {why if why.startswith('not run') else 'failed: ' + why} | | | | | |")
                continue
            above = " / ".join(f"{v[t]['above_bare_mib']:+.0f}" for t in ("after_build", "after_warmup", "after_load"))
            load_ = v["after_load"]
            beyond = load_["driver_mib"] - load_["reserved_mib"] - bare
            split = v.get("activation_split")
            sub = f"{split['stages_in_sub_batches']} × {split['sub_batch']}" if split else "none"
            out.append(
                f"{head} | {above} | {load_['reserved_mib']:.0f} | {beyond:+.0f} | {sub} | {v['embed_batch_ms']:.2f} "
                f"| {v['detect_16_ms']:.2f} |"
            )
    return "\n".join(out)


def graph_cost(name: str) -> str:
    """A bare process's driver MiB after one cuDNN convolution and then after two CUDA-graph captures of it,
    with PyTorch's default cuBLAS workspaces and without them."""
    d = load(name)
    bare = d["bare_context"]["driver_mib"]
    out = [
        "| cuBLAS workspaces | bare | after conv + GEMM (fp32, fp16) | after graph 1 | after graph 2 "
        "| torch reserved |",
        "|---|---|---|---|---|---|",
    ]
    cases: list[tuple[str, dict[str, Any]]] = [("PyTorch's default", d["libraries"])]
    cases += [("none (`gemm_workspace=none`, the default)", e) for e in d.get("libraries_env", [])]
    for label, lib in cases:
        s = lib["steps_driver_mib"]
        out.append(
            f"| {label} | {bare:.0f} | {s['cudnn_conv_fp16_nhwc']:.0f} ({s['cudnn_conv_fp16_nhwc'] - bare:+.0f}) "
            f"| {s['cuda_graph_1']:.0f} ({s['cuda_graph_1'] - s['cudnn_conv_fp16_nhwc']:+.0f}) "
            f"| {s['cuda_graph_2']:.0f} ({s['cuda_graph_2'] - s['cuda_graph_1']:+.0f}) "
            f"| {lib['torch_reserved_mib']:.0f} |"
        )
    return "\n".join(out)


def session13_fields() -> dict[str, str]:
    """Template fields of session 13 (runs 37–44)."""
    e3 = "facegate_mp_w8_e3_det64"
    runs = (
        ("39", "serve_memory_gpu_run39.json"),
        ("40", "serve_memory_gpu_run40.json"),
        ("41", "serve_memory_gpu_run41.json"),
        ("43", "serve_memory_gpu_run43.json"),
        ("44", "serve_memory_gpu_run44.json"),
    )
    return {
        "memory13": memory_variants(runs),
        "memory13_cmds": "\n".join(f"- run {label}: `{load(name)['command']}`" for label, name in runs),
        "graph_cost13": graph_cost("serve_memory_gpu_run40.json"),
        **images_run("http_gpu42", "http_gpu_run42_fastpath.json", ("_ratios", e3, (f"{e3}_nofast",))),
    }


# --------------------------------------------------------------------------- session 14 (runs 45–51)
def graph_probe(name: str) -> str:
    """A bare process's driver and torch-reserved MiB after each step of serve_memory's ``--graph-probe``, per
    environment: what a side stream, a CUDA-graph capture and a shared pool cost, with no cuDNN kernel at first."""
    d = load(name)
    bare = d["bare_context"]["driver_mib"]
    out = ["| environment | step | driver MiB (step's change) | torch reserved | outside torch, above bare |",
           "|---|---|---|---|---|"]  # fmt: skip
    for probe in d["graph_probe"]:
        env = ", ".join(f"`{k}={v}`" for k, v in probe["env"].items()) or "default"
        prev = probe["driver_mib"]
        out.append(f"| {env} | bare context of this process | {prev:.0f} | | |")
        for step, s in probe["graph_steps"].items():
            beyond = s["driver_mib"] - s["reserved_mib"] - probe["driver_mib"]
            out.append(
                f"| {env} | {step.replace('_', ' ')} | {s['driver_mib']:.0f} ({s['driver_mib'] - prev:+.0f}) "
                f"| {s['reserved_mib']:.0f} | {beyond:+.0f} |"
            )
            prev = s["driver_mib"]
    del bare
    return "\n".join(out)


def trace_peaks(runs: tuple[tuple[str, str], ...], top: int = 3) -> str:
    """Per variant and load phase of ``--trace`` runs: the allocation peak of the phase, how far the allocator's
    segments grew, and the ``top`` code sites alive at the peak (MiB, with the largest block)."""
    out = ["| run | variant | phase | peak MiB | segments grown MiB | alive at the peak: site MiB (largest block) |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for label, name in runs:
        for v in load(name)["variants"]:
            for phase, t in (v.get("trace") or {}).items():
                sites = "; ".join(
                    f"`{r['site'].removeprefix('facegate/')}` {r['mib']:.1f} ({r['largest_mib']:.2f})"
                    for r in t["live_at_peak"][:top]
                )
                out.append(
                    f"| {label} | `{_short(v['variant'])}` | {phase} | {t['peak_mib']:.1f} "
                    f"| {t['segments_grown_mib']:.0f} | {sites} |"
                )
    return "\n".join(out)


def http_memory(runs: tuple[tuple[str, str], ...]) -> str:
    """Per http_e2e run and server: driver MiB above the run's bare context when idle and after the load, torch's
    reserved MiB then, and req/s (p99 ms) per kind at each concurrency."""
    out = ["| run | commit | server | above bare: idle / after load MiB | torch reserved: idle / after load | "
           "req/s (p99 ms) per kind and concurrency |", "|---|---|---|---|---|---|"]  # fmt: skip
    for label, name in runs:
        d = load(name)
        bare = d["bare_cuda_context"]["mib"]
        commit = d["env"].get("code_commit", "?")[:7]
        for server, info in d["servers"].items():
            idle, after = info["gpu_memory_idle"]["mib"], info["gpu_memory_after_load"]["mib"]
            t0, t1 = info["torch_memory_idle_mib"]["reserved"], info["torch_memory_after_load_mib"]["reserved"]
            points = "; ".join(
                f"{r['kind']} c={r['concurrency']}: {r['ok_req_s']:.0f} ({r['p99_ms']:.0f})"
                for r in sorted(d["rows"], key=lambda r: (r["kind"], -r["concurrency"]))
                if r["server"] == server
            )
            out.append(
                f"| {label} | {commit} | {server} | {idle - bare:+.0f} / {after - bare:+.0f} | {t0:.0f} / {t1:.0f} "
                f"| {points} |"
            )
    return "\n".join(out)


def session14_fields() -> dict[str, str]:
    """Template fields of session 14 (runs 45–51)."""
    runs = (
        ("45", "serve_memory_gpu_run45.json"),
        ("46", "serve_memory_gpu_run46.json"),
        ("47", "serve_memory_gpu_run47.json"),
        ("49 (same thread)", "serve_memory_gpu_run49_same_thread.json"),
        ("49 (load thread)", "serve_memory_gpu_run49_load_thread.json"),
        ("50", "serve_memory_gpu_run50.json"),
        ("51", "serve_memory_gpu_run51.json"),
    )
    http = (("48", "http_gpu_run48_lowmem.json"), ("50", "http_gpu_run50_lowmem.json"),
            ("51", "http_gpu_run51_lowmem.json"))  # fmt: skip
    return {
        "memory14": memory_variants(runs),
        "memory14_cmds": "\n".join(f"- run {label}: `{load(name)['command']}`" for label, name in runs),
        "graph_probe14": graph_probe("serve_memory_gpu_run45.json"),
        "trace14": trace_peaks((("45", "serve_memory_gpu_run45.json"), ("51", "serve_memory_gpu_run51.json"))),
        "http_memory14": http_memory(http),
        "http_memory14_cmds": "\n".join(f"- run {label}: `{load(name)['command']}`" for label, name in http),
    }


# --------------------------------------------------------------------------- session 15 (runs 52–53)
def threads_probe(name: str) -> str:
    """A bare process's driver and torch-reserved MiB after each step of serve_memory's ``--threads-probe``: the
    first cuDNN conv and cuBLAS gemm, then each further live thread that runs them, then a first side stream."""
    probe = load(name)["threads_probe"]
    out = ["| step | driver MiB (step's change) | torch reserved (change) | outside torch, change |",
           "|---|---|---|---|"]  # fmt: skip
    prev, prev_r = probe["driver_mib"], 0.0
    out.append(f"| bare context of this process | {prev:.0f} | | |")
    for step, st in probe["thread_steps"].items():
        d, r = st["driver_mib"], st["reserved_mib"]
        out.append(
            f"| {step.replace('_', ' ')} | {d:.0f} ({d - prev:+.0f}) | {r:.0f} ({r - prev_r:+.0f}) "
            f"| {(d - prev) - (r - prev_r):+.0f} |"
        )
        prev, prev_r = d, r
    return "\n".join(out)


def session15_fields() -> dict[str, str]:
    """Template fields of session 15 (runs 52–53)."""
    http = (("52", "http_gpu_run52_lowmem.json"), ("53", "http_gpu_run53_onedev.json"))
    runs = (("52", "serve_memory_gpu_run52.json"),)
    warp_http = (("55", "http_gpu_run55_warp.json"), ("56", "http_gpu_run56_warp_rounds.json"))
    warp = (("55", "serve_memory_gpu_run55_warp.json"),)
    return {
        "warp15": memory_variants(warp),
        "warp15_trace": trace_peaks(warp),
        "warp15_http": http_memory(warp_http),
        "warp15_cmds": "\n".join(f"- run {label}: `{load(name)['command']}`" for label, name in (*warp, *warp_http)),
        "threads15": threads_probe("serve_memory_gpu_run52.json"),
        "memory15": memory_variants(runs),
        "memory15_cmds": "\n".join(f"- run {label}: `{load(name)['command']}`" for label, name in runs),
        "http_memory15": http_memory(http),
        "http_memory15_cmds": "\n".join(f"- run {label}: `{load(name)['command']}`" for label, name in http),
    }
