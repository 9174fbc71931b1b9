"""models/packing.py: every weight in one buffer, values, strides, dtypes and sharing kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from facegate.models.packing import ALIGN, pack_parameters


def _model() -> nn.Module:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    shared = nn.Linear(8, 8)
    m = nn.Sequential(conv, nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(8), nn.Sequential(shared), shared)
    m(torch.randn(2, 3, 6, 6))  # materialise the lazy layer; the BatchNorm gets running statistics too
    m[1].half()  # a second dtype in the same buffer
    return m.eval()


def _storages(m: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}


def test_pack_keeps_values_strides_dtypes_and_sharing() -> None:
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    strides = {k: v.stride() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    size = pack_parameters([m], "cpu")
    after = m.state_dict()
    assert len(_storages(m)) == 1  # one buffer behind every parameter and buffer
    assert size % ALIGN == 0 and size >= sum(v.numel() * v.element_size() for v in before.values())
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].stride() == strides[k], k
        assert torch.equal(after[k], v), k
    assert list(m.parameters()) == params  # the same Parameter objects (optimisers, hooks keep working)
    assert m[4][0].weight is m[5].weight  # sharing kept
    assert m[0].weight.is_contiguous(memory_format=torch.channels_last)
    m[5].weight.data.add_(1)  # one tensor's bytes, not its neighbours'
    assert torch.equal(m[0].weight, before["0.weight"]) and torch.equal(m[3].bias, before["3.bias"])


def test_pack_runs_the_same_forward_and_skips_other_devices() -> None:
    m = _model()
    m[1].float()
    x = torch.randn(2, 3, 6, 6)
    ref = m(x)
    assert pack_parameters([m], "cpu") > 0
    assert torch.equal(m(x), ref)
    assert pack_parameters([m], "meta") == 0  # nothing lives there
    assert pack_parameters([], "cpu") == 0


@pytest.mark.gpu
def test_pack_on_cuda_holds_one_segment_for_the_weights() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.empty_cache()
    m = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(3)]).cuda().half()  # 3 × 8 MiB: two 20 MiB segments
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pack_parameters([m], "cuda")
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert after < before  # one 24 MiB allocation instead
    assert len(_storages(m)) == 1
