"""facegate.engine.graphs: bucketed CUDA-graph execution, one side stream and one memory pool per device."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import Tensor, nn

from facegate.engine import graphs
from facegate.engine.graphs import GraphedModule, capture_graph, replay
from facegate.errors import EngineError


class _Net(nn.Module):
    """``(N, 8, 8, 3) uint8`` → ``(emb (N, 4) fp32, score (N, 1) fp32)``: a conv (cuDNN) and a linear (cuBLAS)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 8 * 8, 5)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.1

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = torch.relu(self.conv(x.permute(0, 3, 1, 2).float() / 255.0))
        z = self.fc(y.flatten(1))
        return z[:, :4], z[:, 4:]


def _batch(n: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_cpu_runs_eagerly_with_the_modules_results() -> None:
    net = _Net(0).eval()
    gm = GraphedModule(net, (8, 8, 3), torch.uint8, buckets=(1, 4))
    gm.capture()  # no-op off CUDA
    assert gm.capture_seconds == {}
    x = _batch(6)
    with torch.inference_mode():
        got, want = gm(x), net(x)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_compile_options_are_merged_into_the_modes_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []

    def fake_compile(module: nn.Module, **kwargs: object) -> nn.Module:
        calls.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    net = _Net(0).eval()
    GraphedModule(net, (8, 8, 3), torch.uint8, compile_mode="max-autotune-no-cudagraphs")
    GraphedModule(
        net,
        (8, 8, 3),
        torch.uint8,
        compile_mode="max-autotune-no-cudagraphs",
        compile_options=graphs.INDUCTOR_SERVING_OPTIONS,
    )
    assert calls[0] == {"mode": "max-autotune-no-cudagraphs", "dynamic": False}
    assert "mode" not in calls[1] and calls[1]["dynamic"] is False
    opts = calls[1]["options"]
    assert opts["max_autotune"] is True and opts["freezing"] is True and opts["conv_1x1_as_mm"] is True
    assert GraphedModule(net, (8, 8, 3), torch.uint8)._fn is net and len(calls) == 2
    with pytest.raises(ValueError, match="compile_mode"):
        GraphedModule(net, (8, 8, 3), torch.uint8, compile_options={"freezing": True})


def test_default_buckets_are_ascending_and_end_at_64() -> None:
    assert list(graphs.DEFAULT_BUCKETS) == sorted(graphs.DEFAULT_BUCKETS)
    assert graphs.DEFAULT_BUCKETS[0] == 1 and graphs.DEFAULT_BUCKETS[-1] == 64


@pytest.mark.gpu
def test_graphs_equal_eager_for_every_batch_size_including_padding_and_chunking() -> None:
    net = _Net(0).cuda().eval()
    gm = GraphedModule(net, (8, 8, 3), torch.uint8, buckets=(1, 4, 16))
    gm.capture()
    assert set(gm.capture_seconds) == {1, 4, 16}
    with torch.inference_mode():
        for n in (1, 2, 4, 5, 16, 17, 40):  # 2, 5: padded; 17, 40: chunked by the largest bucket
            x = _batch(n, seed=n).cuda()
            got, want = gm(x), net(x)
            assert got[0].shape == (n, 4) and got[1].shape == (n, 1)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_buckets_planned_on_several_threads_capture_graphs_equal_to_eager() -> None:
    net = _Net(3).cuda().eval()
    gm = GraphedModule(net, (8, 8, 3), torch.uint8, buckets=(1, 4, 16, 64))
    gm.capture(threads=4)
    assert set(gm.capture_seconds) == {1, 4, 16, 64}
    with torch.inference_mode():
        for n in (1, 3, 16, 50):
            x = _batch(n, seed=n).cuda()
            got, want = gm(x), net(x)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_two_models_share_one_pool_and_one_side_stream_without_corrupting_each_other() -> None:
    a, b = _Net(1).cuda().eval(), _Net(2).cuda().eval()
    ga = GraphedModule(a, (8, 8, 3), torch.uint8, buckets=(4, 16))
    gb = GraphedModule(b, (8, 8, 3), torch.uint8, buckets=(4, 16))
    ga.capture()
    gb.capture()
    dev = torch.cuda.current_device()
    assert dev in graphs._pools and list(graphs._side_streams) == [dev]
    xa, xb = _batch(16, seed=3).cuda(), _batch(16, seed=4).cuda()
    with torch.inference_mode():
        want_a, want_b = a(xa), b(xb)
        for _ in range(3):  # interleaved replays: b's intermediates reuse a's pool memory, outputs stay apart
            got_a, got_b = ga(xa), gb(xb)
            torch.testing.assert_close(got_a[0], want_a[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_b[0], want_b[0], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_capture_graph_returns_live_outputs_and_replay_refuses_a_side_stream() -> None:
    net = _Net(5).cuda().eval()
    static_in = _batch(4).cuda()
    with torch.inference_mode():
        g, (emb, _score) = capture_graph(net, static_in)
        x = _batch(4, seed=9).cuda()
        static_in.copy_(x)
        replay(g)
        torch.testing.assert_close(emb, net(x)[0], atol=1e-5, rtol=1e-5)
        with torch.cuda.stream(torch.cuda.Stream()), pytest.raises(EngineError, match="default stream"):
            replay(g)


def _recording_jobs(n: int, log: list[tuple[str, int, int]], barrier: threading.Barrier | None = None) -> list:
    def plan(i: int) -> None:
        if barrier is not None:
            barrier.wait(timeout=10)  # times out unless every plan runs at the same time
        log.append(("plan", i, threading.get_ident()))

    def capture(i: int) -> None:
        time.sleep(0.01 * (n - i))  # earlier jobs finish later: the order must still be the jobs'
        log.append(("capture", i, threading.get_ident()))

    return [(lambda i=i: plan(i), lambda i=i: capture(i)) for i in range(n)]


def test_plan_then_capture_plans_concurrently_and_captures_in_order_on_the_planning_thread() -> None:
    log: list[tuple[str, int, int]] = []
    graphs.plan_then_capture(_recording_jobs(4, log, threading.Barrier(4)), threads=4)
    captures = [(i, t) for kind, i, t in log if kind == "capture"]
    assert [i for i, _ in captures] == [0, 1, 2, 3]
    planned_on = {i: t for kind, i, t in log if kind == "plan"}
    assert all(planned_on[i] == t for i, t in captures)  # cuDNN's plan cache is per thread
    assert len(set(planned_on.values())) == 4 and threading.get_ident() not in planned_on.values()


def test_plan_then_capture_with_one_thread_runs_on_the_caller_in_order() -> None:
    log: list[tuple[str, int, int]] = []
    graphs.plan_then_capture(_recording_jobs(3, log), threads=1)
    assert [(k, i) for k, i, _ in log] == [
        ("plan", 0),
        ("capture", 0),
        ("plan", 1),
        ("capture", 1),
        ("plan", 2),
        ("capture", 2),
    ]
    assert {t for *_, t in log} == {threading.get_ident()}


def test_plan_then_capture_raises_the_first_error_after_every_job_and_skips_later_captures() -> None:
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("plan failed")

    jobs = [
        (lambda: done.append("plan0"), lambda: done.append("capture0")),
        (boom, lambda: done.append("capture1")),
        (lambda: done.append("plan2"), lambda: done.append("capture2")),
    ]
    with pytest.raises(RuntimeError, match="plan failed"):
        graphs.plan_then_capture(jobs, threads=3)
    assert "capture1" not in done and "capture2" not in done and {"plan0", "plan2"} <= set(done)


def test_replay_lock_is_one_reentrant_lock_per_device() -> None:
    lock = graphs.replay_lock(torch.device("cpu"))
    assert lock is graphs.replay_lock(torch.device("cpu"))
    with lock, lock:  # re-entrant: a lazy capture runs under the lock its caller holds
        pass


@pytest.mark.gpu
def test_threads_replaying_graphs_of_one_pool_get_their_own_results() -> None:
    """The serving engine's detect, embed and photo threads all replay graphs of the one pool; a later-captured
    graph's outputs may sit in an earlier graph's freed intermediates, so without replay_lock held to copy-out,
    one thread's replay overwrote another's outputs before they were read."""
    import threading

    a, b = _Net(5).cuda().eval(), _Net(6).cuda().eval()
    ga = GraphedModule(a, (8, 8, 3), torch.uint8, buckets=(16,))
    gb = GraphedModule(b, (8, 8, 3), torch.uint8, buckets=(16,))
    ga.capture()
    gb.capture()  # captured second: its outputs may reuse a's intermediate memory
    xa, xb = _batch(16, seed=7).cuda(), _batch(16, seed=8).cuda()
    with torch.inference_mode():
        want = {"a": a(xa)[0].clone(), "b": b(xb)[0].clone()}
    bad: dict[str, int] = {"a": 0, "b": 0}

    def loop(name: str, gm: GraphedModule, x: Tensor) -> None:
        with torch.inference_mode():
            for _ in range(300):
                got = gm(x)[0]
                if not torch.allclose(got, want[name], atol=1e-4, rtol=1e-4):
                    bad[name] += 1

    threads = [threading.Thread(target=loop, args=("a", ga, xa)), threading.Thread(target=loop, args=("b", gb, xb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == {"a": 0, "b": 0}
