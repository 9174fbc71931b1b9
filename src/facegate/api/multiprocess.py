"""The process model of a plan with workers ≥ 2 or engines ≥ 2 (docs/architecture.md): the torch-free
supervisor starts the engines, then the front-ends (:func:`frontend_main`, fed by the :mod:`~facegate.api.acceptor`
thread, replaced when one exits), and exits non-zero when an engine dies, so that the whole server restarts.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from unittest.mock import patch  # os.environ for a block: a spawned child takes the environment of its start

from facegate.api.acceptor import Acceptor, FrontEndServer
from facegate.api.app import create_app, uvicorn_config
from facegate.api.drain import UVICORN_MARGIN_S
from facegate.config import Settings
from facegate.errors import InvalidParameterError, ModelError, ServerError
from facegate.logs import configure_logging
from facegate.metrics.prometheus import MULTIPROC_ENV, enable_multiprocess, process_exited
from facegate.service.faces import FaceService
from facegate.transport.remote import engine_main
from facegate.transport.run_dirs import make_run_dir, remove_stale_run_dirs
from facegate.tuning import ServingPlan, detect_machine, make_plan

log = logging.getLogger(__name__)


class EngineProcess:
    """An engine process: spawn, wait until warm, stop. ``cuda_device`` becomes its only visible GPU."""

    def __init__(
        self,
        settings: Settings,
        plan: ServingPlan | None = None,
        *,
        cuda_device: str | None = None,
        authkey: bytes | None = None,
    ) -> None:
        self.settings = settings
        self.plan = plan or make_plan(settings)
        self.cuda_device = cuda_device
        self.dir = make_run_dir("engine")
        self.address = str(self.dir / "engine.sock")
        self.authkey = authkey or secrets.token_bytes(32)
        self._proc: Any = None
        self._ready_conn: Any = None

    def spawn(self) -> None:
        """Start the process (returns at once; :meth:`wait` for it)."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited CUDA or thread state
        self._ready_conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=engine_main,
            args=(self.settings, self.plan, self.address, self.authkey, child, FaceService.build),
            name="facegate-engine",
            daemon=False,
        )
        with patch.dict(os.environ, {} if self.cuda_device is None else {"CUDA_VISIBLE_DEVICES": self.cuda_device}):
            self._proc.start()
        child.close()

    def wait(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until the process is ready; returns its info. Raises its start-up error, or ModelError when it
        died or was not ready within ``timeout_s``."""
        parent = self._ready_conn
        if not parent.poll(timeout_s):
            self.stop()
            raise ModelError(f"the engine process was not ready within {timeout_s:.0f} s")
        try:
            msg = parent.recv()
        except EOFError:
            self.stop()
            raise ModelError(f"the engine process exited during startup (exit code {self._proc.exitcode})") from None
        if msg[0] != "ready":
            self.stop()
            raise msg[1]
        log.info("engine process %d ready: %s", self._proc.pid, msg[1])
        return msg[1]  # type: ignore[no-any-return]

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self._proc is None else self._proc.exitcode

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the engine (it drains its queues), wait, then kill if needed; remove the socket folder."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                log.error("the engine process did not stop within %.0f s; killing it", timeout_s)
                self._proc.kill()
                self._proc.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def engine_devices(engines: int, per_gpu: int, on_cuda: bool) -> list[str | None]:
    """The CUDA device of each engine, ``per_gpu`` per GPU, from the first of CUDA_VISIBLE_DEVICES (else ``0..``);
    ``None`` (the default) off CUDA or on one GPU. InvalidParameterError when fewer GPUs are visible."""
    gpus = -(-engines // per_gpu)
    if not on_cuda or gpus == 1:
        return [None] * engines
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:  # the driver's count, without importing torch in the supervisor
        visible = [str(i) for i in range(detect_machine().gpus or gpus)]
    if len(visible) < gpus:
        raise InvalidParameterError(
            f"{engines} engines need {gpus} GPUs, {len(visible)} visible", detail={"visible": visible}
        )
    return [visible[i // per_gpu] for i in range(engines)]


def frontend_main(control_path: str, settings: Settings, plan: ServingPlan, engine: tuple[list[str], bytes]) -> None:
    """A front-end process: the app over the engines (``(socket paths, authkey)``) on the connections the
    supervisor's acceptor hands it."""
    if not logging.getLogger().handlers:
        configure_logging()
    enable_multiprocess()  # before the app's stats exist: /metrics of any front-end covers them all
    FrontEndServer(uvicorn_config(create_app(settings, engine=engine, plan=plan), settings), control_path).run()


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The public listening socket (IPv4 or IPv6 as ``host`` resolves), with SO_REUSEADDR (and SO_REUSEPORT);
    ServerError when the address cannot be bound (in use, not this host's)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048, reuse_port=reuse_port)
    except OSError as exc:
        raise ServerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", detail={"port": port}) from None


#: a front-end that exits within this many seconds of its start counts as failing at start-up
QUICK_EXIT_S = 10.0
#: this many such exits in a row stop the server (ServerError) instead of restarting front-ends forever
MAX_QUICK_EXITS = 5


def serve_balanced(
    settings: Settings,
    front_ends: int,
    args: tuple[Any, ...] = (),
    *,
    target: Callable[..., None] = frontend_main,
    engines: Sequence[EngineProcess] = (),
    sock: socket.socket,
) -> None:
    """Run ``front_ends`` processes ``target(control_path, *args)`` fed by an acceptor thread on ``sock`` (which it
    closes) until SIGINT/SIGTERM, replacing any that exits. ServerError after :data:`MAX_QUICK_EXITS` quick exits in
    a row, or when the acceptor thread stops; ModelError when one of ``engines`` dies (so that a supervisor restarts
    the server whole)."""
    folder = make_run_dir("accept")
    control = str(folder / "accept.sock")
    acceptor = Acceptor(sock, control)
    acceptor.start()
    ctx = mp.get_context("spawn")

    def spawn() -> tuple[Any, float]:
        p = ctx.Process(target=target, args=(control, *args), name="facegate-front-end", daemon=False)
        p.start()
        return p, time.monotonic()

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs = [spawn() for _ in range(front_ends)]
    quick = 0
    try:
        while not stop.wait(0.5):
            if not acceptor.alive:
                raise ServerError("the acceptor thread stopped: no connection can be accepted (see the log)")
            if dead := [e.exitcode for e in engines if not e.alive]:
                log.error("an engine process died (exit code %s): stopping the front-ends", dead[0])
                raise ModelError(f"the engine process died (exit code {dead[0]})", detail={"exit_code": dead[0]})
            for i, (p, started) in enumerate(procs):
                if p.is_alive() or stop.is_set():  # (Ctrl-C reaches the front-ends too)
                    continue
                quick = quick + 1 if time.monotonic() - started < QUICK_EXIT_S else 0
                if quick >= MAX_QUICK_EXITS:
                    raise ServerError(
                        f"{quick} front-end processes in a row exited within {QUICK_EXIT_S:.0f} s of their start "
                        f"(last exit code {p.exitcode}); see the log",
                        detail={"exit_code": p.exitcode},
                    )
                log.warning("front-end process %s exited (code %s); starting another", p.pid, p.exitcode)
                process_exited(p.pid)
                procs[i] = spawn()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        acceptor.stop()
        for p, _ in procs:  # SIGTERM: uvicorn's graceful shutdown in each
            if p.is_alive():
                p.terminate()
        for p, _ in procs:
            p.join(settings.drain_s + UVICORN_MARGIN_S + 5)
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(folder, ignore_errors=True)
        log.info("front-ends stopped; %d connections were handed out", acceptor.handed)


def run_multiprocess(settings: Settings, plan: ServingPlan) -> None:
    """Serve with ``plan.engines`` engines and ``plan.workers`` front-ends until interrupted; raises an engine's
    start-up error, or ModelError when an engine died."""
    remove_stale_run_dirs()
    devices = engine_devices(plan.engines, plan.engines_per_gpu, plan.device == "cuda")
    key = secrets.token_bytes(32)
    sock = listen(settings.host, settings.port)  # before the engines load: a port in use fails at once
    engines = [EngineProcess(settings, plan, cuda_device=d, authkey=key) for d in devices]
    metrics_dir = make_run_dir("metrics")  # this run's prometheus_client multiprocess files

    class _Stopped(BaseException):
        pass

    def _stop_start_up(*_: Any) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, _stop_start_up)  # the CLI made SIGTERM a no-op for uvicorn's re-raise
    try:
        try:
            for e in engines:  # spawned together, then waited for: one failing stops them all (finally)
                e.spawn()
            for e in engines:
                e.wait()
        except _Stopped:
            log.info("SIGTERM during start-up: stopping")
            return
        finally:
            signal.signal(signal.SIGTERM, previous)
        front_ends = max(2, plan.workers)
        url = f"http://{settings.host}:{settings.port}"
        log.info("facegate listening on %s with %d front-ends and %d engine process(es)", url, front_ends, len(engines))
        with patch.dict(os.environ, {MULTIPROC_ENV: str(metrics_dir)}):  # this run's metrics folder
            args = (settings, plan, ([e.address for e in engines], key))
            serve_balanced(settings, front_ends, args, engines=engines, sock=sock)
    finally:
        sock.close()
        for engine in engines:
            engine.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
