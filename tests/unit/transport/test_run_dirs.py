"""Run folders: a killed server's or replica's is removed at the next start, a live one's stays."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from facegate.transport.run_dirs import make_run_dir, remove_stale_run_dirs


def test_run_folders_of_processes_gone_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray engine replica's socket folder is a run folder as `facegate serve`'s: a killed one's goes at the next
    start (its pid is gone); a live one's, and others, stay."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, other = tmp_path / f"facegate-engine-{int(gone.stdout)}-a", tmp_path / "unrelated"
    dead.mkdir()
    other.mkdir()
    live = make_run_dir("engine")  # this process's
    remove_stale_run_dirs()
    assert not dead.exists() and live.exists() and other.exists()


def test_a_folder_named_with_an_impossible_pid_does_not_stop_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pid past what the OS takes (a hand-made folder) made os.kill raise OverflowError, which ended the sweep
    at the server's start; no process can have it, so the folder is stale."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    odd = tmp_path / f"facegate-accept-{2**80}-x"
    odd.mkdir()
    remove_stale_run_dirs()
    assert not odd.exists()
