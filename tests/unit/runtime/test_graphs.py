"""facegate.runtime.graphs: bucketed CUDA-graph execution, one side stream and one memory pool per device."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from facegate.errors import EngineError
from facegate.runtime import graphs
from facegate.runtime.graphs import GraphedModule, capture_graph, replay


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
    assert gm._graphs == {}
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
    GraphedModule(net, (8, 8, 3), torch.uint8, buckets=(1,), compile_mode="max-autotune-no-cudagraphs")
    GraphedModule(
        net,
        (8, 8, 3),
        torch.uint8,
        buckets=(1,),
        compile_mode="max-autotune-no-cudagraphs",
        compile_options=graphs.INDUCTOR_SERVING_OPTIONS,
    )
    # the mode alone is spelt out as its options (what torch.compile(mode=...) applies)
    mode_options = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    assert calls[0] == {"options": mode_options, "dynamic": False}
    assert "mode" not in calls[1] and calls[1]["dynamic"] is False
    opts = calls[1]["options"]
    assert opts["max_autotune"] is True and opts["freezing"] is True and opts["conv_1x1_as_mm"] is True
    assert GraphedModule(net, (8, 8, 3), torch.uint8, buckets=(1,))._fn is net and len(calls) == 2


@pytest.mark.gpu
def test_graphs_equal_eager_for_every_batch_size_including_padding_and_chunking() -> None:
    net = _Net(0).cuda().eval()
    gm = GraphedModule(net, (8, 8, 3), torch.uint8, buckets=(1, 4, 16))
    gm.capture()
    assert set(gm._graphs) == {1, 4, 16}
    with torch.inference_mode():
        for n in (1, 2, 4, 5, 16, 17, 40):  # 2, 5: padded; 17, 40: chunked by the largest bucket
            x = _batch(n, seed=n).cuda()
            got, want = gm(x), net(x)
            assert got[0].shape == (n, 4) and got[1].shape == (n, 1)
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
