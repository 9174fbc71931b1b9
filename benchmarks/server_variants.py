"""The servers ``http_e2e.py`` can start, by name, and what each name changes.

facegate names:

* ``facegate``: one process, with the benchmark's ``--device``, ``--precision`` and ``--compile``;
* ``facegate_default``: ``facegate serve`` with no tuning flag at all, what a new user gets;
* ``facegate_profile_<name>``: ``facegate serve --profile <name>`` (``auto``, ``throughput``, ``low_memory``
  for ``low-memory``, ``cpu``), known only where the settings have a ``profile`` field;
* ``facegate_lowmem`` / ``facegate_lowmem_irse``: the smallest GPU footprint of the default models / of IR-SE-64;
* ``facegate_mp``: ``--mp-workers`` front-end processes and one engine process;
* ``facegate_mp_w<N>[_e<N>][_det64]``: ``N`` front-end processes, ``N`` engine processes on the one GPU, 64
  LFW-sized photos per detector forward (the hand-tuned configuration is ``facegate_mp_w8_e3_det64``).

The peers are ``naive`` (one model call per request) and ``litserve``.
"""

from __future__ import annotations

import re

#: the low-memory settings: eager kernels, small activation and arena budgets, host preprocessing
LOWMEM_ENV: dict[str, str] = {"FACEGATE_PROFILE": "low-memory"}

#: names whose whole meaning is their environment: name → environment of the server's processes
BASE_ENV: dict[str, dict[str, str]] = {
    "facegate": {},
    "facegate_default": {},
    "facegate_auto": {},
    "facegate_lowmem": LOWMEM_ENV,
    # IR-SE-64's smallest footprint (random weights, written by serve_memory.py --make-irse64 /tmp/irse64.pt;
    # no quality gate, so random-weight scores refuse nothing)
    "facegate_lowmem_irse": {
        **LOWMEM_ENV,
        "FACEGATE_RTS_CHECKPOINT": "/tmp/irse64.pt",
        "FACEGATE_QUALITY_THRESHOLD": "0.0",
    },
    "facegate_mp": {},
}

#: ``_det64``: 64 LFW photos per detector forward; the throughput plan (facegate.tuning) now sets this itself,
#: so the suffix adds no environment and only keeps result names comparable
DET64_ENV: dict[str, str] = {}
PEERS = ("naive", "litserve")
PROFILES = ("auto", "throughput", "low_memory", "cpu")
_COMPOSED = re.compile(r"^facegate_mp_w(\d+)(?:_e(\d+))?(_det64)?$")
_PROFILE = re.compile(r"^facegate_profile_([a-z_]+)$")


def profile_of(name: str) -> str | None:
    """The ``--profile`` value of server ``name`` (``low_memory`` → ``low-memory``), or None."""
    m = _PROFILE.match(name)
    return m.group(1).replace("_", "-") if m and m.group(1) in PROFILES else None


def _has_profiles() -> bool:
    """Whether this checkout's ``facegate serve`` takes ``--profile`` (its Settings have a ``profile``)."""
    from facegate.config import Settings

    return "profile" in Settings.model_fields


#: ``facegate ray``: Ray Serve with one GPU's worth of engine replicas (the plan's engines per GPU, each with that
#: share of the GPU; ``_eK``: K per GPU, ``_e1`` one replica on the whole GPU) and ``N`` ingress replicas
#: (``facegate_ray`` alone: 1).
RAY_NAME = re.compile(r"^facegate_ray(?:_w(\d+))?(?:_e(\d+))?$")


def ray_ingresses(name: str) -> int | None:
    """Ingress replicas of a ``facegate_ray[_wN]`` server, or None when ``name`` is not one."""
    m = RAY_NAME.match(name)
    return None if m is None else int(m.group(1) or 1)


def is_known(name: str) -> bool:
    """Whether ``http_e2e.py`` can start a server called ``name``."""
    if name in BASE_ENV or name in PEERS or _COMPOSED.match(name) or ray_ingresses(name) is not None:
        return True
    return profile_of(name) is not None and _has_profiles()


def server_env(name: str) -> dict[str, str]:
    """The environment variables that make server ``name`` differ from the default settings."""
    if name in BASE_ENV:
        return dict(BASE_ENV[name])
    m = RAY_NAME.match(name)
    if m is not None:
        return {"FACEGATE_ENGINES_PER_GPU": m.group(2)} if m.group(2) else {}
    m = _COMPOSED.match(name)
    return dict(DET64_ENV) if m is not None and m.group(3) else {}


def engines_of(name: str) -> int:
    """Engine processes of server ``name`` (``_eN``: N on the one GPU)."""
    m = _COMPOSED.match(name)
    return int(m.group(2)) if m and m.group(2) else 1


def front_ends_of(name: str, mp_workers: int) -> int:
    """Front-end (HTTP) processes of facegate server ``name``: ``_wN``'s N, ``mp_workers`` for
    ``facegate_mp``, 1 otherwise (a profile server's count is the profile's choice; it reports 1)."""
    m = _COMPOSED.match(name)
    if m is not None:
        return int(m.group(1))
    return mp_workers if name == "facegate_mp" else 1


def untuned(name: str) -> bool:
    """Whether server ``name`` gets no device, precision or compile flag: the settings choose them."""
    return name == "facegate_default" or profile_of(name) is not None
