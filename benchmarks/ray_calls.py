"""CPU and time per engine call from an ingress to an engine replica: by reference (Ray actor calls), by value
(Serve's gRPC), and local (the engine replica's Unix socket, facegate's shared-memory transport).

A caller replica sends ``submit_many`` calls through :class:`~facegate.scaleout.ray_engine.RayEngine`'s two
handles to a stub engine replica that answers each item with a 129-float result (an embedding and its quality)
and no compute, ``--in-flight`` calls at once, like the ingress's calls to an engine replica; ``local`` sends the
same items through ``RayEngine.submit`` over the replica's Unix socket (one message per item, answered by a stub
engine behind the replica's EngineHost). It reports each side's process CPU (user + system) per call and the wall
time per call, for ``--items`` items of one 112×112×3 aligned crop each; ``--in-flight 1``: the wall time is a
call's latency. Both replicas run on one local Ray node, on the event-loop settings the application uses.

CPU (2 cores):
  python benchmarks/ray_calls.py --out benchmarks/results/ray_calls-cpu2.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json

log = logging.getLogger("ray_calls")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _AtOnce:
    """The engine behind the stub replica's Unix socket: every item answered when it is queued."""

    request_timeout_s = 5.0

    def enqueue(self, stage: str, payload: np.ndarray, future: Any) -> Any:
        from facegate.engine.batcher import WorkItem

        future.set_result(np.zeros(129, np.float32))
        return WorkItem(payload, future, deadline=1e18)


class StubEngine:
    """``submit_many`` as the engine replica answers it, without an engine; its Unix socket as the replica's."""

    def __init__(self) -> None:
        import tempfile
        import threading
        from multiprocessing.connection import Listener

        from facegate.scaleout.ray_engine import machine_id
        from facegate.transport.remote import EngineHost

        address, key = os.path.join(tempfile.mkdtemp(prefix="ray-calls-"), "engine.sock"), os.urandom(32)
        self.listener = Listener(address, family="AF_UNIX", authkey=key)
        host = EngineHost(type("Service", (), {"engine": _AtOnce()})(), {"model": "stub"})
        threading.Thread(target=host.serve, args=(self.listener,), daemon=True).start()
        self.local = {"machine": machine_id(), "address": address, "authkey": key.hex()}

    async def submit_many(self, stage: str, payloads: list[np.ndarray]) -> tuple[str, Any]:
        return ("stub", [("ok", np.zeros(129, np.float32)) for _ in payloads])

    async def info(self) -> tuple[str, Any]:
        return ("stub", {"model": "stub", "device": "cpu", "local": self.local})

    async def cpu_s(self) -> tuple[str, Any]:
        return ("stub", _cpu_s())


class Caller:
    """Times ``calls`` calls of ``items`` crops through one of RayEngine's handles."""

    def __init__(self, engine: Any) -> None:
        from facegate.scaleout.ray_engine import RayEngine

        self.remote = RayEngine(engine, local=True)

    async def run(self, mode: str, items: int, calls: int, in_flight: int) -> dict[str, Any]:
        await self.remote.astart()  # connects the local path (the others do not use it)
        handle = self.remote._direct if mode == "by_value" else self.remote._handle
        crops = [np.random.default_rng(i).integers(0, 255, (1, 112, 112, 3), np.uint8) for i in range(items)]
        gate = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with gate:
                if mode == "local":
                    await asyncio.gather(*[self.remote.submit("embed", c) for c in crops])
                else:
                    await self.remote._call("submit_many", "embed", crops, handle=handle)

        await asyncio.gather(*[one() for _ in range(max(20, calls // 10))])  # warm: channels, caches
        callee0, caller0, t0 = await self.remote._call("cpu_s"), _cpu_s(), time.perf_counter()
        await asyncio.gather(*[one() for _ in range(calls)])
        wall, caller = time.perf_counter() - t0, _cpu_s() - caller0
        callee = (await self.remote._call("cpu_s"))[2] - callee0[2]
        return {
            "mode": mode, "items": items, "calls": calls, "in_flight": in_flight,
            "caller_cpu_ms_per_call": round(1000 * caller / calls, 3),
            "callee_cpu_ms_per_call": round(1000 * callee / calls, 3),
            "wall_ms_per_call": round(1000 * wall / calls, 3),
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", default="1,8,32", help="items per call (comma-separated)")
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternating")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ray_calls-cpu2.json"))
    o = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from facegate.scaleout.ray_app import SAME_LOOP

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, _system_config={"worker_niceness": 0})
    rows: list[dict[str, Any]] = []
    try:
        serve.start(proxy_location="Disabled")
        opts = {"num_cpus": 0, "runtime_env": SAME_LOOP}
        quiet = {"enable_access_log": False}  # as the engine deployment: no log line per call
        stub = serve.deployment(
            StubEngine, name="engine", max_ongoing_requests=256, ray_actor_options=opts, logging_config=quiet
        )
        caller = serve.deployment(Caller, name="caller", ray_actor_options=opts, logging_config=quiet)
        handle = serve.run(caller.bind(stub.bind()), name="ray_calls", route_prefix=None)
        handle.run.remote("by_value", 1, 10, 1).result()  # RayEngine started, both routers warm
        for n in (int(x) for x in o.items.split(",")):
            for _ in range(o.rounds):
                for mode in ("by_reference", "by_value", "local"):
                    row = handle.run.remote(mode, n, o.calls, o.in_flight).result()
                    log.info("%s", row)
                    rows.append(row)
    finally:
        serve.shutdown()
        ray.shutdown()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o).items()}
    write_json(o.out, {"benchmark": "ray_calls", "command": " ".join(["python", *sys.argv]), "rows": rows,
                       "env": env_record(**config)})  # fmt: skip
    log.info("wrote %s", o.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
