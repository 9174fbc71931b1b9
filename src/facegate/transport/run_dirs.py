"""Private run folders (engine sockets, the accept socket, metrics files) of a server or Ray replica, and the removal
of those a killed one left; torch- and HTTP-free, so that engine replicas need not import the API."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

_RUN_DIR = re.compile(r"^facegate-(?:engine|accept|metrics)-(\d+)-[A-Za-z0-9_]+$")


def make_run_dir(kind: Literal["engine", "accept", "metrics"]) -> Path:
    """A new private (mode 0700) run folder of ``kind``, ``facegate-<kind>-<pid>-<random>``: the next start can
    tell a killed server's from a live one's (:func:`remove_stale_run_dirs`)."""
    return Path(tempfile.mkdtemp(prefix=f"facegate-{kind}-{os.getpid()}-"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a number no pid can be
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def remove_stale_run_dirs() -> None:
    """Delete this user's run folders whose supervisor pid no process has."""
    removed = 0
    for folder in Path(tempfile.gettempdir()).glob("facegate-*-*"):
        m = _RUN_DIR.match(folder.name)
        try:
            if m is None or not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if (pid := int(m.group(1))) != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d run folder(s) left by a server that did not stop cleanly", removed)
