"""The servers ``http_e2e.py`` can start, by name, and the settings each name changes.

A facegate name is a base (``facegate``, ``facegate_nobatch``, ``facegate_gil5``, ``facegate_mp`` and its
single-change variants) or a composed multi-process name ``facegate_mp_w<N>[_e<N>][_det64][_<variant>...]``:
``N`` front-end processes, ``N`` engine processes on the one GPU, 64 LFW photos per detector forward, then
any of :data:`VARIANT_ENV`'s suffixes, each an A/B of one setting against the default. The peers are
``naive`` and ``litserve``.
"""

from __future__ import annotations

import re

#: the low-memory settings (docs/benchmarks.md, memory; serve_memory runs 47-51 measured all but the last)
LOWMEM_ENV: dict[str, str] = {
    "FACEGATE_COMPILE": "off",
    "FACEGATE_ACTIVATION_BUDGET_MIB": "16",
    "FACEGATE_GPU_ARENA_MIB": "32",
    "FACEGATE_DET_MAX_BATCH_PIXELS": str(256 * 256),
    "FACEGATE_GPU_PREPROCESS": "off",
    "FACEGATE_SHARED_DEVICE_THREAD": "true",
}

#: bases whose whole name is one A/B: name → environment of the server's processes
BASE_ENV: dict[str, dict[str, str]] = {
    "facegate": {},
    "facegate_nobatch": {},  # --no-batching
    "facegate_gil5": {"FACEGATE_GIL_SWITCH_INTERVAL_MS": "5"},  # Settings.gil_switch_interval_ms: Python's 5 ms
    # the smallest GPU footprint of the default models: one device thread for the build, warm-up and every stage
    "facegate_lowmem": LOWMEM_ENV,
    # ... with a device thread per engine stage, as before session 15 (HTTP run 51: +76 MiB after load)
    "facegate_lowmem_perstage": {**LOWMEM_ENV, "FACEGATE_SHARED_DEVICE_THREAD": "false"},
    # IR-SE-64's smallest footprint (random weights, written by serve_memory.py --make-irse64 /tmp/irse64.pt;
    # no quality gate, so random-weight scores refuse nothing)
    "facegate_lowmem_irse": {
        **LOWMEM_ENV,
        "FACEGATE_RTS_CHECKPOINT": "/tmp/irse64.pt",
        "FACEGATE_ACTIVATION_BUDGET_MIB": "24",
        "FACEGATE_GPU_ARENA_MIB": "112",
        "FACEGATE_QUALITY_THRESHOLD": "0.0",
    },
    "facegate_mp": {},
    "facegate_mp_pools": {"FACEGATE_CPU_THREADS": "0"},  # torch's and OpenCV's default thread pools
    "facegate_mp_hostpre": {"FACEGATE_GPU_PREPROCESS": "off"},  # photos decoded and aligned by the front-ends
    "facegate_mp_gc": {"FACEGATE_GC_FREEZE": "false"},  # Python's default garbage collector
    # uvicorn's pure-Python fallbacks for the HTTP parser and the event loop
    "facegate_mp_h11": {"FACEGATE_HTTP_PARSER": "h11", "FACEGATE_EVENT_LOOP": "asyncio"},
}

#: suffix of a composed name → environment of the server's processes (one setting against its default)
VARIANT_ENV: dict[str, dict[str, str]] = {
    "detexec": {"FACEGATE_PHOTO_DETECT_IN_PREPARE": "false"},  # detection inside execute
    "devsel": {"FACEGATE_PHOTO_SELECT_ON_DEVICE": "true"},  # NMS, choice and alignment on the GPU
    "hostsel": {"FACEGATE_PHOTO_SELECT_ON_DEVICE": "false"},  # ... and on the host
    "nofuse": {"FACEGATE_FUSED_EPILOGUES": "false"},  # SFace's conv bias and PReLU as two kernels
    "nodw": {"FACEGATE_FUSED_DEPTHWISE": "false"},  # YuNet's depthwise conv, biases and ReLU unfused
    "hostdec": {"FACEGATE_PHOTO_DECODE": "host"},  # Pillow on engine threads instead of nvJPEG
    "b3": {"FACEGATE_GRAPH_BUCKETS": "[4,16,64]"},  # the three buckets before session 10 (no 32)
    "noaff": {"FACEGATE_COMPARE_SAME_ENGINE": "false"},  # each photo to the least busy engine
    "nofast": {"FACEGATE_FAST_PATH": "false"},  # aligned-crop embeds through FastAPI's routing as well
    "onedev": {"FACEGATE_SHARED_DEVICE_THREAD": "true"},  # one device thread (the default since run 53)
    "perstage": {"FACEGATE_SHARED_DEVICE_THREAD": "false"},  # a device thread per stage (default before session 15)
    "warpall": {"FACEGATE_PHOTO_WARP_MIB": "1048576"},  # the photo stage warps a whole batch at once (as before)
    "shared": {"FACEGATE_ACCEPT": "shared"},  # uvicorn's shared listening socket instead of balanced accept
    "sa": {"FACEGATE_ACCEPT": "shared", "UV_TCP_SINGLE_ACCEPT": "1"},  # ... with libuv sleeping after each accept
}

DET64_ENV = {"FACEGATE_DET_MAX_BATCH_PIXELS": str(64 * 256 * 256)}
PEERS = ("naive", "litserve")
_COMPOSED = re.compile(r"^facegate_mp_w(\d+)(?:_e(\d+))?(_det64)?((?:_[a-z0-9]+)*)$")


def _variants(name: str) -> list[str] | None:
    """The variant suffixes of a composed name, or None when ``name`` is not one."""
    m = _COMPOSED.match(name)
    if m is None:
        return None
    return [s for s in m.group(4).split("_") if s]


#: ``facegate ray``: Ray Serve with one engine replica and ``N`` ingress replicas (``facegate_ray`` alone: 1).
RAY_NAME = re.compile(r"^facegate_ray(?:_w(\d+))?$")


def ray_ingresses(name: str) -> int | None:
    """Ingress replicas of a ``facegate_ray[_wN]`` server, or None when ``name`` is not one."""
    m = RAY_NAME.match(name)
    return None if m is None else int(m.group(1) or 1)


def is_known(name: str) -> bool:
    """Whether ``http_e2e.py`` can start a server called ``name``."""
    if name in BASE_ENV or name in PEERS or ray_ingresses(name) is not None:
        return True
    variants = _variants(name)
    return variants is not None and all(v in VARIANT_ENV for v in variants)


def server_env(name: str) -> dict[str, str]:
    """The environment variables that make server ``name`` differ from the default settings."""
    if name in BASE_ENV:
        return dict(BASE_ENV[name])
    env: dict[str, str] = {}
    m = _COMPOSED.match(name)
    if m is not None:
        if m.group(3):
            env.update(DET64_ENV)
        for v in _variants(name) or []:
            env.update(VARIANT_ENV[v])
    return env


def engines_of(name: str) -> int:
    """Engine processes of server ``name`` (``_eN``: N on the one GPU)."""
    m = _COMPOSED.match(name)
    return int(m.group(2)) if m and m.group(2) else 1


def front_ends_of(name: str, mp_workers: int) -> int:
    """Front-end (HTTP) processes of facegate server ``name``: ``_wN``'s N, ``mp_workers`` for the other
    ``facegate_mp*`` bases, 1 for a single-process server."""
    m = _COMPOSED.match(name)
    if m is not None:
        return int(m.group(1))
    return mp_workers if name.startswith("facegate_mp") else 1
