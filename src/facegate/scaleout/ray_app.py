"""facegate on Ray Serve: an HTTP ingress deployment in front of an engine deployment, on one host or many.

Two deployments make one Serve application (:func:`build_app`, or ``deploy/ray/serve.yaml`` through
:func:`app_builder`):

* :class:`EngineReplica`: one facegate engine per replica; a GPU takes as many replicas as ``facegate serve``
  runs engine processes on it (the serving plan's ``engines_per_gpu``, ``num_gpus`` a share of 1 each).
  It is the engine process of ``facegate serve --workers N``: a :class:`~facegate.service.faces.FaceService`
  built from the settings, so batching, CUDA graphs, the photo stage, deadlines and cancellation are
  facegate's own. Serve only routes calls to it (no ``@serve.batch``); each call carries many requests'
  items (:class:`~facegate.scaleout.ray_engine.RayEngine`), which join the engine's batcher.
* :class:`Ingress`: the FastAPI app of ``facegate serve`` (:func:`~facegate.api.app.create_app`: the same
  routes, limits, errors and metrics) served by uvicorn on ``settings.host:settings.port`` in each replica,
  whose engine is a :class:`~facegate.scaleout.ray_engine.RayEngine` over the engine deployment's handle.
  It loads no model and imports no torch. It opens the gallery the settings name (``FACEGATE_GALLERY_URL``),
  so every ingress replica shares one store of record. Serve's HTTP proxy is not used (see :class:`Ingress`).

Every response carries ``x-facegate-replica`` (the ingress replica) and, when the request reached the
engine, ``x-facegate-engine-replicas`` (the engine replicas that computed it), so an operator can tell which
replica answered; ``x-facegate-engine-retries`` counts calls sent again because their replica died.

Health: each replica's ``check_health`` fails once its engine stopped (or, for the ingress, once its server
stopped or its start-up failed); Serve then replaces it. Drain: Serve stops routing to a replica being
removed, waits for its ongoing calls (``graceful_shutdown_timeout_s``: the settings' ``drain_s``), then the
replica stops its engine; an ingress drains its HTTP requests as ``facegate serve`` does. Metrics:
``GET /metrics`` of the ingress exports the ingress's families and one engine replica's engine families;
Ray's own metrics (``ray_serve_*``: replicas, queue lengths) are on each node's Prometheus endpoint
(``--metrics-export-port``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from facegate.config import Settings
from facegate.scaleout.ray_engine import RayEngine, record_replicas
from facegate.transport.remote import error_to_wire

log = logging.getLogger(__name__)

#: Engine calls a replica accepts at once (each of many items: the engine's own queue bound sheds load).
ENGINE_ONGOING = 256
#: Serve runs a replica's code and its handles' router on one event loop (its throughput setting): two thread
#: hops less per handle call, about twice the items/s between two replicas on a 2-core box.
SAME_LOOP = {
    "env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
}
#: Name of the Serve application.
APP_NAME = "facegate"


def _bind_replica_grpc_to_node_address() -> None:
    """Make Serve replicas' inter-deployment gRPC server listen on the node's Ray address, not on every interface.

    Ray Serve starts that server in each replica on ``[::]:0`` whatever the node's address (replica.py,
    ``_on_initialized``), so a cluster bound to 127.0.0.1 still had one port per replica open on all
    interfaces. This module is imported in every replica before that server starts (the deployment classes
    live here); the wrapper swaps ``[::]`` for the node's address (``ray.util.get_node_ip_address()``, the
    address the node was started with), on which handles reach the replica. Nothing changes when the
    private name is not there (another Ray version): the server then keeps Ray's default.
    """
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_facegate_node_bound", False):
        return

    def add_port(server: Any, address: str) -> int:
        if address.startswith("[::]:"):
            import ray.util

            host = ray.util.get_node_ip_address()
            address = f"[{host}]:{address[5:]}" if ":" in host else f"{host}:{address[5:]}"
        return int(original(server, address))

    add_port._facegate_node_bound = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port


_bind_replica_grpc_to_node_address()


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a replica (local testing)
        return f"pid{os.getpid()}"


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


# --------------------------------------------------------------------------- engine deployment
class EngineReplica:
    """One facegate engine (models, batching engine) as a Serve replica.

    It gets the whole settings (``gallery_url`` included), so an engine that holds a gallery index opens and
    follows the store they name: a shared ``FACEGATE_GALLERY_URL`` makes every replica follow one gallery.

    Every method answers ``("ok", replica id, result)`` or ``("err", replica id, *error_to_wire(exc))``, so a
    facegate error reaches the ingress as the same class (and HTTP status) rather than a Ray task error.

    Args:
        settings_json: the :class:`~facegate.config.Settings` as JSON.
    """

    async def __init__(self, settings_json: str) -> None:
        from facegate.service.faces import FaceService
        from facegate.tuning import make_plan

        settings = Settings.model_validate_json(settings_json)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        plan = make_plan(settings)  # for the GPU Ray gave this replica (its only visible one)
        if plan.cpu_threads is None:  # a CPU engine: the node's cores, as `facegate serve`, not Ray's OMP_NUM_THREADS=1
            plan = dataclasses.replace(plan, cpu_threads=len(os.sched_getaffinity(0)))
        # the build blocks (weights, warm-up forwards): the replica's event loop stays free meanwhile
        self.service = await loop.run_in_executor(None, FaceService.build, settings, plan)
        p = self.service.pipeline
        info = {"model": p.spec.name, "device": str(p.device), "stages": [st.name for st in p.stages()],
                "operating": {"match_threshold": p.operating.match_threshold, "match_fmr": p.operating.match_fmr,
                              "quality_threshold": p.operating.quality_threshold}}  # fmt: skip
        await self.service.start()
        self.replica = _replica_id()
        self._info = {**info, "replica": self.replica, "pid": os.getpid(), "node": _node_id(),
                      "startup_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
        log.info("engine replica %s ready in %.1f s on %s", self.replica, self._info["startup_s"], info["device"])

    async def info(self) -> tuple[Any, ...]:
        """The engine's info: model, operating thresholds, device, stages, replica id, pid, Ray node id."""
        return ("ok", self.replica, self._info)

    async def submit_many(self, stage: str, payloads: list[Any]) -> tuple[Any, ...]:
        """``payloads`` through the engine's ``stage``, batched with every other caller's items: one
        ``("ok", result)`` or ``("err", *error_to_wire(exc))`` per payload."""
        submit = self.service.engine.submit
        results = await asyncio.gather(*[submit(stage, p) for p in payloads], return_exceptions=True)
        answers = [("err", *error_to_wire(r)) if isinstance(r, BaseException) else ("ok", r) for r in results]
        return ("ok", self.replica, answers)

    async def engine_samples(self) -> tuple[Any, ...]:
        """This replica's samples of the engine metric families."""
        return ("ok", self.replica, self.service.stats.engine_samples())

    async def check_health(self) -> None:
        """Raise (Serve then replaces the replica) once the engine has stopped."""
        if not self.service.ready:
            raise RuntimeError(f"engine replica {self.replica}: the engine is not running")

    async def __del__(self) -> None:
        # Serve calls this after the drain (no call is routed here any more): stop the engine and its threads
        service = getattr(self, "service", None)
        if service is not None:
            await service.stop()
            log.info("engine replica %s stopped", getattr(self, "replica", "?"))


