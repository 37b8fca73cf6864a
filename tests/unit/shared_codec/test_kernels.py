"""The compiled kernels against numpy on the same arrays (bitwise)."""

from __future__ import annotations

import numpy as np
import pytest

from shared_codec import kernels


@pytest.mark.parametrize("n", [0, 3, 63, 64, 65, 1001, (1 << 22) + 7, (1 << 23) + 2])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.3, 1.0])
def test_changed_indices_matches_numpy(n: int, rate: float) -> None:
    rng = np.random.default_rng(n + int(rate * 100))
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    cur = base.copy()
    pick = rng.random(n) < rate
    cur[pick] ^= rng.integers(1, 1 << 16, int(pick.sum()), dtype=np.uint16)
    got = kernels.changed_indices(cur, base)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.flatnonzero(cur != base))


def test_changed_indices_every_lane_and_word_edge() -> None:
    # two full 64-word blocks (the bitmap pass), 5 words after them, a 3-element tail
    base = np.zeros(4 * (2 * 64 + 5) + 3, dtype=np.uint16)
    for i in range(base.size):  # one changed element at each position in turn
        cur = base.copy()
        cur[i] = 0x8000 if i % 2 else 1  # sign bit and lowest bit
        np.testing.assert_array_equal(kernels.changed_indices(cur, base), [i])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.int64])
def test_changed_indices_other_widths_and_views(dtype: type) -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 100, 5000).astype(dtype)
    cur = base.copy()
    cur[::7] += 1
    np.testing.assert_array_equal(kernels.changed_indices(cur, base), np.arange(0, 5000, 7))
    a16 = rng.integers(0, 9, 4000, dtype=np.uint16)
    b16 = a16.copy()
    b16[1::6] += 1
    np.testing.assert_array_equal(  # strided views take the numpy path
        kernels.changed_indices(a16[::2], b16[::2]), np.flatnonzero(a16[::2] != b16[::2])
    )


def test_changed_indices_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one shape and dtype"):
        kernels.changed_indices(np.zeros(4, np.uint16), np.zeros(5, np.uint16))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_scatters_match_numpy(dtype: type) -> None:
    rng = np.random.default_rng(2)
    info = np.iinfo(dtype)
    arr = rng.integers(info.min, info.max, 10_000, dtype=dtype)
    idx = np.sort(rng.choice(arr.size, 700, replace=False)).astype(np.int64)
    vals = rng.integers(info.min, info.max, idx.size, dtype=dtype)
    want = arr.copy()
    want[idx] ^= vals
    got = arr.copy()
    kernels.xor_scatter(got, idx, vals)
    np.testing.assert_array_equal(got, want)
    kernels.xor_scatter(got, idx, vals)  # XOR twice restores the old bits
    np.testing.assert_array_equal(got, arr)
    want = arr.copy()
    want[idx] = vals
    kernels.set_scatter(got, idx, vals)
    np.testing.assert_array_equal(got, want)
