"""The top-k kernels that fsd_eagle.kernels.topk ran before its bitonic sorts, kept as a candidate for
``eval/device/bench_ops.py``'s ``pool_topk``: the same two stages (each chunk's top k, then a merge of the
chunk winners), each taking its top k by k max-reductions one after another (latency-bound: on an H200 a
top-32 over 8 rows of 16,384 entries took 30.1 us against 9.1 for the sorts). Launch them with
``fsd_eagle.kernels.launch_topk(x, k, chunk_topk_passes, merge_topk_passes, chunk, warps)``.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_topk_passes(x_ptr, vals_ptr, idx_ptr, n, stride, CHUNK: tl.constexpr, K: tl.constexpr,
                      K_P2: tl.constexpr):
    """Program (row, chunk): the top K of x[row, chunk * CHUNK:][:CHUNK] to vals/idx[row, chunk * K:]."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, CHUNK)
    cols = chunk * CHUNK + offs
    x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=float("-inf"))
    x = tl.where(cols < n, tl.maximum(x, -3.4028234663852886e38), x)  # real entries above taken and padding
    out = (row * tl.num_programs(1) + chunk) * K
    for i in tl.static_range(K):
        best, j = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(vals_ptr + out + i, best)
        tl.store(idx_ptr + out + i, chunk * CHUNK + j)
        x = tl.where(offs == j, float("-inf"), x)


@triton.jit
def merge_topk_passes(vals_ptr, idx_ptr, out_ptr, m, M: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr):
    """Program row: the top K of the m chunk winners vals/idx[row] (index order kept on ties)."""
    row = tl.program_id(0)
    offs = tl.arange(0, M)
    v = tl.load(vals_ptr + row * m + offs, mask=offs < m, other=float("-inf"))
    ids = tl.load(idx_ptr + row * m + offs, mask=offs < m, other=0)
    for i in tl.static_range(K):
        best, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row * K + i, tl.sum(tl.where(offs == j, ids, 0), axis=0))
        v = tl.where(offs == j, float("-inf"), v)