# --------------------------------------------------------------------------- ingress deployment
class ReplicaHeaders:
    """ASGI wrapper: adds ``x-facegate-replica``, ``x-facegate-engine-replicas`` and (when an engine call was sent
    again after its replica died) ``x-facegate-engine-retries`` to every HTTP response."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with record_replicas() as served:

            async def send_with_headers(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (b"x-facegate-replica", self.replica)]
                    if served.replicas:
                        replicas = ",".join(dict.fromkeys(served.replicas)).encode()
                        headers.append((b"x-facegate-engine-replicas", replicas))
                    if served.retries:
                        headers.append((b"x-facegate-engine-retries", str(served.retries).encode()))
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, send_with_headers)


def _shared_socket(host: str, port: int) -> socket.socket:
    """The ingress replicas' listening socket, with ``SO_REUSEPORT``: the replicas of one node share
    ``host:port`` and the kernel spreads their connections (Linux lets only the same user share it)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048, reuse_port=True)


class Ingress:
    """The facegate HTTP app on ``settings.host:settings.port``, its engine calls going to the engine deployment.

    Each replica serves HTTP itself (uvicorn, as ``facegate serve``) rather than behind Serve's HTTP proxy:
    the proxy is one process per node and took 4.7 ms of CPU per compare on a 2-core box (about 200 req/s at
    most, against 2,400 for four ``facegate serve`` front-ends on the H200), and each request cost one more
    handle call from it to the ingress. Serve still places, checks, replaces and drains the replicas.

    Args:
        engine: the engine deployment's handle.
        settings_json: the :class:`~facegate.config.Settings` as JSON (gallery, limits, auth, host, port).
    """

    async def __init__(self, engine: DeploymentHandle, settings_json: str) -> None:
        import uvicorn

        from facegate.api.app import create_app, uvicorn_config
        from facegate.service.faces import FaceService

        remote = RayEngine(engine)
        info = await remote.astart()
        # the device is the engine's: this process never resolves "auto" itself (that would import torch)
        device = "cuda" if str(info["device"]).startswith("cuda") else "cpu"
        self.settings = Settings.model_validate_json(settings_json).model_copy(update={"device": device})
        self.replica = _replica_id()
        self.fastapi = create_app(self.settings, service=FaceService.over_engine(self.settings, remote))
        self.server = uvicorn.Server(uvicorn_config(ReplicaHeaders(self.fastapi, self.replica), self.settings))
        sock = _shared_socket(self.settings.host, self.settings.port)
        self.serving = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:  # the app's lifespan start-up (a failure ends serve())
            if self.serving.done():
                raise RuntimeError(f"ingress replica {self.replica}: uvicorn stopped") from self.serving.exception()
            await asyncio.sleep(0.05)
        log.info("ingress replica %s on %s:%d: engine %s on %s", self.replica, self.settings.host,
                 self.settings.port, info["model"], info["device"])  # fmt: skip

    async def check_health(self) -> None:
        """Raise (Serve then replaces the replica) when the server stopped or the app's start-up failed."""
        from facegate.api.app import get_state

        state = get_state(self.fastapi)
        if self.serving.done() or state.load_error is not None:
            raise RuntimeError(f"ingress replica {self.replica}: not serving ({state.load_error})")

    async def __del__(self) -> None:
        # Serve calls this when it removes the replica: drain as `facegate serve` does on SIGTERM
        from facegate.api.drain import DRAIN

        DRAIN.begin(self.settings.drain_s, asyncio.get_running_loop())
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.serving


