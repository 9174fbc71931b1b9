"""End-to-end fixtures: the real facegate server on loopback and Debian's chromium driven by Playwright.

* The browser is the system chromium (``/usr/bin/chromium``, or ``$FACEGATE_CHROMIUM``) launched through
  Python Playwright with ``executable_path``; ``playwright install`` is never needed. Tests skip with a
  reason when chromium or the ``playwright`` package is missing (``bash scripts/install-e2e.sh`` installs
  both).
* The server is :func:`facegate.api.app.create_app` on ``uvicorn.Server`` in a thread of this process,
  on a free 127.0.0.1 port, with a SQLite gallery under a temporary ``data_dir``. Models:
  the registry's ``sface-tiny`` (real YuNet detector, tiny random-weight recognizer) by default;
  ``FACEGATE_E2E_MODELS=real`` runs the real default models instead (slower to start; the tests then
  also check that two photos of one person match).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from facegate.config import Settings

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> Path | None:
    """The chromium binary to drive, or ``None`` when absent."""
    p = Path(os.environ.get("FACEGATE_CHROMIUM", "/usr/bin/chromium"))
    return p if p.is_file() and os.access(p, os.X_OK) else None


def use_real_models() -> bool:
    """``FACEGATE_E2E_MODELS=real`` selects the real default models (default: tiny)."""
    return os.environ.get("FACEGATE_E2E_MODELS", "tiny").lower() == "real"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class E2EServer:
    """A running facegate server (uvicorn in a thread)."""

    settings: Settings
    server: Any
    thread: threading.Thread
    real_models: bool

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def start_server(data_dir: Path, **overrides: Any) -> E2EServer:
    """Start the real app on a free loopback port and wait for ``/readyz`` (fails the test on timeout)."""
    import uvicorn

    from facegate.api.app import create_app, uvicorn_config
    from facegate.service.faces import FaceService

    kw: dict[str, Any] = {
        "device": "cpu",
        "precision": "fp32",
        "host": "127.0.0.1",
        "port": free_port(),
        "data_dir": data_dir,
    }
    kw.update(overrides)
    settings = Settings(**kw)
    real = use_real_models()
    tiny = settings.model_copy(update={"model": "sface-tiny"})
    service = None if real else FaceService.build(tiny)  # None: the app builds the real models
    app = create_app(settings, service)
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"e2e-uvicorn-{settings.port}", daemon=True)
    thread.start()
    srv = E2EServer(settings, server, thread, real)
    deadline = time.monotonic() + (300 if real else 120)
    last = "no answer"
    with srv.client() as c:
        while time.monotonic() < deadline:
            if not thread.is_alive():
                pytest.fail("the e2e server thread died during startup")
            with contextlib.suppress(httpx.HTTPError):
                r = c.get("/readyz")
                if r.status_code == 200:
                    return srv
                last = r.text[:300]
            time.sleep(0.1)
    srv.stop()
    pytest.fail(f"the e2e server did not become ready: {last}")


@pytest.fixture(scope="module")
def playwright_sync() -> Iterator[Any]:
    """A started Playwright driver; skips the e2e tests when chromium or playwright are missing."""
    if chromium_path() is None:
        pytest.skip("chromium not found at /usr/bin/chromium (run: bash scripts/install-e2e.sh)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("python package 'playwright' not installed (run: bash scripts/install-e2e.sh)")
    pw = sync_playwright().start()
    try:
        yield pw
    finally:
        pw.stop()


@pytest.fixture(scope="module")
def browser_context(playwright_sync: Any) -> Iterator[Any]:
    """A headless chromium context with a fresh user-data directory (removed afterwards)."""
    user_data = tempfile.mkdtemp(prefix="facegate-e2e-chromium-")
    try:
        ctx = playwright_sync.chromium.launch_persistent_context(
            user_data,
            executable_path=str(chromium_path()),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
            accept_downloads=False,
        )
    except Exception as exc:  # playwright.Error: the browser would not start here
        shutil.rmtree(user_data, ignore_errors=True)
        pytest.skip(f"chromium did not start under Playwright: {exc}")
    ctx.set_default_timeout(60_000)
    try:
        yield ctx
    finally:
        ctx.close()
        shutil.rmtree(user_data, ignore_errors=True)


@pytest.fixture
def page(browser_context: Any) -> Iterator[Any]:
    """A new tab; console errors and failed requests are collected on ``page.problems``."""
    pg = browser_context.new_page()
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("response", lambda r: problems.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)
    pg.problems = problems  # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        pg.close()


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., E2EServer]]:
    """Start servers for a test module (stopped at its end): ``factory(**settings_overrides)``."""
    started: list[E2EServer] = []

    def factory(**overrides: Any) -> E2EServer:
        srv = start_server(tmp_path_factory.mktemp("e2e-data"), **overrides)
        started.append(srv)
        return srv

    yield factory
    for srv in reversed(started):
        srv.stop()
