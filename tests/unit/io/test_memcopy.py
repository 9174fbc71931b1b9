"""facegate.io.memcopy: copies that keep the GIL equal numpy's, small and large."""

from __future__ import annotations

import numpy as np
import pytest

from facegate.io import memcopy
from facegate.io.memcopy import copy_in, copy_out, pack_rows


@pytest.fixture(params=["small", "large"])
def threshold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test through the GIL-held path and through numpy's (threshold lowered to 0)."""
    if request.param == "large":
        monkeypatch.setattr(memcopy, "GIL_COPY_MAX_BYTES", 0)
    return str(request.param)


def test_copy_in_then_copy_out_round_trips_at_an_offset(threshold: str) -> None:
    rng = np.random.default_rng(0)
    buf = memoryview(bytearray(4096))
    arr = rng.integers(0, 255, (3, 5, 7), dtype=np.uint8)
    copy_in(buf, 64, arr[:, ::-1])  # a non-contiguous view is stored C-contiguous
    got = copy_out(buf, 64, (3, 5, 7), "uint8")
    np.testing.assert_array_equal(got, arr[:, ::-1])
    assert got.flags.writeable and got.flags.c_contiguous
    got[0, 0, 0] ^= 1  # a copy: the buffer is untouched
    np.testing.assert_array_equal(copy_out(buf, 64, (3, 5, 7), np.uint8), arr[:, ::-1])
    f = rng.standard_normal((4, 3)).astype(np.float32)
    copy_in(buf, 1024, f)
    np.testing.assert_array_equal(copy_out(buf, 1024, (4, 3), np.float32), f)
    assert bytes(buf[:64]) == bytes(64)  # nothing written before the offset


def test_pack_rows_equals_concatenate(threshold: str) -> None:
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 255, (k, 4, 4, 3), dtype=np.uint8) for k in (1, 3, 0, 2)]
    out = np.zeros((8, 4, 4, 3), np.uint8)
    assert pack_rows(out, parts) == 6
    np.testing.assert_array_equal(out[:6], np.concatenate(parts))
    assert not out[6:].any()  # rows past the parts are left alone