# --------------------------------------------------------------------------- application
def build_app(
    settings: Settings,
    *,
    engine_replicas: int = 1,
    max_engine_replicas: int | None = None,
    ingress_replicas: int = 1,
    engine_gpus: float | None = None,
) -> Any:
    """The Serve application: ``Ingress`` bound to ``EngineReplica``.

    Args:
        settings: the settings every replica runs with.
        engine_replicas: GPUs' worth of engine replicas (the minimum, when autoscaling): on a GPU, the serving
            plan's ``engines_per_gpu`` replicas share it, one engine each.
        max_engine_replicas: above ``engine_replicas``: autoscale between the two on ongoing calls per replica.
        ingress_replicas: ingress replicas (CPU only).
        engine_gpus: GPUs per engine replica; ``None``: 1 when the cluster has GPUs, else 0.
    """
    import ray

    from facegate.tuning import make_plan

    if engine_gpus is None:
        engine_gpus = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    # on a GPU, `facegate serve` runs the plan's engines_per_gpu engine processes: here, as many replicas share it
    per_gpu = make_plan(settings).engines_per_gpu if engine_gpus > 0 else 1
    scaling: dict[str, Any] = {"num_replicas": engine_replicas * per_gpu}
    if max_engine_replicas is not None and max_engine_replicas > engine_replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": engine_replicas * per_gpu,
                "max_replicas": max_engine_replicas * per_gpu,
                "target_ongoing_requests": 8,  # two ingresses' calls in flight
                "upscale_delay_s": 10,
                "downscale_delay_s": 300,
            }
        }
    engine = serve.deployment(EngineReplica, name="engine").options(
        max_ongoing_requests=ENGINE_ONGOING,
        max_queued_requests=settings.limits.max_queue,
        ray_actor_options={"num_gpus": engine_gpus / per_gpu, "num_cpus": 1, "runtime_env": SAME_LOOP},
        health_check_period_s=5,
        health_check_timeout_s=30,
        logging_config={"enable_access_log": False},  # one line per engine call otherwise
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=settings.drain_s,
        **scaling,
    )
    ingress = serve.deployment(Ingress, name="ingress").options(
        num_replicas=ingress_replicas,
        ray_actor_options={"num_cpus": 1, "num_gpus": 0, "runtime_env": SAME_LOOP},
        health_check_period_s=5,
        graceful_shutdown_timeout_s=settings.drain_s,
    )
    settings_json = settings.model_dump_json()
    return ingress.bind(engine.bind(settings_json), settings_json)


