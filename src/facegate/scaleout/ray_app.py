"""facegate on Ray Serve (:func:`build_app`; ``deploy/ray/serve.yaml`` through :func:`app_builder`).

:class:`EngineReplica` runs one facegate engine (its own batching and deadlines; the plan's ``engines_per_gpu``
replicas per GPU). :class:`Ingress` serves ``facegate serve``'s FastAPI app with uvicorn over a
:class:`~facegate.scaleout.ray_engine.RayEngine`, without torch. Responses carry ``x-facegate-replica``,
``x-facegate-engine-replicas`` and ``x-facegate-engine-retries`` (calls resent because a replica died). A replica
whose engine or HTTP server stopped fails ``check_health``; a removed one drains for ``drain_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import threading
import time
from multiprocessing.connection import Listener
from typing import Any

import numpy as np
from ray import serve
from ray.serve.handle import DeploymentHandle

from facegate.config import Settings
from facegate.errors import DeadlineExceededError
from facegate.scaleout.ray_engine import RayEngine, machine_id, record_replicas
from facegate.transport.remote import SWITCH_INTERVAL_S, EngineHost, engine_info, outcome

log = logging.getLogger(__name__)

#: Engine calls a replica accepts at once (each of many items: the engine's own queue bound sheds load).
ENGINE_ONGOING = 256
#: A replica's code and its handles' router on Serve's one event loop: two thread hops less per handle call.
SAME_LOOP = {
    "env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
}
APP_NAME = "facegate"


def _bind_replica_grpc_to_node_address() -> None:
    """Make the replicas' gRPC server (Serve binds ``[::]:0``) listen on the node's Ray address only; a Ray
    without this private name keeps its default."""
    with contextlib.suppress(ImportError):
        from ray.serve._private import replica as serve_replica

        original = getattr(serve_replica, "add_port_to_grpc_server", None)
        if original is None:
            return

        def add_port(server: Any, address: str) -> int:
            if address.startswith("[::]:"):
                import ray.util

                host = ray.util.get_node_ip_address()
                address = f"[{host}]:{address[5:]}" if ":" in host else f"{host}:{address[5:]}"
            return int(original(server, address))

        serve_replica.add_port_to_grpc_server = add_port


_bind_replica_grpc_to_node_address()


class EngineReplica:
    """One facegate engine as a Serve replica, from the :class:`~facegate.config.Settings` as JSON. Every method
    answers ``(replica id, result)``."""

    async def __init__(self, settings_json: str) -> None:
        import ray

        from facegate.service.faces import FaceService
        from facegate.transport.run_dirs import make_run_dir, remove_stale_run_dirs
        from facegate.tuning import make_plan

        # as an engine process: its device thread and this replica's event loop (the gRPC calls) share the GIL
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        settings = Settings.model_validate_json(settings_json)
        t0 = time.perf_counter()
        plan = make_plan(settings)  # for the GPU Ray gave this replica (its only visible one), or the node's cores
        # the build blocks (weights, warm-up forwards): the replica's event loop stays free meanwhile
        self.service = await asyncio.get_running_loop().run_in_executor(None, FaceService.build, settings, plan)
        await self.service.start()
        self.replica = str(serve.get_replica_context().replica_id.unique_id)
        node = str(ray.get_runtime_context().get_node_id())
        self._info = engine_info(self.service, t0, replica=self.replica, pid=os.getpid(), node=node)
        # the ingress replicas of this machine send here, as `facegate serve`'s front-ends to its engines (see
        # RayEngine): a private directory, and a key that only this replica's info (through Serve) carries
        remove_stale_run_dirs()  # those of replicas (and servers) that were killed, so never removed their own
        self._dir = make_run_dir("engine")
        address, authkey = str(self._dir / "engine.sock"), os.urandom(32)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        host = EngineHost(self.service, dict(self._info))
        threading.Thread(target=host.serve, args=(self._listener,), name="facegate-engine-accept", daemon=True).start()
        self._info["local"] = {"machine": machine_id(), "address": address, "authkey": authkey.hex()}
        log.info("engine replica %s ready in %.1f s on %s", self.replica, self._info["startup_s"], self._info["device"])

    async def info(self) -> tuple[str, dict[str, Any]]:
        """Model, operating thresholds, device, stages, replica id, pid, Ray node id."""
        return self.replica, self._info

    async def submit_many(self, stage: str, payloads: list[np.ndarray]) -> tuple[str, list[tuple[Any, ...]]]:
        """``payloads`` through the engine's ``stage``: ``("ok", result)`` or ``("err", error_to_wire(exc))`` each.

        The items go straight onto the engine's queue with this loop's futures, which the engine settles once per
        batch: no task or timer per item. Their common deadline is the engine's request timeout; a cancelled call
        (its caller went away) drops the items not yet computed."""
        engine, loop = self.service.engine, asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        for payload in payloads:
            fut: asyncio.Future[Any] = loop.create_future()
            try:
                engine.enqueue(stage, payload, fut)
            except Exception as exc:  # a full queue or a stopped engine: this item only
                fut.set_exception(exc)
            futures.append(fut)
        timeout_s = engine.request_timeout_s
        try:
            await asyncio.wait(futures, timeout=timeout_s)  # a call carries one item at least
        finally:  # past the deadline, or cancelled because the caller left: the rest is not computed
            for fut in futures:
                fut.cancel()  # only those still waiting (a no-op on a done future); the engine skips them
        late = DeadlineExceededError(f"no result from stage {stage!r} within {timeout_s:g} s", detail={"stage": stage})
        return self.replica, [("err", late) if f.cancelled() else outcome(f.result) for f in futures]

    async def engine_samples(self) -> tuple[str, list[Any]]:
        return self.replica, self.service.stats.engine_samples()

    async def check_health(self) -> None:
        if not self.service.ready:
            raise RuntimeError(f"engine replica {self.replica}: the engine is not running")

    async def __del__(self) -> None:  # after the drain: stop the engine and its threads
        if (listener := getattr(self, "_listener", None)) is not None:
            with contextlib.suppress(OSError):
                listener.close()  # no new local connections; those open get their answers until the engine stops
        if (service := getattr(self, "service", None)) is not None:
            await service.stop()
        if (path := getattr(self, "_dir", None)) is not None:
            shutil.rmtree(path, ignore_errors=True)


class ReplicaHeaders:
    """ASGI wrapper adding the ``x-facegate-replica`` / ``-engine-replicas`` / ``-engine-retries`` headers."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with record_replicas() as served:

            async def send_with_headers(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    headers = message["headers"] = [*message.get("headers", []), (b"x-facegate-replica", self.replica)]
                    if served.replicas:
                        replicas = ",".join(dict.fromkeys(served.replicas)).encode()
                        headers.append((b"x-facegate-engine-replicas", replicas))
                    if served.retries:
                        headers.append((b"x-facegate-engine-retries", str(served.retries).encode()))
                await send(message)

            await self.app(scope, receive, send_with_headers)


class Ingress:
    """The facegate HTTP app on ``settings.host:settings.port`` over the ``engine`` deployment's handle.

    Each replica serves HTTP itself (the replicas of a node share the port through ``SO_REUSEPORT``) rather than
    behind Serve's HTTP proxy, a single process per node that costs CPU and one more handle call per request.
    ``local``: engine replicas on this machine are reached through their Unix sockets (see RayEngine).
    """

    async def __init__(self, engine: DeploymentHandle, settings_json: str, local: bool = True) -> None:
        import uvicorn

        from facegate.api.app import create_app, uvicorn_config
        from facegate.api.limits import Admission
        from facegate.api.multiprocess import listen
        from facegate.service.faces import FaceService
        from facegate.tuning import make_plan

        self.remote = remote = RayEngine(engine, local=local)
        info = await remote.astart()
        # the device is the engine's: this process never resolves "auto" itself (that would import torch)
        device = "cuda" if str(info["device"]).startswith("cuda") else "cpu"
        self.settings = s = Settings.model_validate_json(settings_json).model_copy(update={"device": device})
        self.replica = str(serve.get_replica_context().replica_id.unique_id)
        # an ingress admits the CPU plan's burst: SO_REUSEPORT hashes connections to the replicas with no regard to
        # load (`facegate serve`'s acceptor hands each to the least busy front-end), so the GPU plan's bound refuses
        plan = dataclasses.replace(make_plan(s), admission_queue_s=Admission.QUEUE_S)
        self.fastapi = create_app(s, service=FaceService.over_engine(s, remote), plan=plan)
        self.server = uvicorn.Server(uvicorn_config(ReplicaHeaders(self.fastapi, self.replica), s))
        sock = listen(s.host, s.port, reuse_port=True)
        self.serving = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:  # the app's lifespan start-up (a failure ends serve())
            if self.serving.done():
                raise RuntimeError(f"ingress replica {self.replica}: uvicorn stopped") from self.serving.exception()
            await asyncio.sleep(0.05)
        log.info("ingress replica %s on %s:%d, engine %s on %s", self.replica, s.host, s.port, info["model"], device)

    async def check_health(self) -> None:
        from facegate.api.app import get_state

        state = get_state(self.fastapi)
        if self.serving.done() or state.load_error is not None:
            raise RuntimeError(f"ingress replica {self.replica}: not serving ({state.load_error})")

    async def __del__(self) -> None:  # Serve removes the replica: drain as `facegate serve` does on SIGTERM
        from facegate.api.drain import DRAIN

        DRAIN.begin(self.settings.drain_s, asyncio.get_running_loop())
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.serving
        self.remote.stop()


def build_app(
    settings: Settings,
    *,
    engine_replicas: int = 1,
    max_engine_replicas: int | None = None,
    ingress_replicas: int = 1,
    engine_gpus: float | None = None,
) -> Any:
    """The Serve application: ``Ingress`` bound to ``EngineReplica``.

    ``engine_replicas``: GPUs' worth of engine replicas (``engines_per_gpu`` each; the minimum when autoscaling up
    to ``max_engine_replicas``); ``engine_gpus``: GPUs per such group (``None``: 1 if the cluster has GPUs, else 0).
    """
    import ray

    from facegate.tuning import make_plan

    if engine_gpus is None:
        engine_gpus = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    per_gpu = make_plan(settings).engines_per_gpu if engine_gpus > 0 else 1
    scaling: dict[str, Any] = {"num_replicas": engine_replicas * per_gpu}
    if max_engine_replicas is not None and max_engine_replicas > engine_replicas:
        scaling = {"autoscaling_config": {
            "min_replicas": engine_replicas * per_gpu, "max_replicas": max_engine_replicas * per_gpu,
            "target_ongoing_requests": 24, "upscale_delay_s": 10, "downscale_delay_s": 300,  # two ingresses' calls
        }}  # fmt: skip
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
    # Serve's autoscaler counts a replica's ongoing Serve requests, which the local path bypasses
    return ingress.bind(engine.bind(settings_json), settings_json, "autoscaling_config" not in scaling)


def app_builder(args: dict[str, Any]) -> Any:
    """The application of ``serve run`` / ``serve deploy`` (``deploy/ray/serve.yaml``): ``args`` are
    :func:`build_app`'s keywords (another is a TypeError); settings come from the ``FACEGATE_*`` environment
    (``runtime_env.env_vars``)."""
    return build_app(Settings(), **args)


def run(settings: Settings, *, address: str | None = None, metrics_port: int | None = None, **replicas: Any) -> None:
    """Serve the facegate application on Ray until SIGINT/SIGTERM (``facegate ray``). ``address``: a running
    cluster; ``None`` starts a node on 127.0.0.1 without a dashboard; ``metrics_port``: that node's Prometheus port;
    ``replicas``: :func:`build_app`'s keywords."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports to ray.io unless the user opts in
    if address is None:
        # Ray starts its workers at niceness 15, below every other process of the host (the load balancer, a
        # load generator, Ray's own daemons): the replicas are this node's work, so they run at the default 0
        metrics = {} if metrics_port is None else {"_metrics_export_port": metrics_port}
        ray.init(
            _node_ip_address="127.0.0.1", include_dashboard=False, _system_config={"worker_niceness": 0}, **metrics
        )
    else:
        ray.init(address=address)  # the cluster's own settings (dashboard, addresses) apply
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(proxy_location="Disabled")  # the ingress replicas serve HTTP (see Ingress)
        serve.run(build_app(settings, **replicas), name=APP_NAME, route_prefix=None)
        log.info("facegate on Ray Serve: http://%s:%d", settings.host, settings.port)
        stop.wait()
    finally:
        if address is None and _local_node_lost():
            # a signal to the whole process group (Ctrl-C, a container runtime) stopped the node started here too:
            # no controller is left to drain the replicas
            log.warning("the local Ray node has stopped; shutting down without a drain")
        else:
            closer = threading.Thread(target=serve.shutdown, name="facegate-serve-shutdown", daemon=True)
            closer.start()
            closer.join(settings.drain_s + 10.0)  # bounded: a cluster that went away cannot answer
        ray.shutdown()


def _local_node_lost(wait_s: float = 1.0) -> bool:
    """Whether a process of the node started here has exited (within ``wait_s``: the signal may be arriving)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    deadline = time.monotonic() + wait_s
    while node is not None and hasattr(node, "dead_processes"):
        if node.dead_processes():
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return False
