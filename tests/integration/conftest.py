"""Integration fixtures: real uvicorn servers on loopback, driven with httpx.

A server runs the real app (:func:`facegate.api.app.create_app`) on ``uvicorn.Server`` in a thread of
this process (its own event loop), on a free 127.0.0.1 port, with the real
:class:`~facegate.service.faces.FaceService` of the registry's ``sface-tiny`` model (real YuNet detector,
tiny random-weight recognizer) for serving mechanics, and the real default models where a test says so. The
gallery is the real SQLite gallery under a temporary ``data_dir``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import BaseModel

from facegate.config import Settings

log = logging.getLogger(__name__)

#: LFW identities with several images (each ``<Name>/<Name>_NNNN.jpg``, 250×250).
PEOPLE = ("Colin_Powell", "George_W_Bush", "Tony_Blair", "Donald_Rumsfeld", "Gerhard_Schroeder")

#: Limits the test servers run with (small, so the "too large" tests send little data).
TEST_MAX_UPLOAD_BYTES = 256 * 1024
TEST_MAX_PIXELS = 1_000_000


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lfw_image(lfw_root: Path, name: str, n: int = 1) -> Path:
    """Path of ``lfw-deepfunneled/<name>/<name>_<n:04d>.jpg``."""
    return lfw_root / "lfw-deepfunneled" / name / f"{name}_{n:04d}.jpg"


def png_bytes(image: np.ndarray) -> bytes:
    """``(H, W, 3) uint8`` RGB → PNG bytes."""
    import cv2

    ok, buf = cv2.imencode(".png", np.ascontiguousarray(image[:, :, ::-1]))
    assert ok
    return buf.tobytes()


def jpeg_bytes(image: np.ndarray, quality: int = 90) -> bytes:
    """``(H, W, 3) uint8`` RGB → JPEG bytes."""
    import cv2

    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(image[:, :, ::-1]), [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


def grey_image(h: int = 240, w: int = 320, value: int = 128) -> np.ndarray:
    """A uniform grey ``(h, w, 3) uint8`` image (no face in it)."""
    return np.full((h, w, 3), value, np.uint8)


#: Settings' nested groups, by field name
GROUPS: dict[str, Any] = {
    name: f.annotation
    for name, f in Settings.model_fields.items()
    if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
}


def make_settings(tmp: Path, lfw_root: Path | None = None, **overrides: Any) -> Settings:
    """Settings for a test server: CPU, fp32, loopback, free port, data under ``tmp``."""
    kw: dict[str, Any] = {
        "device": "cpu",
        "precision": "fp32",
        "host": "127.0.0.1",
        "port": free_port(),
        "data_dir": tmp,
    }
    limits: dict[str, Any] = {
        "max_upload_bytes": TEST_MAX_UPLOAD_BYTES,
        "max_pixels": TEST_MAX_PIXELS,
        "max_images_per_request": 64,
        "allowed_roots": [lfw_root / "lfw-deepfunneled"] if lfw_root is not None else [],
    }
    groups: dict[str, dict[str, Any]] = {"limits": limits}
    for k, v in overrides.items():
        if k in GROUPS:  # a whole group: merged into the test's defaults
            groups.setdefault(k, {}).update(v)
            continue
        # a flat name of a nested group's field goes to its group
        group = next((g for g, model in GROUPS.items() if k in model.model_fields), None)
        if group is None:
            kw[k] = v
        else:
            groups.setdefault(group, {})[k] = v
    return Settings(**kw, **groups)


@dataclass
class Server:
    """A running facegate server (uvicorn in a thread)."""

    settings: Settings
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    @property
    def state(self) -> Any:
        from facegate.api.app import get_state

        return get_state(self.app)

    def client(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.url, **kw)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll /readyz until 200 (fails the test on timeout or a load error)."""
        deadline = time.monotonic() + timeout_s
        with self.client() as c:
            while time.monotonic() < deadline:
                r = c.get("/readyz")
                if r.status_code == 200:
                    return
                if self.state.load_error is not None:
                    pytest.fail(f"server failed to load: {self.state.load_error.to_dict()}")
                time.sleep(0.05)
        pytest.fail("server not ready in time")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "server thread did not stop"


