"""Measurement helpers of the HTTP benchmark: /proc CPU accounting, NVML GPU sampling, facegate /metrics.

Split out of ``http_e2e.py``; see that module for how they are used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np

CLK_TCK = os.sysconf("SC_CLK_TCK")

log = logging.getLogger("http_e2e")


def _stat_fields(path: str) -> list[str] | None:
    """Fields of a /proc stat file from 'state' (field 3) on; None when the process is gone."""
    with contextlib.suppress(OSError), open(path) as fh:
        raw = fh.read()
        return raw[raw.rfind(")") + 2 :].split()
    return None


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a server started with ``start_new_session=True``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(f"/proc/{entry}/stat")
            if f is not None and int(f[3]) == sid and f[0] != "Z":
                out.append(int(entry))
    return out


def thread_ticks(pids: list[int]) -> dict[tuple[int, int], int]:
    """CPU ticks (user + system) of every thread of ``pids``."""
    out: dict[tuple[int, int], int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
                if f is not None:
                    out[(pid, int(tid))] = int(f[11]) + int(f[12])
    return out


def process_roles(pids: list[int], engines: int = 1) -> dict[int, str]:
    """``engine`` / ``front-end`` / ``supervisor`` for the processes of a facegate server's session.

    The supervisor is the one that is not a multiprocessing child; of the spawned children (``spawn_main`` in
    the command line) the ``engines`` engine processes are the first started, before uvicorn's front-ends.
    """
    roles: dict[int, str] = {}
    spawned: list[tuple[int, int]] = []
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
            f = _stat_fields(f"/proc/{pid}/stat")
            if b"spawn_main" in cmd and f is not None:
                spawned.append((int(f[19]), pid))  # start time, in clock ticks after boot
            elif b"resource_tracker" not in cmd:
                roles[pid] = "supervisor"
    for i, (_, pid) in enumerate(sorted(spawned)):
        roles[pid] = "engine" if i < engines else "front-end"
    return roles


def cpu_by_role(
    th0: dict[tuple[int, int], int], th1: dict[tuple[int, int], int], pids: list[int], wall: float, engines: int = 1
) -> dict[str, Any]:
    """For a multi-process facegate server, from two :func:`thread_ticks` snapshots ``wall`` seconds apart:
    cores per role (engine, front-end, supervisor), the role of the busiest thread, and the cores of each
    front-end process, busiest first (how evenly the front-ends share the work). Empty for other servers."""
    roles = process_roles(pids, engines)
    if "engine" not in roles.values():
        return {}
    cores: Counter[str] = Counter()
    per_front_end: Counter[int] = Counter()
    for (pid, tid), ticks in th1.items():
        role = roles.get(pid, "other")
        cores[role] += ticks - th0.get((pid, tid), 0)
        if role == "front-end":
            per_front_end[pid] += ticks - th0.get((pid, tid), 0)
    top = max(th1, key=lambda k: th1[k] - th0.get(k, 0))
    return {
        "cores_by_role": {r: round(v / CLK_TCK / wall, 3) for r, v in sorted(cores.items())},
        "top_thread_role": roles.get(top[0], "other"),
        "front_end_cores": sorted((round(v / CLK_TCK / wall, 3) for v in per_front_end.values()), reverse=True),
    }


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


class GpuMonitor:
    """Background sampler of one GPU's utilisation and memory through NVML (``nvidia-ml-py``: ``pynvml``)."""

    def __init__(self, index: int = 0, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []  # (t, util %, used MiB)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.handle: Any = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # no NVML: no GPU metrics (CPU runs)
            log.info("no GPU metrics: %s", exc)
            self.nvml = self.handle = None

    @property
    def available(self) -> bool:
        return self.nvml is not None

    def name(self) -> str:
        n = self.nvml.nvmlDeviceGetName(self.handle)
        return n.decode() if isinstance(n, bytes) else str(n)

    def read(self) -> tuple[float, float]:
        """(utilisation %, used MiB) now."""
        u = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        return float(u.gpu), self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20

    def processes(self) -> dict[int, float]:
        """``{pid: used MiB}`` of the compute processes on this GPU (what ``nvidia-smi`` lists)."""
        procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {int(p.pid): (p.usedGpuMemory or 0) / 2**20 for p in procs}

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                u, m = self.read()
                self.samples.append((time.perf_counter(), u, m))
            self._stop.wait(self.period_s)

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return {"gpu_util_mean": None, "gpu_util_max": None, "gpu_mem_used_max_mib": None, "gpu_samples": 0}
        u, m = np.array([x[1] for x in s]), max(x[2] for x in s)
        return {"gpu_util_mean": round(float(u.mean()), 1), "gpu_util_max": round(float(u.max()), 1),
                "gpu_mem_used_max_mib": round(m, 1), "gpu_samples": len(s)}  # fmt: skip


def gpu_index() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def process_gpu_mib(gpu: GpuMonitor, pids: list[int]) -> dict[str, Any]:
    """Driver-reported GPU memory of ``pids`` (summed) and every compute process seen."""
    try:
        procs = gpu.processes()
    except Exception as exc:
        return {"error": repr(exc)}
    mine = {p: round(v, 1) for p, v in procs.items() if p in set(pids)}
    return {"mib": round(sum(mine.values()), 1) if mine else None, "by_pid": mine, "all_pids": procs}


def bare_context_mib(gpu: GpuMonitor) -> dict[str, Any]:
    """GPU memory of a process that only does ``torch.cuda.init()`` and allocates one element."""
    code = (
        "import sys, torch; torch.cuda.init(); x = torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    used0 = gpu.read()[1]
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            return {"error": f"bare context process said {line!r}"}
        time.sleep(1.0)
        out = process_gpu_mib(gpu, [proc.pid])
        out["device_used_delta_mib"] = round(gpu.read()[1] - used0, 1)
        out["what"] = "torch.cuda.init(); torch.zeros(1, device='cuda')"
        return out
    finally:
        proc.kill()  # it holds nothing worth a clean exit
        proc.wait(timeout=20)


#: facegate histogram families whose sum/count deltas show where a request's time goes
_TIMING = re.compile(
    r"^facegate_(request_latency_seconds|engine_call_seconds|queue_wait_seconds|compute_seconds|batch_size)"
    r"_(sum|count)"
    r"\{([^}]*)\} ([0-9.e+-]+)",
    re.M,
)


#: families each front-end process records for itself (the engine families come from the engine processes,
#: and every front-end exports the same merged copy of them)
FRONT_END_FAMILIES = ("request_latency_seconds", "engine_call_seconds")


def _scrape_once(url: str) -> dict[str, Any] | None:
    """One ``/metrics`` answer parsed: ``{"pid", "hist", "gpu_memory_mib"}``; None when it failed."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    hist: dict[tuple[str, str], dict[str, float]] = {}
    for m in _TIMING.finditer(text):
        labels = ",".join(v for v in re.findall(r'="([^"]*)"', m.group(3)))
        hist.setdefault((m.group(1), labels), {})[m.group(2)] = float(m.group(4))
    gpu = {
        m.group(1): round(float(m.group(2)) / 2**20, 1)
        for m in re.finditer(r'^facegate_gpu_memory_bytes\{kind="(\w+)"\} ([0-9.e+-]+)', text, re.M)
    }
    pid = re.search(r'^facegate_process_info\{pid="(\d+)"\}', text, re.M)
    own = {
        k: float(m.group(1))
        for k, name in (("count", "requests"), ("sum", "request_seconds"))
        if (m := re.search(rf"^facegate_process_{name}_total\{{[^}}]*\}} ([0-9.e+-]+)", text, re.M))
    }
    return {"pid": pid.group(1) if pid else "?", "hist": hist, "gpu_memory_mib": gpu, "own": own}


def scrape_facegate(url: str, processes: int = 1) -> dict[str, Any]:
    """facegate's histogram sums/counts (latency, queue wait, compute per phase, batch size) and torch
    GPU memory from ``/metrics``: ``{"hist": {(family, labels): {"sum", "count"}}, "gpu_memory_mib",
    "by_pid": {pid: hist}}``.

    ``processes``: the server's front-end processes. They share one port, so one scrape reaches one of them
    at random; this scrapes until it has seen each (at most ``8 × processes`` scrapes) and keeps every
    process's own counters in ``by_pid``, which :func:`time_breakdown` adds up for the front-end families.
    """
    out: dict[str, Any] = {"hist": {}, "gpu_memory_mib": {}, "by_pid": {}}
    for _ in range(8 * max(processes, 1)):
        one = _scrape_once(url)
        if one is None:
            continue
        out["by_pid"].setdefault(one["pid"], one["hist"])
        if one["own"]:  # a server whose every scrape is the whole server's, with each front-end's own share
            out.setdefault("own_by_pid", {}).setdefault(one["pid"], one["own"])
        out["hist"], out["gpu_memory_mib"] = one["hist"], one["gpu_memory_mib"]
        if len(out["by_pid"]) >= processes:
            break
    return out


def _deltas(before: dict[str, Any], after: dict[str, Any], family: str) -> dict[str, tuple[float, float]]:
    """``{labels: (d_sum, d_count)}`` of one histogram family between two snapshots (count > 0 only).

    A front-end family is summed over the processes seen in both snapshots (their own counters); an engine
    family comes from the last scrape of each snapshot.
    """
    pairs = [(before.get("hist", {}), after.get("hist", {}))]
    whole_server = "own_by_pid" in after  # every scrape already sums the front-ends
    if family in FRONT_END_FAMILIES and not whole_server and before.get("by_pid") and after.get("by_pid"):
        common = sorted(set(before["by_pid"]) & set(after["by_pid"]))
        pairs = [(before["by_pid"][p], after["by_pid"][p]) for p in common]
    acc: dict[str, list[float]] = {}
    for b_hist, a_hist in pairs:
        for (fam, labels), a in a_hist.items():
            if fam == family:
                b = b_hist.get((fam, labels), {})
                dc = a.get("count", 0.0) - b.get("count", 0.0)
                if dc > 0:
                    t = acc.setdefault(labels, [0.0, 0.0])
                    t[0] += a.get("sum", 0.0) - b.get("sum", 0.0)
                    t[1] += dc
    return {labels: (t[0], t[1]) for labels, t in acc.items()}


def front_end_spread(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[float]]:
    """How the requests (``/metrics`` scrapes excluded) spread over the front-end processes that both
    :func:`scrape_facegate` snapshots reached: each one's share of the requests, largest first, and its mean
    in-server latency (ms) in the same order. Even shares: the front-ends got equal work."""
    per: list[tuple[float, float]] = []
    if "own_by_pid" in before and "own_by_pid" in after:
        for pid in sorted(set(before["own_by_pid"]) & set(after["own_by_pid"])):
            b, a = before["own_by_pid"][pid], after["own_by_pid"][pid]
            c, s = a.get("count", 0.0) - b.get("count", 0.0), a.get("sum", 0.0) - b.get("sum", 0.0)
            per.append((c, 1000.0 * s / c if c > 0 else 0.0))
    for pid in sorted(set(before.get("by_pid", {})) & set(after.get("by_pid", {}))) if not per else []:
        s = c = 0.0
        for (fam, labels), a in after["by_pid"][pid].items():
            if fam == "request_latency_seconds" and "/metrics" not in labels:
                b = before["by_pid"][pid].get((fam, labels), {})
                s += a.get("sum", 0.0) - b.get("sum", 0.0)
                c += a.get("count", 0.0) - b.get("count", 0.0)
        per.append((c, 1000.0 * s / c if c > 0 else 0.0))
    total = sum(c for c, _ in per) or 1.0
    per.sort(reverse=True)
    return {"share": [round(c / total, 3) for c, _ in per], "mean_ms": [round(m, 2) for _, m in per]}


def mean_batch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Mean executed batch size per stage between two :func:`scrape_facegate` snapshots."""
    return {st: round(s / c, 2) for st, (s, c) in _deltas(before, after, "batch_size").items()}


def time_breakdown(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Where facegate's time went between two snapshots.

    ``server_latency_ms``: mean in-server latency per route (client latency minus this ≈ HTTP, parsing and
    the client); ``engine_call_ms``: mean time from a service's submit to the answer per stage (minus the
    queue wait and the phases ≈ the transport and the waits between phases). Both are summed over the
    front-end processes that both snapshots reached (:func:`scrape_facegate`). ``queue_wait_ms``: mean wait
    of an item in each stage's queue; ``phase_ms_per_batch``: mean time per batch of each stage phase;
    ``phase_busy``: that phase's share of the wall clock
    (execute near 1.0 = the stage's worker is the bottleneck).
    """
    ms = lambda s, c: round(1000.0 * s / c, 3)  # noqa: E731
    return {
        "server_latency_ms": {r: ms(s, c) for r, (s, c) in _deltas(before, after, "request_latency_seconds").items()},
        "engine_call_ms": {st: ms(s, c) for st, (s, c) in _deltas(before, after, "engine_call_seconds").items()},
        "queue_wait_ms": {st: ms(s, c) for st, (s, c) in _deltas(before, after, "queue_wait_seconds").items()},
        "phase_ms_per_batch": {k: ms(s, c) for k, (s, c) in _deltas(before, after, "compute_seconds").items()},
        "phase_busy": {
            k: round(s / max(wall_s, 1e-9), 3) for k, (s, c) in _deltas(before, after, "compute_seconds").items()
        },
    }
