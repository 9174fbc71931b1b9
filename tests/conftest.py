"""Shared fixtures: LFW location, CUDA skip, small real images."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def _lfw_root() -> Path | None:
    root = os.environ.get("FACEGATE_LFW_ROOT")
    if root and (Path(root) / "pairs.txt").is_file():
        return Path(root)
    return None


@pytest.fixture(scope="session")
def lfw_root() -> Path:
    """LFW root; skips the test when FACEGATE_LFW_ROOT is not set to a folder holding pairs.txt."""
    root = _lfw_root()
    if root is None:
        pytest.skip("LFW not available: set FACEGATE_LFW_ROOT")
    return root


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


# --------------------------------------------------------------------------- a real PostgreSQL server
def _pg_bin(name: str) -> str | None:
    import shutil

    for cand in (shutil.which(name), f"/usr/local/bin/{name}"):
        if cand and Path(cand).exists():
            return cand
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(found[-1]) if found else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A throw-away PostgreSQL server on a free 127.0.0.1 port; yields its admin URL (database ``postgres``).

    ``initdb`` and the server refuse to run as root, so as root (CI) they run as the ``postgres`` user.
    Without the server binaries the tests skip, except under ``CI`` where they fail.
    """
    import pwd
    import shutil
    import socket
    import subprocess
    import tempfile

    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("PostgreSQL server binaries (initdb, pg_ctl) are missing on CI: apt-get install postgresql")
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed")
    prefix: list[str] = []
    # not under pytest's tmp folder: the postgres user must be able to reach it
    base = Path(tempfile.mkdtemp(prefix="facegate-pg-"))
    if os.geteuid() == 0:
        prefix = ["runuser", "-u", "postgres", "--"]
        pw = pwd.getpwnam("postgres")
        os.chmod(base, 0o755)
        os.chown(base, pw.pw_uid, pw.pw_gid)
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if prefix:
        os.chown(sock, pwd.getpwnam("postgres").pw_uid, pwd.getpwnam("postgres").pw_gid)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def run(*args: str) -> None:
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{args[0]} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")

    run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    run(pg_ctl, "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "-t", "60", "start")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the session's server; dropped after the test."""
    import uuid

    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = postgres_server.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