def app_builder(args: dict[str, Any]) -> Any:
    """The application for ``serve run`` / ``serve deploy`` (``deploy/ray/serve.yaml``).

    ``args`` (all optional): ``engine_replicas``, ``max_engine_replicas``, ``ingress_replicas``,
    ``engine_gpus``. Settings come from the ``FACEGATE_*`` environment (``runtime_env.env_vars``).
    """
    known = {"engine_replicas", "max_engine_replicas", "ingress_replicas", "engine_gpus"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown facegate application args {sorted(unknown)}; known: {sorted(known)}")
    return build_app(Settings(), **args)


def loopback_init_kwargs() -> dict[str, Any]:
    """``ray.init`` / ``Cluster`` node arguments that keep a local node on 127.0.0.1 with no dashboard.

    Without ``node_ip_address`` Ray advertises the machine's interface address, and without
    ``include_dashboard=False`` it starts the dashboard process.
    """
    return {"_node_ip_address": "127.0.0.1", "include_dashboard": False}


def run(
    settings: Settings,
    *,
    address: str | None = None,
    engine_replicas: int = 1,
    max_engine_replicas: int | None = None,
    ingress_replicas: int = 1,
    metrics_port: int | None = None,
) -> None:
    """Serve the facegate application on Ray until SIGINT/SIGTERM (``facegate ray``).

    ``address``: a running cluster (``ray://…`` or ``host:port``; ``auto`` for the local one); ``None``
    starts a single-node cluster on 127.0.0.1 for this process. The ingress replicas listen on
    ``settings.host:settings.port``. ``metrics_port``: Ray's Prometheus endpoint of a node started here.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports to ray.io unless the user opts in
    if address is None:
        kw: dict[str, Any] = loopback_init_kwargs()
        if metrics_port is not None:
            kw["_metrics_export_port"] = metrics_port
        ray.init(**kw)
    else:
        ray.init(address=address)  # the cluster's own settings (dashboard, addresses) apply
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(proxy_location="Disabled")  # the ingress replicas serve HTTP (see Ingress)
        app = build_app(
            settings,
            engine_replicas=engine_replicas,
            max_engine_replicas=max_engine_replicas,
            ingress_replicas=ingress_replicas,
        )
        serve.run(app, name=APP_NAME, route_prefix=None)
        log.info("facegate on Ray Serve: http://%s:%d", settings.host, settings.port)
        stop.wait()
        log.info("stopping: draining the replicas")
    finally:
        if address is None and _local_node_lost():
            # a signal to the whole process group (Ctrl-C, a container runtime) stopped the Ray node this process
            # started as well: there is no controller left to drain the replicas
            log.warning("the local Ray node has stopped; shutting down without a drain")
        else:
            closer = threading.Thread(target=serve.shutdown, name="facegate-serve-shutdown", daemon=True)
            closer.start()
            closer.join(settings.drain_s + 10.0)  # bounded: a cluster that went away cannot answer
            if closer.is_alive():
                log.warning("Ray Serve did not shut down in %.0f s; stopping Ray", settings.drain_s + 10.0)
        ray.shutdown()


def _local_node_lost(wait_s: float = 1.0) -> bool:
    """Whether a process of the Ray node that ``ray.init`` started here has exited (polled for ``wait_s``: the
    signal that stops them may still be arriving)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is None or not hasattr(node, "dead_processes"):
        return False
    deadline = time.monotonic() + wait_s
    while True:
        if node.dead_processes():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
