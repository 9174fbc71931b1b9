"""What a copy or a socket read costs a thread of a busy serving process: numpy's copies (which give the GIL
away) against ``facegate.io.memcopy``'s (which keep it), ``Connection.recv`` per message against
``FrameReader``, with and without other threads running Python code.

Cases, as the engine process meets them: a connection reader copying aligned crops out of a front-end's
shared-memory arena one request at a time (64 single-crop requests), and the embed stage's prepare stacking
a batch of 64 crops into its staging buffer (8 requests of 8 crops, or 64 of 1), and a connection reader
taking 256 submit messages off its socket. ``--busy`` threads loop in
Python bytecode meanwhile (the readers, senders and stage threads of the engine process), with the serving
processes' switch interval of 1 ms. Per case, the median of ``--repeat`` timings in each of ``--rounds``
rounds (the cases interleave).

python benchmarks/gil_copy.py --out benchmarks/results/gil_copy_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.io.memcopy import copy_out, pack_rows


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 4)


def cases() -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(0)
    crop = (112, 112, 3)
    arena = memoryview(bytearray(64 * int(np.prod(crop))))
    offsets = [i * int(np.prod(crop)) for i in range(64)]
    eights = [rng.integers(0, 255, (8, *crop), dtype=np.uint8) for _ in range(8)]
    ones = [rng.integers(0, 255, (1, *crop), dtype=np.uint8) for _ in range(64)]
    out = np.empty((64, *crop), np.uint8)
    return {
        "reader_64_crops_ndarray_copy": lambda: [
            np.ndarray((1, *crop), np.uint8, buffer=arena, offset=o).copy() for o in offsets
        ],
        "reader_64_crops_copy_out": lambda: [copy_out(arena, o, (1, *crop), np.uint8) for o in offsets],
        "prepare_8x8_np_concatenate": lambda: np.concatenate(eights, out=out),
        "prepare_8x8_pack_rows": lambda: pack_rows(out, eights),
        "prepare_64x1_np_concatenate": lambda: np.concatenate(ones, out=out),
        "prepare_64x1_pack_rows": lambda: pack_rows(out, ones),
    }


def reader_cases(repeat: int) -> dict[str, float]:
    """A connection reader taking 256 small submit messages off its socket: ``Connection.recv`` per message
    (two reads, each giving the GIL away) against :class:`FrameReader` (one read for the lot)."""
    import multiprocessing as mp

    from facegate.transport.remote import FrameReader

    msg = ("submit", 12345, "embed", 4096, (1, 112, 112, 3), "uint8", None)
    out: dict[str, float] = {}
    for name in ("reader_256_msgs_connection_recv", "reader_256_msgs_frame_reader"):
        ts = []
        for _ in range(repeat):
            a, b = mp.Pipe(duplex=True)
            for _ in range(256):
                b.send(msg)
            frames = FrameReader(a)
            t0 = time.perf_counter()
            if name.endswith("connection_recv"):
                for _ in range(256):
                    a.recv()
            else:
                n = 0
                while n < 256:
                    n += len(frames.recv_many(1024))
            ts.append(time.perf_counter() - t0)
            a.close()
            b.close()
        out[name] = round(float(np.median(ts)) * 1e3, 4)
    return out


def run(busy: int, repeat: int, rounds: int) -> dict[str, list[float]]:
    """Per case, the median ms of each round."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(2000):
                x += i

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in threads:
        t.start()
    try:  # rounds interleave the cases, so a scheduling hiccup does not land on one case only
        per_round = [
            {**{name: median_ms(fn, repeat) for name, fn in cases().items()}, **reader_cases(repeat)}
            for _ in range(rounds)
        ]
        return {k: [r[k] for r in per_round] for k in per_round[0]}
    finally:
        stop.set()
        for t in threads:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="threads running Python code meanwhile")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--switch-interval-ms", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gil_copy_cpu.json"))
    a = ap.parse_args()
    sys.setswitchinterval(a.switch_interval_ms / 1000)
    res = {
        "benchmark": "gil_copy",
        "command": " ".join(["python", *sys.argv]),
        "unit": "ms per case: the median of each round",
        "idle": run(0, a.repeat, a.rounds),
        f"busy_{a.busy}": run(a.busy, a.repeat, a.rounds),
        "env": env_record(busy=a.busy, repeat=a.repeat, rounds=a.rounds, switch_interval_ms=a.switch_interval_ms),
    }
    write_json(a.out, res)
    for k in ("idle", f"busy_{a.busy}"):
        print(k, res[k])


if __name__ == "__main__":
    main()
