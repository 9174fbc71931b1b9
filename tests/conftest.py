"""Shared fixtures: LFW location, CUDA skip, small real images."""

from __future__ import annotations

import os
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
