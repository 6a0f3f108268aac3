"""Candidate Triton top-k kernels for ``eval/device/bench_ops.py`` (``--skip`` leaves them out): the same two
stages as fsd_eagle.kernels (each chunk's top k, then a merge of the chunk winners), but each stage takes its
top k with one partial bitonic sort (``tl.topk``) of value-index keys instead of k max-reductions, which
run one after another (latency-bound: the pool top-32 of a sampled round, two kernels per draft level, took
about 27 us on an H200, a top-8 about 7 us). A key packs an order-preserving int32 image of the float32 value
above the complement of its index (int64), so that among equal values the lower index comes first, as in
fsd_eagle.kernels.topk. Launch them with ``fsd_eagle.kernels.launch_topk(x, k, chunk, merge)``.
"""

import triton
import triton.language as tl

LOW = tl.constexpr(0xFFFFFFFF)  # the index field of a key


@triton.jit
def _ordered(x):
    """float32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(key):
    """The inverse of _ordered."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def chunk_topk_sort(x_ptr, vals_ptr, idx_ptr, n, stride, CHUNK: tl.constexpr, K: tl.constexpr):
    """Program (row, chunk): the top K of x[row, chunk * CHUNK:][:CHUNK] to vals/idx[row, chunk * K:]."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=float("-inf"))
    x = tl.where(cols < n, tl.maximum(x, -3.4028234663852886e38), x)  # real entries above the padding
    keys = (_ordered(x).to(tl.int64) << 32) | (LOW - cols.to(tl.int64))
    top = tl.topk(keys, K)  # [K], descending
    out = (row * tl.num_programs(1) + chunk) * K + tl.arange(0, K)
    tl.store(vals_ptr + out, _unordered((top >> 32).to(tl.int32)))
    tl.store(idx_ptr + out, LOW - (top & LOW))


@triton.jit
def merge_topk_sort(vals_ptr, idx_ptr, out_ptr, m, M: tl.constexpr, K: tl.constexpr):
    """Program row: the top K of the m chunk winners vals/idx[row] (lower index first on ties)."""
    row = tl.program_id(0)
    offs = tl.arange(0, M)
    v = tl.load(vals_ptr + row * m + offs, mask=offs < m, other=float("-inf"))
    ids = tl.load(idx_ptr + row * m + offs, mask=offs < m, other=LOW)
    keys = (_ordered(v).to(tl.int64) << 32) | (LOW - ids)
    top = tl.topk(keys, K)
    tl.store(out_ptr + row * K + tl.arange(0, K), LOW - (top & LOW))
