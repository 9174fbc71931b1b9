"""The servers ``http_e2e.py`` can start, by name, and the settings each name changes.

A facegate name is a base (``facegate``, ``facegate_nobatch``, ``facegate_lowmem``, ``facegate_mp`` and its
single-change variants) or a composed multi-process name ``facegate_mp_w<N>[_e<N>][_det64][_<variant>...]``:
``N`` front-end processes, ``N`` engine processes on the one GPU, 64 LFW photos per detector forward, then
any of :data:`VARIANT_ENV`'s suffixes, each an A/B of one setting against the default. The peers are
``naive`` and ``litserve``.
"""

from __future__ import annotations

import re

#: the low-memory serving plan (facegate.tuning: eager fp16, bounded activations in one arena, host photos)
LOWMEM_ENV: dict[str, str] = {"FACEGATE_PROFILE": "low-memory"}

#: bases whose whole name is one A/B: name → environment of the server's processes
BASE_ENV: dict[str, dict[str, str]] = {
    "facegate": {},
    "facegate_auto": {},  # no tuning flags: the serving plan (facegate.tuning) chosen for the machine
    "facegate_nobatch": {},  # --max-batch-size 1
    "facegate_lowmem": LOWMEM_ENV,
    # IR-SE-64's smallest footprint (random weights, written by serve_memory.py --make-irse64 /tmp/irse64.pt;
    # no quality gate, so random-weight scores refuse nothing); the plan sizes its budget and arena
    "facegate_lowmem_irse": {
        **LOWMEM_ENV,
        "FACEGATE_RTS_CHECKPOINT": "/tmp/irse64.pt",
        "FACEGATE_QUALITY_THRESHOLD": "0.0",
    },
    "facegate_mp": {},
    "facegate_mp_hostpre": {"FACEGATE_GPU_PREPROCESS": "off"},  # photos decoded and aligned by the front-ends
}

#: suffix of a composed name → environment of the server's processes (one setting against its default)
VARIANT_ENV: dict[str, dict[str, str]] = {
    "hostpre": {"FACEGATE_GPU_PREPROCESS": "off"},  # photos decoded and aligned by the front-ends
}

#: ``_det64``: 64 LFW photos per detector forward, which the throughput plan already uses on CUDA
DET64_ENV: dict[str, str] = {}
PEERS = ("naive", "litserve")
_COMPOSED = re.compile(r"^facegate_mp_w(\d+)(?:_e(\d+))?(_det64)?((?:_[a-z0-9]+)*)$")


def _variants(name: str) -> list[str] | None:
    """The variant suffixes of a composed name, or None when ``name`` is not one."""
    m = _COMPOSED.match(name)
    if m is None:
        return None
    return [s for s in m.group(4).split("_") if s]


def is_known(name: str) -> bool:
    """Whether ``http_e2e.py`` can start a server called ``name``."""
    if name in BASE_ENV or name in PEERS:
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