def start_server(settings: Settings, service: Any = None, *, ready: bool = True) -> Server:
    """Start ``create_app(settings, service)`` on uvicorn in a thread; wait for it to listen."""
    import uvicorn

    from facegate.api.app import create_app, uvicorn_config

    app = create_app(settings, service)
    config = uvicorn_config(app, settings, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{settings.port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    srv = Server(settings=settings, app=app, server=server, thread=thread)
    if ready:
        srv.wait_ready()
    return srv


def tiny_service(settings: Settings) -> Any:
    """The real FaceService with the real detector and the tiny random-weight recognizer."""
    from facegate.service.faces import FaceService

    return FaceService.build(settings.model_copy(update={"model": "sface-tiny"}))


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start servers (stopped at teardown). ``factory(settings=None, service=..., tiny=True, **overrides)``."""
    started: list[Server] = []

    def factory(
        settings: Settings | None = None,
        *,
        service: Any = None,
        tiny: bool = True,
        ready: bool = True,
        **overrides: Any,
    ) -> Server:
        s = settings or make_settings(tmp_path / f"data{len(started)}", **overrides)
        if service is None and tiny:
            service = tiny_service(s)
        srv = start_server(s, service, ready=ready)
        started.append(srv)
        return srv

    yield factory
    for srv in reversed(started):
        with contextlib.suppress(Exception):
            srv.stop()


@pytest.fixture(scope="module")
def tiny_server(lfw_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One shared tiny-model server per test module (allowed root: LFW)."""
    settings = make_settings(tmp_path_factory.mktemp("tiny"), lfw_root)
    srv = start_server(settings, tiny_service(settings))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> Iterator[httpx.Client]:
    """An httpx client of the shared tiny server."""
    with tiny_server.client() as c:
        yield c


def files(**named: bytes | Path) -> list[tuple[str, tuple[str, bytes, str]]]:
    """Multipart ``files=`` list from ``field=bytes|path`` pairs."""
    out = []
    for field, v in named.items():
        data = v.read_bytes() if isinstance(v, Path) else v
        out.append((field, (f"{field}.jpg", data, "application/octet-stream")))
    return out


def many(field: str, items: list[bytes | Path]) -> list[tuple[str, tuple[str, bytes, str]]]:
    """Multipart ``files=`` list of several parts under one field."""
    out = []
    for i, v in enumerate(items):
        data = v.read_bytes() if isinstance(v, Path) else v
        out.append((field, (f"{field}{i}.jpg", data, "application/octet-stream")))
    return out


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert a JSON error response of ``status`` and ``code``; returns the inner error object."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["detail"], dict)
    assert "Traceback" not in r.text
    return err


def parse_metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a Prometheus text exposition."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lbl = head.partition("{")
        if metric != name:
            continue
        got = dict(
            (kv.split("=", 1)[0], kv.split("=", 1)[1].strip('"')) for kv in lbl.rstrip("}").split(",") if "=" in kv
        )
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        total += float(value)
        found = True
    if not found:
        raise KeyError(f"no sample {name}{labels or ''} in the exposition")
    return total


# --------------------------------------------------------------------------- `facegate serve` as a child process
# Signals are handled on a process's main thread only, so tests of SIGTERM, kill -9 and the process model run
# the real command line (real models on the CPU) instead of the in-thread servers above.
class ServeProcess:
    """One ``facegate serve`` process group (supervisor, and engine and front-ends when ``workers`` ≥ 2)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        workers: int = 1,
        engines: int = 1,
        device: str = "cpu",
        env: dict[str, str | None] | None = None,
        port: int = 0,
    ) -> None:
        """``env``: variables on top of this process's and the defaults below; ``None`` removes one."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / f"serve-{self.port}.log"
        argv = [sys.executable, "-m", "facegate", "serve", "--device", device, "--port", str(self.port)]
        for flag, n in (("--workers", workers), ("--engines", engines)):
            if n > 1:
                argv += [flag, str(n)]
        full_env = {**os.environ, "FACEGATE_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*argv, "--data-dir", str(data_dir)],
            env={k: v for k, v in full_env.items() if v is not None},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill of the group reaches every process of it
        )

    def client(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 120.0)
        return httpx.Client(base_url=self.url, **kw)

    def wait_ready(self, timeout_s: float = 180.0) -> dict[str, Any]:
        """Poll /readyz until 200; returns its body."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.log()[-3000:]}"
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200:
                    return dict(r.json())
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready within {timeout_s:.0f} s"
            time.sleep(0.2)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def pids(self) -> list[int]:
        """Every live process of the group."""
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return [int(x) for x in out]

    def kill_group(self) -> None:
        """SIGKILL every process of the group and wait until they are gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (uvicorn's graceful shutdown: the lifespan stops the engine, closes the gallery); returns rc."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        return int(self.close())

    def close(self) -> Any:
        if self.proc.poll() is None:
            self.kill_group()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def fg() -> SimpleNamespace:
    """The helpers of this module, for test files (``fg.files(...)``, ``fg.assert_error(...)``, ...)."""
    return SimpleNamespace(
        PEOPLE=PEOPLE,
        TEST_MAX_UPLOAD_BYTES=TEST_MAX_UPLOAD_BYTES,
        TEST_MAX_PIXELS=TEST_MAX_PIXELS,
        Server=Server,
        ServeProcess=ServeProcess,
        assert_error=assert_error,
        files=files,
        free_port=free_port,
        grey_image=grey_image,
        jpeg_bytes=jpeg_bytes,
        lfw_image=lfw_image,
        make_settings=make_settings,
        many=many,
        parse_metric=parse_metric,
        png_bytes=png_bytes,
        start_server=start_server,
        tiny_service=tiny_service,
    )
