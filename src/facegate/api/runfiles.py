"""Run folders of a multi-process server (sockets, metrics files) and the removal of those a killed one left.

Each folder is named ``facegate-<kind>-<supervisor pid>-<random>`` in the temporary directory, so that the next
start can tell a live server's folder from a killed one's. Shared memory needs no sweep (its blocks are unnamed).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

_NAME = re.compile(r"^facegate-(?:engine|accept|metrics)-(\d+)-[A-Za-z0-9_]+$")


def make(kind: Literal["engine", "accept", "metrics"]) -> Path:
    """A new private (mode 0700) run folder of ``kind`` named after this process."""
    return Path(tempfile.mkdtemp(prefix=f"facegate-{kind}-{os.getpid()}-"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale(root: Path | None = None) -> list[Path]:
    """Delete this user's run folders whose supervisor pid no process has; returns them."""
    root = Path(root or tempfile.gettempdir())
    removed: list[Path] = []
    uid = os.getuid()
    for folder in root.glob("facegate-*-*"):
        m = _NAME.match(folder.name)
        try:
            if m is None or not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != uid:
                continue
        except OSError:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.info("removed %d run folder(s) left by a server that did not stop cleanly", len(removed))
    return removed
