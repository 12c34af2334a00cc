"""Element alignment of data pointers through the numpy binding (no PyTorch needed).

The library refuses data whose address is not a multiple of the element size (4 bytes for
float32, 2 for float16) with ForkattnInvalidArgument naming the array: such a view (e.g.
``np.frombuffer(..., offset=2)``) would otherwise be read with misaligned loads, which is
undefined behaviour in C."""

import numpy as np
import pytest

import forkattn
from forkattn import numpy_api as fnp

T, H, D = 6, 2, 8  # one prompt of 2 rows, two responses of 2 rows


def _view(dtype, offset, rng):
    """A [T, H, D] array ``offset`` bytes into a fresh buffer (its data pointer is then
    ``offset`` bytes past the buffer's, which numpy allocates suitably aligned)."""
    n = T * H * D
    buf = bytearray(offset + n * np.dtype(dtype).itemsize)
    a = np.frombuffer(buf, dtype=dtype, count=n, offset=offset).reshape(T, H, D)
    a[...] = rng.uniform(-1, 1, a.shape)  # bytearray: writable
    return a


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_misaligned_f32_view_refused(which):
    rng = np.random.default_rng(0)
    arrs = {name: _view(np.float32, 2 if name == which else 0, rng) for name in "qkv"}
    assert arrs[which].ctypes.data % 4 == 2
    assert not arrs[which].flags.aligned
    with pytest.raises(forkattn.ForkattnInvalidArgument, match=r"\b%s\b.*aligned" % which):
        fnp.prefix_attention(arrs["q"], arrs["k"], arrs["v"], 2, [2, 2])


def test_misaligned_f16_view_refused():
    rng = np.random.default_rng(1)
    q, k, v = _view(np.float16, 1, rng), _view(np.float16, 0, rng), _view(np.float16, 0, rng)
    assert q.ctypes.data % 2 == 1
    with pytest.raises(forkattn.ForkattnInvalidArgument, match=r"\bq\b.*aligned"):
        fnp.prefix_attention(q, k, v, 2, [2, 2])


def test_element_aligned_view_accepted():
    """4 bytes into a buffer: aligned to float32 elements (not to 16 bytes), accepted and equal
    to the same call on aligned copies."""
    rng = np.random.default_rng(2)
    q, k, v = (_view(np.float32, 4, rng) for _ in range(3))
    assert q.ctypes.data % 4 == 0
    got = fnp.prefix_attention(q, k, v, 2, [2, 2])
    want = fnp.prefix_attention(q.copy(), k.copy(), v.copy(), 2, [2, 2])
    np.testing.assert_array_equal(got, want)
